"""bench/two_gpu.py keeps Ray's own logs where a device call brings files back: flat, tails only."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ray_logs_are_copied_flat_and_cut_to_their_tails(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import two_gpu

    logs = tmp_path / "ray" / "session_2026" / "logs"
    logs.mkdir(parents=True)
    (tmp_path / "ray" / "session_latest").symlink_to(logs.parent)
    (logs / "raylet.out").write_text("old line\n" * 10 + "the raylet's last words\n")
    (logs / "gcs_server.err").write_text("gcs\n")
    (logs / "python-core-driver-01000000_77.log").write_text("driver\n")
    (logs / "worker-abc.err").write_text("not one of Ray's own logs\n")
    dest = tmp_path / "out" / "raylogs"
    copied = two_gpu.copy_ray_logs(tmp_path / "ray", dest, tail_bytes=30)
    assert sorted(copied) == ["gcs_server.err", "python-core-driver-01000000_77.log", "raylet.out"]
    assert sorted(p.name for p in dest.iterdir()) == sorted(copied)
    assert (dest / "raylet.out").read_text().endswith("the raylet's last words\n")
    assert len((dest / "raylet.out").read_bytes()) == 30
