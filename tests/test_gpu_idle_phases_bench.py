"""bench/gpu_idle_phases.py: the GPU's idle time split by the host phase open meanwhile, tested on
made-up spans (CI has no GPU), and the script itself run on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gpu_idle_phases import busy_intervals, idle_by_phase, idle_gaps  # noqa: E402


def test_busy_spans_merge_and_leave_the_gaps_between_them():
    busy = busy_intervals([(50, 60), (0, 10), (5, 20), (200, 300)], start=0, end=100)
    assert busy == [(0, 20), (50, 60)]  # overlapping spans merged, the one past the end left out
    assert idle_gaps(busy, 0, 100) == [(20, 50), (60, 100)]
    assert idle_gaps([], 0, 10) == [(0, 10)]


def test_idle_time_goes_to_the_innermost_open_phase():
    phases = [("update_part", 0, 100), ("encode:chunks", 20, 40)]
    credit = idle_by_phase([(10, 50), (120, 130)], phases, resolution=1.0)
    assert credit == pytest.approx({"update_part": 20.0, "encode:chunks": 20.0, "(outside phases)": 10.0})


def test_the_script_runs_on_the_cpu(tiny_encoder, hotpot_file, tmp_path):
    out = tmp_path / "idle.json"
    argv = ["--config", "configs/hotpot.yaml", "--warmup", "1", "--updates", "1", "--out", str(out)]
    argv += [f"model.encoder={tiny_encoder}", f"data.path={hotpot_file}", "device=cpu"]
    argv += ["learner.episodes_per_update=4", "learner.micro_batch=4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}
    done = subprocess.run(
        [sys.executable, "bench/gpu_idle_phases.py", *argv], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["gpu_busy_ms_per_update"] == 0  # no GPU: every moment of the update is idle
    assert result["gpu_idle_ms_per_update"] == pytest.approx(result["wall_s_per_update_profiled"] * 1000, rel=0.2)
    phases = result["host_ms_and_calls_per_update"]
    assert {"encode:chunks", "encode:states", "_backward", "optimizer.step", "env.step"} <= phases.keys()
    assert phases["_backward"][1] == 1 and "machine" in result
