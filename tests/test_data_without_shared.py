"""A checkout without ``../shared/data`` (a pip install, a fresh clone): the error says how to give
data, and the hub path (here a ``datasets`` ``save_to_disk`` folder standing in for the hub)
trains and evaluates with no data folder at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")

from qrag.config import DataConfig  # noqa: E402
from qrag.data import DataError, load_samples  # noqa: E402
from qrag.data import paths  # noqa: E402

from conftest import make_hotpot_records  # noqa: E402
from test_data_hf import hf_layout, words  # noqa: E402


@pytest.fixture
def no_shared(tmp_path, monkeypatch):
    """No $QRAG_DATA_DIR and no shared/data beside the working directory or the package."""
    monkeypatch.delenv("QRAG_DATA_DIR", raising=False)
    # A package outside tmp_path's folders: their parents are searched too, and a machine may hold /tmp/shared/data.
    monkeypatch.setattr(paths, "_HERE", Path("/qrag-not-installed/site-packages/qrag/data/paths.py"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    return work


@pytest.fixture
def saved_hub(tmp_path):
    """``load_dataset("hotpotqa/hotpot_qa", "distractor").save_to_disk(...)`` as a machine with the
    hub would write it: the hub's column layout, a train and a validation split."""
    train, validation = make_hotpot_records(16, seed=5), make_hotpot_records(6, seed=6)
    for r in validation:
        r["_id"] = "dev-" + r["_id"]
    folder = tmp_path / "hotpot_qa_distractor"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([hf_layout(r) for r in train]),
            "validation": datasets.Dataset.from_list([hf_layout(r) for r in validation]),
        }
    ).save_to_disk(str(folder))
    return folder, train, validation


def test_no_data_folder_names_every_way_to_give_data(no_shared):
    with pytest.raises(DataError) as err:
        load_samples(DataConfig(), "train", words)
    message = str(err.value)
    assert message.startswith("no data directory")
    for way in (
        "QRAG_DATA_DIR=",
        "data.path=",
        "--data",
        "data.hub=hotpotqa/hotpot_qa:distractor",
        "data.dataset=musique data.hub=dgslibisey/MuSiQue",
        "save_to_disk",
    ):
        assert way in message, way


def test_a_data_dir_that_is_not_there_says_so(no_shared, monkeypatch):
    monkeypatch.setenv("QRAG_DATA_DIR", str(no_shared / "nope"))
    with pytest.raises(
        DataError, match=r"QRAG_DATA_DIR=.*nope is not a folder: .*data.hub=hotpotqa/hotpot_qa:distractor"
    ):
        load_samples(DataConfig(), "dev", words)


def test_a_saved_hub_dataset_gives_the_same_samples_as_the_file(no_shared, saved_hub, tmp_path):
    folder, train, validation = saved_hub
    cfg = DataConfig(hub=str(folder))
    got_train, got_dev = load_samples(cfg, "train", words), load_samples(cfg, "dev", words)
    assert [s.id for s in got_dev] == [r["_id"] for r in validation]  # the hub's validation split is dev
    official = tmp_path / "official.json"
    official.write_text(json.dumps(train))
    from_file = load_samples(DataConfig(path=str(official), dev_fraction=0.0), "train", words)
    assert [(s.id, s.chunks, s.support, s.answer) for s in got_train] == [
        (s.id, s.chunks, s.support, s.answer) for s in from_file
    ]


def test_train_from_the_hub_path_without_a_data_folder(no_shared, saved_hub, tiny_encoder, capsys):
    from qrag.cli import main

    folder, _, validation = saved_hub
    code = main(
        [
            "train",
            f"data.hub={folder}",
            f"model.encoder={tiny_encoder}",
            "data.chunk_tokens=48",
            "updates=1",
            "learner.episodes_per_update=4",
            "learner.micro_batch=4",
            "data.cache_dir=none",
            "distributed.mlflow_uri=none",
            f"out_dir={Path.cwd() / 'runs'}",
            "--no-progress",
        ]
    )
    assert code == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_samples"] == len(validation) and Path(summary["checkpoint"]).is_dir()
