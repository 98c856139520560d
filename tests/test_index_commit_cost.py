"""bench/index_commit_cost.py, the documented measure of a long load's commits, runs the real lanes
commit path and counts what it writes."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_commit_cost_bench_counts_fewer_manifest_writes_than_groups(tmp_path):
    out = tmp_path / "cost.json"
    argv = [
        "bench/index_commit_cost.py",
        "--batches",
        "60",
        "--shards",
        "2",
        "--checkpoints",
        "30,60",
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [r["groups"] for r in result["rows"]] == [30, 60]
    summary = result["summary"]
    assert summary["groups"] == 60 and summary["shards"] == 2
    assert summary["manifest_writes"] == len(result["writes"]) < 60  # later commits hold several groups
    assert result["writes"][-1][0] == 60  # the last write lists every group
