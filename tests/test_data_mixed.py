"""dataset=mixed: several loaders as one dataset, each source's parts routed to train and dev."""

from __future__ import annotations

import json
import logging

import pytest

from qrag.config import ConfigError, DataConfig, load_config
from qrag.data import DataError, load_samples
from qrag.data.splits import in_split

from conftest import ROOT, make_hotpot_records


def words(texts):
    return [len(t.split()) for t in texts]


def musique_line(i: int, hops: int) -> dict:
    paragraphs = [
        {"idx": j, "title": f"T{i}-{j}", "paragraph_text": f"Text {j}.", "is_supporting": j < hops} for j in range(6)
    ]
    return {"id": f"{hops}hop__{i}", "question": f"Q{i}?", "answer": "A", "answerable": True, "paragraphs": paragraphs}


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.setenv("QRAG_DATA_DIR", str(tmp_path))
    (tmp_path / "dev.json").write_text(json.dumps(make_hotpot_records(40, seed=1)))
    extra = make_hotpot_records(5, seed=2)
    for r in extra:
        r["_id"] = "train-" + r["_id"]
    (tmp_path / "train.json").write_text(json.dumps(extra))
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(musique_line(i, 2 + i % 2)) + "\n" for i in range(6)))
    return tmp_path


def mixed(**extra) -> DataConfig:
    return DataConfig(
        dataset="mixed",
        sources=[
            {"dataset": "hotpotqa", "path": "dev.json"},  # relative: under QRAG_DATA_DIR
            {"dataset": "hotpotqa", "path": "train.json", "train": "all", "dev": "none"},
            {"dataset": "musique", "path": "m.jsonl", "train": "all", "dev": "none", "max_support": 2},
        ],
        **extra,
    )


def test_sources_are_routed_to_train_and_dev(files, caplog):
    with caplog.at_level(logging.WARNING):
        train, dev = (load_samples(mixed(), split, words) for split in ("train", "dev"))
    dev_ids = {r["_id"] for r in make_hotpot_records(40, seed=1) if in_split(r["_id"], "dev", 0.2)}
    assert {s.id for s in dev} == dev_ids and {s.meta["source"] for s in dev} == {"hotpotqa"}
    by_source = {}
    for s in train:
        by_source.setdefault(s.meta["source"], set()).add(s.id)
    assert len(by_source["hotpotqa"]) == 40 - len(dev_ids) + 5  # train part of one file, all of the other
    assert by_source["musique"] == {f"2hop__{i}" for i in range(0, 6, 2)}  # 3-hop records left out
    assert "left out 3 record(s) with more than 2 support chunks" in caplog.text
    assert not {s.id for s in train} & dev_ids
    # dev equals the hotpotqa loader's own dev split: figures stay comparable with its preset
    alone = load_samples(DataConfig(dataset="hotpotqa", path=str(files / "dev.json")), "dev", words)
    assert [s.chunks for s in alone] == [s.chunks for s in dev]
    assert len(load_samples(mixed(limit=4), "train", words)) == 4


def test_duplicate_ids_across_sources_are_an_error(files):
    cfg = DataConfig(
        dataset="mixed",
        sources=[
            {"dataset": "hotpotqa", "path": "dev.json"},
            {"dataset": "hotpotqa", "path": "dev.json", "train": "all", "dev": "none"},
        ],
    )
    with pytest.raises(DataError, match="ids must be unique across data.sources"):
        load_samples(cfg, "train", words)


@pytest.mark.parametrize(
    "sources,message",
    [
        ([], "needs data.sources"),
        ([{"dataset": "hotpotqa", "split": "all"}], r"data.sources\[0\]: unknown key 'split'"),
        ([{"dataset": "hotpotqa", "train": "dev"}], r"data.sources\[0\].train: expected one of train \| all \| none"),
        ([{"dataset": "mixed"}], "other than 'mixed'"),
        ([{"dataset": "hotpotqa", "max_support": 0}], "max_support: expected a positive integer"),
    ],
)
def test_bad_sources_name_the_key(files, sources, message):
    with pytest.raises(ConfigError, match=message):
        load_samples(DataConfig(dataset="mixed", sources=sources), "train", words)


def test_mixed_preset_keeps_the_hotpot_dev_split(shared_data, monkeypatch):
    monkeypatch.setenv("QRAG_DATA_DIR", str(shared_data))
    mixed_cfg = load_config(ROOT / "configs" / "hotpot-mixed.yaml", ["data.limit=null"])
    hotpot_cfg = load_config(ROOT / "configs" / "hotpot.yaml")
    assert [s.id for s in load_samples(mixed_cfg.data, "dev", words)] == [
        s.id for s in load_samples(hotpot_cfg.data, "dev", words)
    ]
    sources = {s.meta["source"] for s in load_samples(mixed_cfg.data, "train", words)}
    assert sources == {"hotpotqa", "musique", "2wiki"}


def test_keys_a_loader_would_ignore_are_errors():
    with pytest.raises(DataError, match="data.sources is read by data.dataset=mixed only"):
        load_samples(DataConfig(sources=[{"dataset": "hotpotqa"}]), "train", words)
    with pytest.raises(DataError, match="data.hub is read by hotpotqa, musique, 2wiki, jsonl only"):
        load_samples(DataConfig(dataset="babilong", hub="x/y"), "train", words)
