"""`bench/serve_scale.py --plot` draws the shipped 1M/10M/100M results (the growth plot of issue 14)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_growth_plot_from_the_shipped_results(tmp_path):
    files = [str(ROOT / "bench" / "results" / f"serve_scale_{size}_h100.json") for size in ("100m", "1m", "10m")]
    out = tmp_path / "growth.png"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serve_scale.py"), "--plot", *files, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_the_serving_path_report_holds_graph_fallbacks_as_json():
    """A state-encoder shape that fell back to eager (MPNet on a GPU) is keyed (batch, length): the
    report names it "BxL", where the tuple key failed the whole run at its final json.dumps."""
    import json
    import types

    sys.path.insert(0, str(ROOT / "bench"))
    from serve_scale import serving_path_report

    graphs = types.SimpleNamespace(replays=3, fallbacks={(8, 128): "RuntimeError: capture"})
    row = {"latency_concurrency_1": {"mean_stage_ms": {"score": 1.5}}}
    report = json.loads(json.dumps(serving_path_report(graphs, {"optimized": row}, {"optimized": [[1, 2]]})))
    assert report["graph_fallbacks"] == {"8x128": "RuntimeError: capture"}
    assert report["graph_replays"] == 3 and report["score_ms_per_query"] == {"optimized": 1.5}
