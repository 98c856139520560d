"""bench/longctx.py end to end on CPU with a tiny encoder: a run cut into two slices (the second
resumes the first's checkpoint), the reported checkpoint chosen on the val split at a long
length among the periodic, keep_best and final ones, then dev evaluated once."""

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


@pytest.fixture()
def data(tmp_path):
    return write_qa1_data(tmp_path)


def test_sliced_run_resumes_and_chooses_its_checkpoint_on_val(longctx, data, tiny_encoder, tmp_path):
    out, runs = tmp_path / "out", tmp_path / "runs"
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
        "1k",
        "--questions",
        "2",
        "--val-questions",
        "0",
        "--no-baseline",
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
    assert longctx.main(common + ["--stop-at", "2"]) == 0
    assert not (out / "longctx_qa1.json").exists()  # a slice evaluates nothing
    assert (runs / "qa1" / "checkpoints" / "update_0000002").is_dir()

    with pytest.raises(SystemExit, match="--updates"):
        longctx.main([a for a in common if a not in ("--updates", "4")] + ["--resume"])

    assert longctx.main(common + ["--resume", "--select-lengths", "1k", "--select-questions", "2"]) == 0
    table = json.loads((out / "longctx_qa1.json").read_text())
    training = table["training"]
    assert training["updates"] == 4
    assert [(s["from"], s["to"]) for s in training["slices"]] == [(0, 2), (2, 4)]
    assert training["seconds"] == pytest.approx(sum(s["seconds"] for s in training["slices"]), abs=0.2)
    selection = training["selection"]
    names = [Path(c["checkpoint"]).name for c in selection["candidates"]]
    assert names == ["update_0000002", "best", "final"]
    for c in selection["candidates"]:
        assert [(r["length"], r["num_samples"]) for r in c["rows"]] == [(1024, 2)]
    best = max(c["val_fact_em"] for c in selection["candidates"])
    chosen = next(c for c in selection["candidates"] if c["checkpoint"] == training["checkpoint"])
    assert chosen["val_fact_em"] == best
    assert "val split at 1k" in training["selected_on"]
    # keep_best's choice is traceable: the val curve at the training length over both slices
    assert [e["update"] for e in training["val_by_update"]] == [2, 4]
    assert training["keep_best_update"] == max(training["val_by_update"], key=lambda e: e["fact_f1"])["update"]
    assert [r["model"] for r in table["rows"]] == ["Q-RAG"]
    assert table["rows"][0]["checkpoint"] == training["checkpoint"]
    # The log is also under --out as it goes (a call killed at its limit still tells how far it got).
    logged = (out / "longctx.log").read_text()
    assert "resumed from" in logged and "select: final" in logged


def test_the_seeds_script_trains_chooses_and_combines_each_seed(data, tiny_encoder, tmp_path):
    """bench/longctx_seeds.sh on CPU: a seed of qa1 for the preset and for one variant (an ablation
    row; one seed each keeps the test short, tests/test_seeds.py combines several), and the untrained
    encoder, each run's checkpoint chosen on val, then one table with the differences between models."""
    import os
    import shutil
    import subprocess
    import tarfile

    assets = tmp_path / "assets"
    assets.mkdir()
    shutil.copytree(tiny_encoder, assets / "encoder")
    shutil.copytree(data / "babi", assets / "babi")
    shutil.copytree(data / "bg", assets / "novels")
    out, work = tmp_path / "out", tmp_path / "work"
    env = {
        **os.environ,
        "PY": sys.executable,
        "CARRY": str(assets),
        "ASSETS": str(assets),
        "WORK": str(work),
        "OUT": str(out),
        "DEVICE": "cpu",
        "TASKS": "qa1",
        "SEEDS": "1",
        "VARIANTS": "Q-RAG: w/o_target:learner.use_target=false",
        "UPDATES": "4",
        "EVERY": "2",
        "LENGTHS": "1k",
        "SELECT": "1k",
        "SELECT_QUESTIONS": "2",
        "QUESTIONS": "2",
        "OMP_NUM_THREADS": "1",
        "EXTRA": "--val-questions 0 data.samples_per_task=8 data.dev_samples_per_task=2 data.val_fraction=0.5 "
        "data.chunk_tokens=32 learner.episodes_per_update=4 learner.micro_batch=4 learner.warmup_updates=1",
    }
    script = ["bash", str(ROOT / "bench" / "longctx_seeds.sh")]
    done = subprocess.run(script + ["train"], cwd=ROOT, env={**env, "STOP_AT": "2"}, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (work / "runs" / "qa1-seed1" / "checkpoints" / "update_0000002").is_dir()
    assert not (work / "runs" / "qa1-seed1" / "training.json").exists()  # a slice, not the run's end

    done = subprocess.run(script + ["run"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    headline = json.loads((out / "longctx_qa1_headline.json").read_text())
    trained = [r for r in headline["rows"] if r["model"] in ("Q-RAG", "w/o target")]
    assert len(trained) == 2 and all(r["num_seeds"] == 1 and len(r["fact_em_ci"]) == 2 for r in trained)
    assert {r["model"] for r in headline["rows"]} == {"Q-RAG", "w/o target", "untrained"}
    assert {(d["a"], d["b"]) for d in headline["differences"]} >= {("Q-RAG", "w/o target")}
    variant = json.loads((work / "o" / "qa1-w-o-target-s1" / "longctx_qa1_w-o-target_seed1.json").read_text())
    assert "learner.use_target=false" in variant["training"]["config"]["overrides"]
    assert [s["from"] for s in variant["training"]["slices"]] == [0, 2]
    seed1 = json.loads((work / "o" / "qa1-s1" / "longctx_qa1_seed1.json").read_text())
    assert [s["from"] for s in seed1["training"]["slices"]] == [0, 2]  # resumed the slice, not restarted
    assert "val" in seed1["training"]["selection"]["split"]
    with tarfile.open(out / "longctx_seeds_files.tgz") as tgz:
        names = tgz.getnames()
    assert {"o/qa1-s1/longctx_qa1_seed1.json", "o/qa1-u/longctx_qa1_untrained.json"} <= set(names)

    # A later call (the first ran out of time after some seeds finished) redoes none of them.
    finished = work / "o" / "qa1-s1" / "longctx_qa1_seed1.json"
    stamp = finished.stat().st_mtime_ns
    (out / "longctx_qa1_headline.json").unlink()
    done = subprocess.run(script + ["run"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert finished.stat().st_mtime_ns == stamp and (out / "longctx_qa1_headline.json").is_file()
