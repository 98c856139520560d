"""The headline protocol end to end on CPU with a tiny encoder, as docs/long-contexts.md has the
lead run it on a GPU ("Re-running the headline rows"): per training seed, training in slices with
``--no-eval`` on the last, then ``--eval-only`` (checkpoint chosen on val at a longer length, dev
evaluated once on the frozen draw); the untrained encoder once (``--baseline-only``); then
``qrag combine-seeds``: means with 95% intervals, the untrained row beside them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from test_longctx_data import write_qa1_data

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def longctx():
    sys.path.insert(0, str(ROOT / "bench"))
    import longctx

    return longctx


def test_seeds_train_in_slices_then_evaluate_then_combine(longctx, tiny_encoder, tmp_path, capsys):
    from qrag.cli import main

    data, out, runs = write_qa1_data(tmp_path), tmp_path / "out", tmp_path / "runs"
    common = [
        "--task",
        "qa1",
        "--encoder",
        tiny_encoder,
        "--babi",
        str(data / "babi"),
        "--novels",
        str(data / "bg"),
        "--updates",
        "4",
        "--train-tokens",
        "512",
        "--runs",
        str(runs),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--lengths",
        "1k,2k",
        "--questions",
        "3",
        "--val-questions",
        "2",
        "data.samples_per_task=8",
        "data.dev_samples_per_task=2",
        "data.val_fraction=0.5",
        "data.chunk_tokens=32",
        "learner.episodes_per_update=4",
        "learner.micro_batch=4",
        "learner.warmup_updates=1",
        "checkpoint_every=2",
        "eval_every=2",
        "keep_best=true",
    ]
    for seed in (0, 1):
        s = ["--seed", str(seed)]
        assert longctx.main(common + s + ["--stop-at", "2"]) == 0
        assert longctx.main(common + s + ["--resume", "--no-eval"]) == 0
        assert not (out / f"longctx_qa1_seed{seed}.json").exists()  # --no-eval: nothing evaluated
        assert (
            longctx.main(
                common + s + ["--eval-only", "--select-lengths", "1k", "--select-questions", "2", "--no-baseline"]
            )
            == 0
        )
        result = json.loads((out / f"longctx_qa1_seed{seed}.json").read_text())
        training = result["training"]
        assert training["config"]["seed"] == seed and training["checkpoint"].startswith(str(runs / f"qa1-seed{seed}"))
        assert all(sl["git_commit"] and "git_dirty" in sl for sl in training["slices"])
        assert training["data"]["hard_negatives"] == 0 and training["data"]["val_sources"] > 0
        assert "val split at 1k" in result["selected_on"] and "dev: never used for choosing" in result["selected_on"]
        assert [r["model"] for r in result["rows"]] == ["Q-RAG", "Q-RAG"]
    assert longctx.main(common + ["--baseline-only"]) == 0
    untrained = json.loads((out / "longctx_qa1_untrained.json").read_text())
    assert {r["model"] for r in untrained["rows"]} == {"untrained"} and untrained["dev_draw"]["name"]
    capsys.readouterr()
    headline = out / "headline.json"
    files = [str(out / f"longctx_qa1_seed{s}.json") for s in (0, 1)] + [str(out / "longctx_qa1_untrained.json")]
    assert main(["combine-seeds", *files, "--out", str(headline), "--replicates", "100"]) == 0
    combined = json.loads(headline.read_text())
    rows = {(r["model"], r["length"]): r for r in combined["rows"]}
    assert rows[("Q-RAG", 1024)]["num_seeds"] == 2 and rows[("untrained", 1024)]["num_seeds"] == 1
    assert all("fact_em_ci" in r and r["num_samples"] == 3 for r in combined["rows"])
    assert {(d["a"], d["b"]) for d in combined["differences"]} == {("Q-RAG", "untrained")}
