"""``qrag eval`` evaluates the data it is told to, for any checkpoint, and refuses questions the
checkpoint trained on unless asked (issue 33: a mixed-data checkpoint with ``--data FILE --split
all`` scored its training sources instead of FILE, and ``--dataset hotpotqa`` was refused until
``data.sources=[]`` was added by hand)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import make_hotpot_records
from qrag.config import ConfigError, DataConfig
from qrag.evaluation.eval_data import eval_data_config


def test_data_and_dataset_mean_what_they_say():
    mixed = DataConfig(
        dataset="mixed", sources=[{"dataset": "hotpotqa", "path": "/data/a.json"}, {"dataset": "musique"}], tasks=[]
    )
    assert eval_data_config(mixed) is mixed
    by_source = eval_data_config(mixed, data="/data/a.json")
    assert (by_source.dataset, by_source.path, by_source.sources) == ("hotpotqa", "/data/a.json", [])
    other = eval_data_config(mixed, data="/data/b.json", dataset="hotpotqa")
    assert (other.dataset, other.path, other.sources) == ("hotpotqa", "/data/b.json", [])
    shipped = eval_data_config(mixed, dataset="hotpotqa")
    assert (shipped.dataset, shipped.path, shipped.hub, shipped.sources) == ("hotpotqa", None, None, [])
    with pytest.raises(ConfigError, match="--dataset"):
        eval_data_config(mixed, data="/data/b.json")
    hotpot = DataConfig(dataset="hotpotqa", path="/data/train.json", hub="x/y")
    assert (
        eval_data_config(hotpot, data="/data/dev.json").path,
        eval_data_config(hotpot, data="/data/dev.json").hub,
    ) == ("/data/dev.json", None)
    assert eval_data_config(hotpot, dataset="musique").path is None


@pytest.fixture(scope="module")
def mixed_run(tiny_encoder, hotpot_file, tmp_path_factory):
    from qrag.cli import main

    root = tmp_path_factory.mktemp("mixed")
    other = root / "other.json"
    other.write_text(json.dumps([{**r, "_id": f"other{i}"} for i, r in enumerate(make_hotpot_records(30, seed=5))]))
    sources = f"data.sources=[{{dataset: hotpotqa, path: {hotpot_file}, train: all}}]"
    assert (
        main(
            [
                "train",
                "--no-progress",
                f"model.encoder={tiny_encoder}",
                "data.dataset=mixed",
                sources,
                f"out_dir={root}",
                "name=mix",
                "updates=1",
                "learner.episodes_per_update=4",
                "learner.micro_batch=4",
                "data.chunk_tokens=48",
                "eval_limit=4",
                "data.val_fraction=0.2",
                "distributed.mlflow_uri=none",
            ]
        )
        == 0
    )
    return root / "mix" / "final", Path(hotpot_file), other


def evaluate(capsys, *args: str) -> tuple[int, dict | str]:
    from qrag.cli import main

    code = main(["eval", "--device", "cpu", *args])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if code == 0 else out.err)


def test_the_checkpoint_records_the_sources_it_trained_on(mixed_run):
    meta = json.loads((mixed_run[0] / "qrag.json").read_text())
    recorded = meta["trained_sources"]
    n_records = len(json.loads(mixed_run[1].read_text()))
    assert 0 < recorded["count"] < n_records  # all of the file but its validation part
    assert len(recorded["keys"]) == recorded["count"]


def test_eval_data_file_of_a_mixed_checkpoint(mixed_run, capsys):
    ck, trained_file, other = mixed_run
    code, summary = evaluate(
        capsys, "--checkpoint", str(ck), "--data", str(other), "--dataset", "hotpotqa", "--split", "all"
    )
    assert code == 0 and summary["num_samples"] == 30 and summary["dataset"] == "hotpotqa"
    assert summary["train_questions"] == {"checked": True, "allowed": False, "trained_on": 0}
    code, err = evaluate(capsys, "--checkpoint", str(ck), "--data", str(other), "--split", "all")
    assert code == 2 and "--dataset" in err


def test_training_questions_are_refused_unless_allowed(mixed_run, capsys):
    ck, trained_file, _ = mixed_run
    code, err = evaluate(capsys, "--checkpoint", str(ck), "--data", str(trained_file), "--split", "all")
    assert code == 2 and "--allow-train-questions" in err and "Traceback" not in err
    code, summary = evaluate(
        capsys, "--checkpoint", str(ck), "--data", str(trained_file), "--split", "all", "--allow-train-questions"
    )
    assert code == 0 and summary["num_samples"] == len(json.loads(trained_file.read_text()))
    recorded = json.loads((ck / "qrag.json").read_text())["trained_sources"]["count"]
    assert summary["train_questions"] == {"checked": True, "allowed": True, "trained_on": recorded}


def test_dataset_alone_needs_no_sources_override(mixed_run, capsys, shared_data):
    code, summary = evaluate(capsys, "--checkpoint", str(mixed_run[0]), "--dataset", "hotpotqa", "--limit", "3")
    assert code == 0 and summary["num_samples"] == 3 and summary["data"]["sources"] == []
