"""A real local Ray cluster for integration tests: `ray start --head` bound to 127.0.0.1 with its
own ports, temp dir and auth token, stopped through its process group (and only it)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import ROOT, free_ports

RAY = str(Path(sys.executable).parent / "ray")


def cluster_env(drop: tuple[str, ...] = ("RAY_ADDRESS",)) -> dict[str, str]:
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": str(ROOT / "platform"),
        # A job's `python` is the cluster's Python, as on a real cluster: here the test's own
        # interpreter, also when CI runs pytest without activating the virtualenv.
        "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
    }
    for var in drop:
        env.pop(var, None)
    return env


@contextmanager
def local_ray_cluster(
    tmp: Path,
    *,
    num_gpus: int = 0,
    resources: dict[str, float] | None = None,
    drop_env: tuple[str, ...] = ("RAY_ADDRESS",),
) -> Iterator[dict]:
    """Yields {"env", "gcs", "api"} once the job API answers. ``num_gpus`` are logical GPUs
    (placement only: nothing here runs CUDA)."""
    gcs, dashboard, client, agent, agent_grpc, metrics, env_agent = free_ports(7)
    env = cluster_env(drop_env)
    extra = [f"--resources={json.dumps(resources)}"] if resources else []
    log = open(tmp / "ray_start.log", "w")
    # Ray's socket paths must stay under the 107-byte limit of a Unix socket: pytest's tmp_path
    # under xdist (.../popen-gw0/...) is too deep, so the cluster's temp dir is a short one.
    ray_tmp = tempfile.mkdtemp(prefix="qrag-ray-", dir="/tmp")
    proc = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            f"--ray-client-server-port={client}",
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics}",
            f"--runtime-env-agent-port={env_agent}",
            "--num-cpus=3",
            f"--num-gpus={num_gpus}",
            *extra,
            f"--temp-dir={ray_tmp}",
            "--disable-usage-stats",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    api = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.time() + 120
        while subprocess.run([RAY, "job", "list", "--address", api], env=env, capture_output=True).returncode != 0:
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"ray start failed: {(tmp / 'ray_start.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield {"env": env, "gcs": f"127.0.0.1:{gcs}", "api": api}
    finally:
        stop_cluster(proc)
        log.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _process_group(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.getpgid(int(entry)) == pgid:
                pids.append(int(entry))
        except ProcessLookupError:
            pass
    return pids


def stop_cluster(proc: subprocess.Popen) -> None:
    """Every process of the test cluster is in the session its `ray start` opened, and only
    those: stop them with SIGTERM (the `ray start` parent itself would first wait out a 30 s
    drain, so it goes last, with SIGKILL, once nothing is left to drain)."""
    for pid in _process_group(proc.pid):
        if pid != proc.pid:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:  # gone since it was listed
                pass
    deadline = time.time() + 5
    while time.time() < deadline and set(_process_group(proc.pid)) - {proc.pid}:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
