"""bench/longctx.py end to end on CPU with a tiny encoder: a run cut into two slices (the second
resumes the first's checkpoint), the reported checkpoint chosen on the val split at a long
length among the periodic, keep_best and final ones (resumable: each score is kept), then dev
evaluated once; bench/longctx_seeds.sh's seeds, carries staged over calls, and a call stopped by
its time limit."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import processes_of, stop_like_timeout
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
    # The chosen checkpoint's val scores, per question, for paired val comparisons of variants; the
    # dev table's record of the candidates stays compact.
    val = json.loads((out / "val_longctx_qa1.json").read_text())
    assert val["split"] == "val" and "dev_draw" not in val and "never report them" in val["selected_on"]
    assert [(r["model"], r["checkpoint"], r["length"]) for r in val["rows"]] == [
        ("Q-RAG", training["checkpoint"], 1024)
    ]
    assert val["rows"][0]["fact_em"] == chosen["rows"][0]["fact_em"]
    assert len(val["rows"][0]["per_question"]["id"]) == 2 and val["data"]["seed"] == table["data"]["seed"]
    assert not any("per_question" in r for c in selection["candidates"] for r in c["rows"])
    # The log is also under --out as it goes (a call killed at its limit still tells how far it got).
    logged = (out / "longctx.log").read_text()
    assert "resumed from" in logged and "select: final" in logged


def test_selection_keeps_each_candidates_score_and_resumes(longctx, tmp_path, monkeypatch):
    """A call cut short while choosing leaves each scored candidate under <run>/selection/; the
    next call scores only the rest. A re-trained checkpoint, or other selection settings, are
    scored again."""
    import argparse

    from qrag.config import TrainConfig
    from qrag.evaluation import lengths

    run = tmp_path / "run"
    names = ["checkpoints/update_0000002", "best", "final"]
    for name in names:
        (run / name).mkdir(parents=True)
        (run / name / "qrag.json").write_text("{}")
        (run / name / "weights.safetensors").write_bytes(b"0123")
    (run / "checkpoints" / "update_0000004.partial").mkdir()  # a save cut short by a kill: no candidate
    (run / "checkpoints" / "update_0000004.partial" / "qrag.json").write_text("{}")
    scores = {"update_0000002": 0.5, "best": 1.0, "final": 0.75}
    swept: list[str] = []

    def sweep(label, checkpoint, cfg, tasks, lens, samples, **kw):
        swept.append(label)
        row = {k: 0 for k in longctx.ROW_KEYS}
        asked = {"id": ["q0", "q1"], "fact_em": [scores[label]] * 2}
        return [
            {**row, "length": n, "fact_em": scores[label], "fact_f1": scores[label], "per_question": asked}
            for n in lens
        ]

    monkeypatch.setattr(lengths, "sweep_model", sweep)
    logged: list[str] = []
    cfg = TrainConfig()

    def select(questions: int = 2) -> dict:
        swept.clear()
        args = argparse.Namespace(select_lengths="1k", select_questions=questions)
        return longctx.select_checkpoint("qa1", run, cfg, args, None, logged.append)

    first = select()
    assert swept == ["update_0000002", "best", "final"] and first["reused"] == []
    assert first["checkpoint"] == str(run / "best")
    assert sorted(p.name for p in (run / "selection").iterdir()) == ["best.json", "final.json", "update_0000002.json"]

    again = select()
    assert swept == [] and again["reused"] == ["update_0000002", "best", "final"]
    assert again["candidates"] == first["candidates"] and again["checkpoint"] == first["checkpoint"]
    assert sum("reused" in line for line in logged) == 3

    # final written again (same size, later): only it is scored again, and its new score counts.
    stamp = (run / "final" / "weights.safetensors").stat().st_mtime_ns
    os.utime(run / "final" / "weights.safetensors", ns=(stamp + 10**9, stamp + 10**9))
    scores["final"] = 2.0
    assert select()["checkpoint"] == str(run / "final") and swept == ["final"]

    assert select(questions=3)["reused"] == [] and swept == ["update_0000002", "best", "final"]
    (run / "selection" / "best.json").write_text('{"key": ')  # cut short by a kill while written
    assert select(questions=3)["reused"] == ["update_0000002", "final"] and swept == ["best"]
    # kept by an older version, without per-question scores: scored again (the val table needs them)
    kept = json.loads((run / "selection" / "final.json").read_text())
    for r in kept["entry"]["rows"]:
        del r["per_question"]
    (run / "selection" / "final.json").write_text(json.dumps(kept))
    chosen = select(questions=3)
    assert swept == ["final"] and chosen["val_rows"][0]["per_question"]["id"] == ["q0", "q1"]


SEEDS_SCRIPT = ["bash", str(ROOT / "bench" / "longctx_seeds.sh")]


def tiny_assets(folder: Path, tiny_encoder: str, data: Path, parts: tuple[str, ...] = ("encoder", "babi", "novels")):
    """A --pack-assets folder (the parts named) from the tiny encoder and write_qa1_data's files."""
    import shutil

    sources = {"encoder": Path(tiny_encoder), "babi": data / "babi", "novels": data / "bg"}
    folder.mkdir(parents=True)
    for part in parts:
        shutil.copytree(sources[part], folder / part)
    return folder


