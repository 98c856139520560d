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
