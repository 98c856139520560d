"""bench/hotpot_seeds.sh on CPU with a tiny encoder: a call's time limit (SIGTERM) stops every run and
brings back what exists; the same command in a later call resumes each run from its newest checkpoint
and does not redo finished evaluations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from conftest import stop_like_timeout

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ["bash", str(ROOT / "bench" / "hotpot_seeds.sh"), "run"]


def logged_updates(log: str) -> list[list[int]]:
    """The updates each `qrag train` of a run's log reported, one list per call."""
    calls: list[list[int]] = []
    for line in log.splitlines():
        if line.startswith("train: "):
            calls.append([])
        elif line.startswith('{"update": ') and calls:
            calls[-1].append(int(line.split(",")[0].split(":")[1]))
    return calls


def test_a_stopped_call_packs_what_exists_and_the_next_resumes(shared_data, tiny_encoder, tmp_path):
    carry, work, out = tmp_path / "carry", tmp_path / "work", tmp_path / "out"
    carry.mkdir()
    (carry / "data").symlink_to(shared_data)
    env = {
        **os.environ,
        "PY": sys.executable,
        "DEVICE": "cpu",
        "CARRY": str(carry),
        "ENCODER": tiny_encoder,
        "WORK": str(work),
        "OUT": str(out),
        "SEEDS": "0",
        "VARIANTS": "Q-RAG:learner.objective=pqn SFT:",  # the preset trains SFT
        # Each checkpoint searched a second way: rows of their own, not trained again.
        "SEARCHES": "beam_2_logprob:search.beam_width=2,search.beam_score=logprob",
        "MUSIQUE_STOP": "budget",  # MuSiQue's stop chosen on its train subset, per run
        "EVERY": "2",
        "LIMIT": "8",
        "OMP_NUM_THREADS": "1",
        "EXTRA": "updates=8 eval_every=4 log_every=1 eval_limit=8 learner.episodes_per_update=8 learner.micro_batch=8 "
        "data.chunk_tokens=48",
    }
    runs = [work / "runs" / "seed0", work / "runs" / "sft-seed0"]
    script = subprocess.Popen(
        SCRIPT, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        while (
            not all((run / "checkpoints" / "update_0000002").is_dir() for run in runs)
            and script.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        assert script.poll() is None, script.communicate()[0]
    finally:
        stop_like_timeout(script, work)
    with tarfile.open(out / "hotpot_seeds_partial.tgz") as tgz:
        assert {"./seed0.log", "./sft-seed0.log", "./untrained.log"} <= set(tgz.getnames())
    assert not (runs[0] / "final").exists()  # stopped before the end of its schedule

    done = subprocess.run(SCRIPT, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    for run in runs:
        first, second = logged_updates((work / f"{run.name}.log").read_text())
        assert first and second and second[0] > 2 and second[-1] == 8, (first, second)  # went on, not from 0
    assert {"hotpot_headline.json", "musique_headline.json", "val_headline.json"} <= {p.name for p in out.iterdir()}
    val = json.loads((out / "val_headline.json").read_text())
    labels = {"Q-RAG", "SFT", "Q-RAG beam 2 logprob", "SFT beam 2 logprob"}
    assert {m["label"] for m in val["methods"]} == labels and val["differences"]
    searched = {m["label"]: m["search"] for m in val["methods"]}
    assert searched["SFT beam 2 logprob"]["beam_score"] == "logprob" and searched["SFT"]["beam_width"] == 1
    assert all(d["paired"] for d in val["differences"])  # one seed each, the same questions
    stopped = json.loads((out / "musique_stop_budget_headline.json").read_text())
    assert {m["label"] for m in stopped["methods"]} == {"Q-RAG", "SFT"}
    assert all("threshold_fact_f1_ci" in m and m["budget_by_seed"] for m in stopped["methods"])
    assert all("musique train" in m["selected_on"] for m in stopped["methods"])

    # A third call finds every evaluation done: nothing trained or evaluated again, the tables written again.
    finished = {p.name: p.stat().st_mtime_ns for p in (work / "done").iterdir()}
    assert set(finished) == {
        "s0",
        "sft-s0",
        "beam-2-logprob-s0",
        "sft-beam-2-logprob-s0",
        "stop-s0",
        "stop-sft-s0",
        "untrained",
    }
    (out / "hotpot_headline.json").unlink()
    done = subprocess.run(SCRIPT, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert {p.name: p.stat().st_mtime_ns for p in (work / "done").iterdir()} == finished
    assert (out / "hotpot_headline.json").is_file()


def test_stage_merges_a_carry_and_run_names_what_was_not_carried(shared_data, tmp_path):
    """A carry split over calls: `stage` merges this call's part into $WORK/assets; a later `run` that finds no
    encoder there (none carried, none staged, no ENCODER) stops with a line that names it."""
    carry, work = tmp_path / "carry", tmp_path / "work"
    carry.mkdir()
    (carry / "data").symlink_to(shared_data)
    (carry / "provenance.env").write_text("QRAG_COMMIT=0123abc\n")
    env = {k: v for k, v in os.environ.items() if k not in ("ENCODER", "QRAG_DATA_DIR")}
    env.update({"PY": sys.executable, "CARRY": str(carry), "WORK": str(work), "OUT": str(tmp_path / "out")})
    script = ["bash", str(ROOT / "bench" / "hotpot_seeds.sh")]
    staged = subprocess.run(script + ["stage"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert staged.returncode == 0 and "staged" in staged.stdout, staged.stdout + staged.stderr
    assert (work / "assets" / "data" / "hotpotqa").is_dir() and (work / "assets" / "provenance.env").is_file()
    later = {**env, "CARRY": str(tmp_path / "not-carried")}
    done = subprocess.run(script + ["run"], cwd=ROOT, env=later, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"no encoder under {work / 'assets'}" in done.stderr and "Traceback" not in done.stderr