def reader_parts(folder: Path) -> None:
    """SmolLM2's GGUF in parts under folder/reader, as `READER=local ... pack` writes them (here in
    three, and without wheels: gguf and accelerate are installed)."""
    import subprocess

    split = [sys.executable, str(ROOT / "bench" / "carry_parts.py"), "split", "--out", str(folder / "reader")]
    subprocess.run([*split, "--part-mib", "40"], check=True, capture_output=True)


def seeds_env(work: Path, out: Path) -> dict[str, str]:
    """bench/longctx_seeds.sh's settings for a tiny qa1 run on CPU: one seed of the preset and of a variant."""
    return {
        **os.environ,
        "PY": sys.executable,
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


def test_the_seeds_script_trains_chooses_and_combines_each_seed(data, tiny_encoder, tmp_path):
    """bench/longctx_seeds.sh on CPU: a seed of qa1 for the preset and for one variant (an ablation
    row; one seed each keeps the test short, tests/test_seeds.py combines several), and the untrained
    encoder, each run's checkpoint chosen on val, then one table with the differences between models."""
    import subprocess
    import tarfile

    assets = tiny_assets(tmp_path / "assets", tiny_encoder, data)
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**seeds_env(work, out), "CARRY": str(assets), "ASSETS": str(assets)}
    script = SEEDS_SCRIPT
    # PER_GPU=1: the two runs one after the other (a Python that notes when each run starts and ends).
    spans = tmp_path / "spans"
    timed_python = tmp_path / "timed_python"
    timed_python.write_text(
        f'#!/bin/bash\necho "start $$ $(date +%s%N)" >> {spans}\n{sys.executable} "$@"; rc=$?\n'
        f'echo "end $$ $(date +%s%N)" >> {spans}\nexit $rc\n'
    )
    timed_python.chmod(0o755)
    sliced = {**env, "STOP_AT": "2", "PER_GPU": "1", "PY": str(timed_python)}
    done = subprocess.run(script + ["train"], cwd=ROOT, env=sliced, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert most_at_once(spans.read_text()) == 1
    assert (work / "runs" / "qa1-seed1" / "checkpoints" / "update_0000002").is_dir()
    assert not (work / "runs" / "qa1-seed1" / "training.json").exists()  # a slice, not the run's end

    # With a reader: SmolLM2's GGUF joined from the two carried parts answers every dev question.
    done = subprocess.run(script + ["run"], cwd=ROOT, env={**env, "READER": "local"}, capture_output=True, text=True)
    assert done.returncode == 2 and "no reader under" in done.stderr
    reader_parts(assets)
    done = subprocess.run(script + ["run"], cwd=ROOT, env={**env, "READER": "local"}, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    headline = json.loads((out / "longctx_qa1_headline.json").read_text())
    trained = [r for r in headline["rows"] if r["model"] in ("Q-RAG", "w/o target")]
    assert len(trained) == 2 and all(r["num_seeds"] == 1 and len(r["fact_em_ci"]) == 2 for r in trained)
    assert all(r["ans_em"] is not None and len(r["ans_em_ci"]) == 2 for r in headline["rows"])
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
    # Each seed's val table, and the variants compared on val (the two runs share data.seed: paired).
    assert {"o/qa1-s1/val_longctx_qa1_seed1.json", "o/val/longctx_qa1_val_headline.json"} <= set(names)
    on_val = json.loads((work / "o" / "val" / "longctx_qa1_val_headline.json").read_text())
    assert on_val["split"] == "val" and {r["model"] for r in on_val["rows"]} == {"Q-RAG", "w/o target"}
    assert [(d["a"], d["b"], d["paired"]) for d in on_val["differences"]] == [("Q-RAG", "w/o target", True)]

    # A later call (the first ran out of time after some seeds finished) redoes none of them.
    finished = work / "o" / "qa1-s1" / "longctx_qa1_seed1.json"
    stamp = finished.stat().st_mtime_ns
    (out / "longctx_qa1_headline.json").unlink()
    done = subprocess.run(script + ["run"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert finished.stat().st_mtime_ns == stamp and (out / "longctx_qa1_headline.json").is_file()


def most_at_once(spans: str) -> int:
    """The most processes live at one time, from 'start PID NS' / 'end PID NS' lines."""
    lines = (line.split() for line in spans.splitlines())
    events = sorted((int(ns), 1 if kind == "start" else -1) for kind, _, ns in lines)
    live = most = 0
    for _, change in events:
        live += change
        most = max(most, live)
    return most


def test_the_seeds_script_stages_carries_and_packs_what_exists_when_stopped(data, tiny_encoder, tmp_path):
    """A carry split over calls: `stage` merges one part into $WORK/assets, `run` merges the rest
    (and refuses to start while a part is missing). SIGTERM (what `timeout` sends at a call's
    limit) stops the runs and brings back what exists as $OUT/longctx_seeds_partial.tgz, exit 124."""
    import subprocess
    import tarfile
    import time

    out, work = tmp_path / "out", tmp_path / "work"
    env = {**seeds_env(work, out), "UPDATES": "100000"}  # runs that cannot end before they are stopped
    first = tiny_assets(tmp_path / "carry1", tiny_encoder, data, ("babi", "novels"))
    (first / "provenance.env").write_text("QRAG_COMMIT=0123456789abcdef0123456789abcdef01234567\nQRAG_DIRTY=0\n")
    done = subprocess.run(SEEDS_SCRIPT + ["stage"], cwd=ROOT, env={**env, "CARRY": str(first)}, capture_output=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in (work / "assets").iterdir()) == ["babi", "novels", "provenance.env"]
    done = subprocess.run(
        SEEDS_SCRIPT + ["run"], cwd=ROOT, env={**env, "CARRY": str(tmp_path / "none")}, capture_output=True, text=True
    )
    assert done.returncode == 2 and "no encoder under" in done.stderr

    # What an earlier call left, which the bundle brings back beside this call's logs.
    earlier = ["o/qa1-s7/longctx_qa1_seed7.json", "runs/qa1-seed7/training.json", "runs/qa1-seed7/selection/final.json"]
    for name in earlier:
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text("{}")
    second = tiny_assets(tmp_path / "carry2", tiny_encoder, data, ("encoder",))
    script = subprocess.Popen(
        SEEDS_SCRIPT + ["run"],
        cwd=ROOT,
        env={**env, "CARRY": str(second)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(processes_of(work)) < 3 and script.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(processes_of(work)) == 3, "the two seeds' runs and the untrained one did not start"
    finally:
        printed = stop_like_timeout(script, work)
    assert "longctx_seeds_partial.tgz" in printed
    assert (work / "assets" / "encoder").is_dir()  # the second part, merged by run
    with tarfile.open(out / "longctx_seeds_partial.tgz") as tgz:
        names = set(tgz.getnames())
    assert {"./qa1-s1.log", "./qa1-w-o-target-s1.log", "./qa1-u.log", *earlier} <= names


def test_an_encoder_in_parts_is_joined_before_the_runs(tiny_encoder, tmp_path):
    """PACK_ENCODER=mpnet packs an encoder too large for one call as encoder_parts/a, b, ... (bench/carry_parts.py:
    a folder travels as one tar); `run` joins them into assets/encoder, hash-checked, before anything else."""
    import filecmp
    import shutil
    import subprocess

    assets, packed = tmp_path / "assets", tmp_path / "packed" / "encoder"
    assets.mkdir()
    shutil.copytree(tiny_encoder, packed)
    split = [sys.executable, str(ROOT / "bench" / "carry_parts.py"), "split", "--source", str(packed)]
    done = subprocess.run([*split, "--out", str(assets / "encoder_parts"), "--part-mib", "0.1"], capture_output=True)
    assert done.returncode == 0, done.stderr
    parts = sorted(p.name for p in (assets / "encoder_parts").iterdir())
    assert len(parts) >= 3 and all((assets / "encoder_parts" / p / "manifest.json").is_file() for p in parts)

    # One part damaged: the join refuses, and nothing that looks like an encoder is left.
    tampered = tmp_path / "tampered"
    shutil.copytree(assets / "encoder_parts", tampered / "encoder_parts")
    piece = next((tampered / "encoder_parts" / "b").glob("*.part1"))
    piece.write_bytes(piece.read_bytes()[:-1] + b"!")
    join = [sys.executable, str(ROOT / "bench" / "carry_parts.py"), "join"]
    done = subprocess.run([*join, str(tampered / "encoder_parts"), str(tampered)], capture_output=True, text=True)
    assert done.returncode != 0 and "SHA-256" in done.stderr
    assert not any(p.is_dir() and p.name != "encoder_parts" for p in tampered.iterdir())

    env = {**seeds_env(tmp_path / "work", tmp_path / "out"), "CARRY": str(assets), "ASSETS": str(assets)}
    done = subprocess.run(SEEDS_SCRIPT + ["run"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "no babi under" in done.stderr, done.stdout + done.stderr  # data not staged yet
    joined = assets / "encoder"
    assert joined.is_dir() and not filecmp.dircmp(packed, joined).diff_files
    assert sorted(p.name for p in joined.iterdir()) == sorted(p.name for p in packed.iterdir())
