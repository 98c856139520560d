"""bench/speed_medians.py groups a folder's train_speed results by row and takes each row's median
over its repeats; bench/learner_switches.sh REPEATS=N runs rows interleaved and writes that summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from speed_medians import row_label, summarise  # noqa: E402


def _result(path: Path, episodes_per_s: float, gpu: float | None = 0.13, commit: str = "abc") -> Path:
    profile = {"gpu_busy_s_per_update": gpu, "host_self_s_per_update": 0.2} if gpu else None
    body = {"benchmark": "train_speed", "config": "c.yaml", "overrides": ["x=1"], "episodes_per_s": episodes_per_s}
    path.write_text(json.dumps({**body, "profile": profile, "commit": commit}))
    return path


def test_rows_are_their_files_less_the_repeat_suffix():
    assert row_label(Path("pqn_eager_r3.json")) == "pqn_eager"
    assert row_label(Path("pqn_r1_eager.json")) == "pqn_r1_eager"  # only a trailing suffix is a repeat
    assert row_label(Path("qa3.json")) == "qa3"


def test_each_row_gets_the_median_of_its_repeats(tmp_path):
    paths = [
        _result(tmp_path / "a_r1.json", 1000),
        _result(tmp_path / "a_r2.json", 1400, commit="def"),
        _result(tmp_path / "a_r3.json", 1300),
        _result(tmp_path / "b.json", 900, gpu=None),
    ]
    (tmp_path / "idle.json").write_text(json.dumps({"benchmark": "gpu_idle_phases"}))
    rows = summarise([*paths, tmp_path / "idle.json"])
    assert list(rows) == ["a", "b"]  # the other benchmark's file is left out
    a = rows["a"]
    assert a["episodes_per_s"] == {"runs": [1000, 1400, 1300], "median": 1300, "min": 1000, "max": 1400}
    assert a["commits"] == ["abc", "def"] and a["gpu_s_per_update_profiled"]["median"] == 0.13
    assert rows["b"]["episodes_per_s"]["median"] == 900 and rows["b"]["gpu_s_per_update_profiled"]["runs"] == []


def test_a_broken_result_is_named(tmp_path):
    bad = tmp_path / "torn_r1.json"
    bad.write_text('{"benchmark": "train_')
    with pytest.raises(SystemExit, match="torn_r1.json"):
        summarise([bad])


def test_learner_switches_repeats_rows_interleaved_and_summarises(tiny_encoder, hotpot_file, tmp_path):
    out = tmp_path / "switches"
    overrides = f"device=cpu,model.encoder={tiny_encoder},data.path={hotpot_file}"
    overrides += ",learner.episodes_per_update=4,learner.micro_batch=4"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "platform"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "OUT": str(out),
        "UPDATES": "1",
        "WARMUP": "0",
        "PROFILE": "0",
        "REPEATS": "2",
        "BYTECODE": "image",
        "ROWS": f"cpu|configs/hotpot.yaml|{overrides}",
    }
    done = subprocess.run(["bash", "bench/learner_switches.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.index("== cpu_r1") < done.stdout.index("== cpu_r2")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"]["cpu"]["files"] == ["cpu_r1.json", "cpu_r2.json"]
    assert len(summary["rows"]["cpu"]["episodes_per_s"]["runs"]) == 2
