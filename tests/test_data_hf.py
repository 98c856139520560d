"""Records through Hugging Face ``datasets``: a hub-style folder (no network), parquet, save_to_disk."""

from __future__ import annotations

import pytest

datasets = pytest.importorskip("datasets")

from qrag.config import DataConfig  # noqa: E402
from qrag.data import DataError, load_samples  # noqa: E402
from qrag.data.hf import hotpot_layout  # noqa: E402

from conftest import make_hotpot_records  # noqa: E402


def words(texts):
    return [len(t.split()) for t in texts]


def hf_layout(record: dict) -> dict:
    """The official record in the hub's column layout (as ``hotpot_qa``/``distractor`` serves it)."""
    return {
        "id": record["_id"],
        "question": record["question"],
        "answer": record["answer"],
        "type": record["type"],
        "level": record["level"],
        "supporting_facts": {
            "title": [t for t, _ in record["supporting_facts"]],
            "sent_id": [i for _, i in record["supporting_facts"]],
        },
        "context": {"title": [t for t, _ in record["context"]], "sentences": [s for _, s in record["context"]]},
    }


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")  # keep ~/.cache clean


@pytest.fixture
def hub_folder(tmp_path):
    """A hub dataset as load_dataset sees one: a train and a validation split in parquet files."""
    folder = tmp_path / "hotpot_hub"
    folder.mkdir()
    train, validation = make_hotpot_records(12, seed=3), make_hotpot_records(4, seed=4)
    for r in validation:
        r["_id"] = "dev-" + r["_id"]
    datasets.Dataset.from_list([hf_layout(r) for r in train]).to_parquet(str(folder / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_list([hf_layout(r) for r in validation]).to_parquet(
        str(folder / "validation-00000-of-00001.parquet")
    )
    return folder, train, validation


def test_hub_splits_feed_train_and_dev(hub_folder):
    folder, train, validation = hub_folder
    cfg = DataConfig(hub=str(folder))  # the one line: data.hub=hotpotqa/hotpot_qa:distractor, here a local folder
    got_train, got_dev = load_samples(cfg, "train", words), load_samples(cfg, "dev", words)
    assert [s.id for s in got_train] == [r["_id"] for r in train]  # the hub's own splits, no id-hash split
    assert [s.id for s in got_dev] == [r["_id"] for r in validation]
    # same samples as the official layout read from a file
    from qrag.data.hotpotqa import parse_record

    expected = [parse_record(r, "x", 220, words) for r in train]
    assert [(s.chunks, s.support, s.question) for s in got_train] == [
        (s.chunks, s.support, s.question) for s in expected
    ]


def test_bad_hub_row_names_source_and_row(tmp_path):
    records = [hf_layout(r) for r in make_hotpot_records(3)]
    records[1]["supporting_facts"]["title"][0] = "Nowhere"
    folder = tmp_path / "bad_hub"
    folder.mkdir()
    datasets.Dataset.from_list(records).to_parquet(str(folder / "train.parquet"))
    with pytest.raises(
        DataError, match=r"hub .*bad_hub \[train\]: row 1 \(_id=q0001\): supporting fact \['Nowhere', 0\]"
    ):
        load_samples(DataConfig(hub=str(folder), dev_fraction=0.0), "train", words)


def test_unreachable_hub_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match=r"data.hub='no-such-owner/no_such_set:cfg': cannot load it"):
        load_samples(DataConfig(hub="no-such-owner/no_such_set:cfg"), "train", words)


def test_parquet_and_save_to_disk_paths(tmp_path):
    rows = [
        {"id": f"r{i}", "question": f"Q{i}?", "chunks": ["a b", "c d", "e f"], "support": [i % 3], "answer": "x"}
        for i in range(20)
    ]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "mine.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for path in (tmp_path / "mine.parquet", tmp_path / "saved"):
        cfg = DataConfig(dataset="jsonl", path=str(path))
        train, dev = load_samples(cfg, "train", words), load_samples(cfg, "dev", words)
        assert sorted(s.id for s in train + dev) == sorted(r["id"] for r in rows) and dev  # id-hash split
        assert train[0].chunks == ["a b", "c d", "e f"]


def test_hotpot_layout_checks_column_lengths():
    record = {"id": "a", "context": {"title": ["x", "y"], "sentences": [["s"]]}}
    with pytest.raises(DataError, match="row 3: context.title and context.sentences must be lists of the same length"):
        hotpot_layout(record, "row 3")
    assert hotpot_layout({"_id": "a", "context": None}, "w") == {"_id": "a"}  # Arrow's None = an absent field
