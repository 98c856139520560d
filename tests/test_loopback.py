"""A Ray that qrag starts for itself binds 127.0.0.1 only (qrag.distributed.loopback)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Started in a fresh interpreter without the variable (conftest may set it for the other tests):
# the node's address and every listening socket of the Ray processes.
PROBE = r"""
import json, subprocess
import ray
from qrag.distributed.bulk_index import ensure_ray

ensure_ray()
try:
    nodes = [n["NodeManagerAddress"] for n in ray.nodes()]
    node = ray._private.worker._global_node  # this Ray's own servers, not another test's
    pids = {f"pid={info.process.pid}," for infos in node.all_processes.values() for info in infos}
    listening = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout.splitlines()
    ray_sockets = [line.split()[3] for line in listening if any(pid in line for pid in pids)]
    print(json.dumps({"nodes": nodes, "sockets": ray_sockets}))
finally:
    ray.shutdown()
"""


def test_keep_ray_on_loopback_sets_single_machine_mode(monkeypatch):
    ray_constants = pytest.importorskip("ray._private.ray_constants")
    from ray._private import services

    from qrag.distributed.loopback import SINGLE_MACHINE_ENV, keep_ray_on_loopback

    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    monkeypatch.delenv(SINGLE_MACHINE_ENV, raising=False)
    keep_ray_on_loopback()
    assert os.environ[SINGLE_MACHINE_ENV] == "0"
    assert ray_constants.ENABLE_RAY_CLUSTER is False  # Ray, imported before, is told as well
    assert services.get_node_ip_address() == "127.0.0.1"


@pytest.mark.ray
def test_a_local_ray_started_by_qrag_listens_on_loopback_only(tmp_path):
    pytest.importorskip("ray")
    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2) to list listening sockets")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    env["PYTHONPATH"] = str(ROOT / "platform")
    env["RAY_TMPDIR"] = "/tmp"
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["nodes"] == ["127.0.0.1"]
    assert seen["sockets"], "no Ray socket found"
    assert all(s.rsplit(":", 1)[0] in ("127.0.0.1", "[::ffff:127.0.0.1]") for s in seen["sockets"]), seen
