"""bench/longctx.py's training time over slices when a call is killed at its time limit: the
slice is recorded at each periodic checkpoint, so a resumed run keeps the killed slice, and its
speed comes from the slices that trained updates, never from a resumed slice with nothing left
to train (whose time is only data loading)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_longctx_data import write_qa1_data

ROOT = Path(__file__).resolve().parents[1]

# The first call, killed while it trains the update after its first periodic checkpoint (update 2):
# the learner stops there and says so, so the kill always lands at the same point.
HANG_AFTER_CHECKPOINT = f"""
import sys, time
from pathlib import Path
sys.path.insert(0, {str(ROOT / "bench")!r})
import longctx
from qrag.rl.learner import SoftPQNLearner

flag = Path(sys.argv[1])
train_update = SoftPQNLearner.train_update

def hang_after_checkpoint(self, episodes):
    if self.update == 2:
        flag.touch()
        time.sleep(600)
    return train_update(self, episodes)

SoftPQNLearner.train_update = hang_after_checkpoint
sys.exit(longctx.main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def longctx():
    sys.path.insert(0, str(ROOT / "bench"))
    import longctx

    return longctx


def tiny_run(tiny_encoder: str, data: Path, runs: Path, out: Path, updates: int) -> list[str]:
    """bench/longctx.py's options for a tiny qa1 run on CPU, periodic checkpoints every 2 updates."""
    return [
        "--task",
        "qa1",
        "--encoder",
        tiny_encoder,
        "--babi",
        str(data / "babi"),
        "--novels",
        str(data / "bg"),
        "--updates",
        str(updates),
        "--train-tokens",
        "512",
        "--runs",
        str(runs),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--no-eval",
        "data.samples_per_task=8",
        "data.dev_samples_per_task=2",
        "data.val_fraction=0.5",
        "data.chunk_tokens=32",
        "learner.episodes_per_update=4",
        "learner.micro_batch=4",
        "learner.warmup_updates=1",
        "checkpoint_every=2",
    ]


def test_a_killed_slice_is_kept_and_the_speed_counts_only_trained_updates(longctx, tiny_encoder, tmp_path):
    data, runs, out = write_qa1_data(tmp_path), tmp_path / "runs", tmp_path / "out"
    run_dir = runs / "qa1"
    flag = tmp_path / "hanging"
    first = subprocess.Popen(
        [sys.executable, "-c", HANG_AFTER_CHECKPOINT, str(flag), *tiny_run(tiny_encoder, data, runs, out, 4)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not flag.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert flag.exists(), first.stderr.read() if first.poll() is not None else "no periodic checkpoint in time"
        first.send_signal(signal.SIGTERM)  # what `timeout` sends at a call's limit
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == -signal.SIGTERM
    assert (run_dir / "checkpoints" / "update_0000002").is_dir()
    assert not (run_dir / "training.json").exists()
    killed = json.loads((run_dir / "slices.json").read_text())
    assert [(s["from"], s["to"]) for s in killed] == [(0, 2)]

    # The next call resumes with the schedule already complete (as when it was lowered between
    # calls): it trains nothing, only loads its data.
    assert longctx.main(tiny_run(tiny_encoder, data, runs, out, 2) + ["--resume"]) == 0
    training = json.loads((run_dir / "training.json").read_text())
    assert training["updates"] == 2
    slices = training["slices"]
    assert [(s["from"], s["to"]) for s in slices] == [(0, 2), (2, 2)]
    assert slices[0] == killed[0]
    assert training["seconds"] == pytest.approx(sum(s["seconds"] for s in slices), abs=0.2)
    assert training["data_seconds"] == pytest.approx(sum(s["data_seconds"] for s in slices), abs=0.2)
    # The speed is the killed slice's own: its 2 updates over its training seconds.
    loop_s = slices[0]["seconds"] - slices[0]["data_seconds"]
    assert loop_s > 0
    assert training["episodes_per_s"] == pytest.approx(4 * 2 / loop_s, abs=0.051)
    assert training["seconds_per_update"] == pytest.approx(loop_s / 2, abs=0.0006)


def test_slice_speed_counts_only_slices_that_trained(longctx):
    def sl(first: int, last: int, seconds: float | None, data: float | None) -> dict:
        return {"from": first, "to": last, "seconds": seconds, "data_seconds": data}

    assert longctx.slice_speed([sl(0, 100, 60.0, 20.0), sl(100, 100, 30.0, 29.0)]) == (100, 40.0)
    assert longctx.slice_speed([sl(0, 50, 30.0, 10.0), sl(50, 100, 45.0, 15.0)]) == (100, 50.0)
    # Nothing trained with a known time (the slice that trained was never recorded): no figure.
    assert longctx.slice_speed([sl(100, 100, 90.0, 85.0)]) == (0, 0.0)
    assert longctx.slice_speed([sl(0, 100, None, None)]) == (0, 0.0)
    assert longctx.slice_speed([]) == (0, 0.0)
