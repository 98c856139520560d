"""bench/train_speed.py --profile: the profiled updates run the real learner, and the breakdown's
reductions are right (the GPU-busy union is tested on ranges, since CI has no GPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from step_profile import _union_us  # noqa: E402


@pytest.mark.parametrize(
    "ranges,expected",
    [
        ([], 0.0),
        ([(0, 10), (20, 25)], 15.0),
        ([(0, 10), (5, 15)], 15.0),  # overlapping streams count once
        ([(5, 15), (0, 10), (2, 3)], 15.0),  # unsorted, nested
    ],
)
def test_gpu_busy_is_the_union_of_kernel_ranges(ranges, expected):
    assert _union_us(ranges) == expected


def test_the_training_bench_profiles_real_updates(tiny_encoder, tmp_path):
    from conftest import make_hotpot_records

    hotpot_file = tmp_path / "hotpot.json"
    hotpot_file.write_text(json.dumps(make_hotpot_records(24, paragraphs=6)))
    out = tmp_path / "speed.json"
    argv = ["--config", "configs/hotpot.yaml", "--updates", "1", "--warmup", "0", "--timed", "0", "--profile", "2"]
    argv += ["--out", str(out), f"model.encoder={tiny_encoder}", f"data.path={hotpot_file}", "device=cpu"]
    argv += ["learner.episodes_per_update=8", "learner.micro_batch=8"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}
    done = subprocess.run(
        [sys.executable, "bench/train_speed.py", *argv], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    prof = json.loads(out.read_text())["profile"]
    assert prof["updates"] == 2 and prof["wall_s_per_update"] > 0
    assert prof["gpu_busy_share"] is None  # no GPU here: said, not made up
    ops = {row["op"] for row in prof["top_host_ops"]}
    assert any("addmm" in op or "linear" in op or "matmul" in op for op in ops), ops  # the encoders ran in it
    assert 0 < prof["host_self_s_per_update"] <= prof["wall_s_per_update"] * 1.05
