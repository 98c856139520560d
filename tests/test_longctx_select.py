"""bench/longctx_select.py on CPU with a tiny encoder: each variant trains on the data its own
``data.*`` settings make (issue 33: a hard-negative variant trained on the shared data, without
hard negatives), every variant is scored on the same validation questions, and a variant whose
data would hold a validation story is refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from test_longctx_data import write_qa1_data

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def select():
    sys.path.insert(0, str(ROOT / "bench"))
    import longctx_select

    return longctx_select


def planted_data(root: Path) -> Path:
    """write_qa1_data's books, the training book with sentences that share words with the stories
    (what hard negatives are drawn from)."""
    data = write_qa1_data(root)
    book = data / "bg" / "train" / "book1.txt"
    lines = book.read_text().split("\n")
    for i in range(12):
        lines.insert(29 * i + 3, "\nOld Mary moved the candle to the bathroom by the hallway window.\n")
    book.write_text("\n".join(lines))
    return data


def common_args(data: Path, encoder: str, out: Path) -> list[str]:
    return [
        "--task",
        "qa1",
        "--encoder",
        encoder,
        "--babi",
        str(data / "babi"),
        "--novels",
        str(data / "bg"),
        "--updates",
        "1",
        "--val-questions",
        "2",
        "--device",
        "cpu",
        "--out",
        str(out),
        "data.context_tokens=512",
        "data.samples_per_task=6",
        "data.val_fraction=0.5",
        "data.chunk_tokens=32",
        "learner.episodes_per_update=2",
        "learner.micro_batch=2",
        "learner.warmup_updates=1",
    ]


def test_each_variant_trains_on_its_own_data_settings(select, tiny_encoder, tmp_path):
    data, out = planted_data(tmp_path), tmp_path / "out"
    assert (
        select.main(
            common_args(data, tiny_encoder, out)
            + [
                "--variant",
                "plain:",
                "--variant",
                "hard:data.hard_negatives=3",
                "--variant",
                "long:data.context_tokens=768",
            ]
        )
        == 0
    )
    result = json.loads((out / "longctx_select_qa1.json").read_text())
    variants = {v["name"]: v for v in result["variants"] if "data" in v}
    assert set(variants) == {"plain", "hard", "long"}
    plain, hard, long = (variants[k]["data"] for k in ("plain", "hard", "long"))
    assert plain["hard_negatives"] == 0 and hard["hard_negatives"] >= 1
    assert abs(plain["context_tokens"] - 512) <= 0.02 * 512 and abs(long["context_tokens"] - 768) <= 0.02 * 768
    # One validation set for all: the shared settings' held-out stories, never trained on.
    assert len({v["data"]["val_samples"] for v in variants.values()}) == 1
    assert "same questions for every variant" in result["selected_on"]


def test_a_variant_that_would_train_on_validation_stories_is_refused(select, tiny_encoder, tmp_path):
    data, out = write_qa1_data(tmp_path), tmp_path / "out"
    with pytest.raises(SystemExit, match="validation source"):
        select.main(common_args(data, tiny_encoder, out) + ["--variant", "leaky:data.val_fraction=0.2"])
