"""bench/carry_assets.sh's split_large_encoder: an encoder folder that would not fit in one device call beside
the source tree (64 MiB together) is cut into parts that do; one that fits travels whole."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT


def split(carry, tree_mib: int) -> subprocess.CompletedProcess:
    script = f'. bench/carry_assets.sh; CARRY="{carry}"; PY="{sys.executable}"; split_large_encoder'
    return subprocess.run(
        ["bash", "-c", script],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "CARRY_TREE_MIB": str(tree_mib)},
        capture_output=True,
        text=True,
    )


@pytest.fixture
def carry(tmp_path):
    encoder = tmp_path / "carry" / "encoder"
    encoder.mkdir(parents=True)
    (encoder / "model.safetensors").write_bytes(b"\1" * (6 << 20))  # 6 MiB
    (encoder / "config.json").write_text("{}")
    return tmp_path / "carry"


def test_an_encoder_that_fits_beside_the_tree_travels_whole(carry):
    assert split(carry, tree_mib=50).returncode == 0  # 12 MiB of room
    assert (carry / "encoder" / "model.safetensors").exists() and not (carry / "encoder_parts").exists()


def test_an_encoder_too_large_beside_the_tree_is_cut_into_parts_that_fit(carry):
    done = split(carry, tree_mib=58)  # 4 MiB of room: two parts
    assert done.returncode == 0, done.stderr
    assert not (carry / "encoder").exists()
    parts = sorted(p for p in (carry / "encoder_parts").iterdir() if p.is_dir())
    assert [p.name for p in parts] == ["a", "b"]
    for part in parts:
        assert sum(f.stat().st_size for f in part.glob("encoder.tar.part*")) <= 4 << 20
    joined = subprocess.run(
        [sys.executable, "bench/carry_parts.py", "join", str(carry / "encoder_parts"), str(carry / "back")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert joined.returncode == 0, joined.stderr
    assert (carry / "back" / "encoder" / "model.safetensors").read_bytes() == b"\1" * (6 << 20)


def test_a_tree_that_fills_the_call_is_refused_by_name(carry):
    done = split(carry, tree_mib=62)
    assert done.returncode == 2 and "leaves no room" in done.stderr
