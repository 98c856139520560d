"""What a pip user runs: the installed ``qrag`` command (``qrag train --ray``, ``qrag sweep``) and
the Serve app's import path inside the package, with no checkout on ``sys.path``."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

QRAG = Path(sys.executable).parent / "qrag"  # the console script pip installs beside the interpreter


def installed(args: list[str], cwd: Path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """The installed command, run outside the checkout with no PYTHONPATH into it."""
    if not QRAG.exists():
        pytest.skip("qrag is not installed into this interpreter's environment")
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [str(QRAG), *args], cwd=cwd, env={**clean, **env}, capture_output=True, text=True, timeout=timeout
    )


def test_train_ray_and_sweep_are_installed_commands(tmp_path):
    train = installed(["train", "--ray", "--help"], tmp_path)
    assert train.returncode == 0, train.stderr
    for option in ("--ray", "--address", "--base-dir", "learner.alpha"):
        assert option in train.stdout
    sweep = installed(["sweep", "--help"], tmp_path)
    assert sweep.returncode == 0, sweep.stderr
    assert "usage: qrag sweep" in sweep.stdout and "--local" in sweep.stdout and "--max-concurrent" in sweep.stdout


def test_train_ray_checks_its_config_before_ray_starts(tmp_path):
    out = installed(["train", "--ray", "model.positions=relativ"], tmp_path)
    assert out.returncode == 2
    assert "qrag train: error: model.positions: unknown value 'relativ'" in out.stderr
    assert "Ray" not in out.stdout  # nothing connected
    both = installed(["train", "--ray", "--resume", "somewhere"], tmp_path)
    assert both.returncode == 2 and "--resume and --stop-at are for training without Ray" in both.stderr


def test_sweep_checks_its_file_before_ray_starts(tmp_path):
    bad = tmp_path / "sweep.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "name": "s",
                "base": str(ROOT / "configs" / "smoke.yaml"),
                "space": {"model.positions": {"choice": ["none", "relativ"]}},
            }
        )
    )
    out = installed(["sweep", "--config", str(bad)], tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("qrag sweep: error:") and "relativ" in out.stderr


def test_the_serve_app_builder_is_in_the_package():
    """serve/config.yaml names a builder a pip install has (and serve/app.py stays a wrapper of it)."""
    from qrag.distributed import serve_app

    import_path = yaml.safe_load((ROOT / "serve" / "config.yaml").read_text())["applications"][0]["import_path"]
    module, _, attr = import_path.partition(":")
    assert module == "qrag.distributed.serve_app"
    build = getattr(importlib.import_module(module), attr)
    assert (serve_app.STATIC_DIR / "index.html").is_file()
    assert serve_app.STATIC_DIR.resolve().is_relative_to(Path(importlib.import_module("qrag").__file__).parent)
    from ray.serve.deployment import Application

    assert isinstance(build({"shards": 2}), Application)
    sys.path.insert(0, str(ROOT))
    try:
        assert importlib.import_module("serve.app").build is build
    finally:
        sys.path.remove(str(ROOT))


def test_serve_run_key_values_are_typed():
    """``serve run qrag.distributed.serve_app:build shards=4`` passes "4": read as the field's type."""
    from qrag.config import from_dict
    from qrag.distributed.serve_app import typed_args
    from qrag.serving.service_config import ServeConfig

    args = typed_args(
        {
            "shards": "4",
            "warm_up": "false",
            "checkpoint": "runs/x/final",
            "api_keys": "k:write",
            "allowed_hosts": "[a, b]",
            "shard_memory_bytes": "null",
            "dtype": "float16",
            "encoder_device": "cuda:0",
        }
    )
    cfg = from_dict(ServeConfig, args)
    assert (cfg.shards, cfg.warm_up, cfg.checkpoint, cfg.api_keys) == (4, False, "runs/x/final", "k:write")
    assert (cfg.allowed_hosts, cfg.shard_memory_bytes, cfg.dtype, cfg.encoder_device) == (
        ["a", "b"],
        None,
        "float16",
        "cuda:0",
    )


@pytest.mark.ray
def test_qrag_train_ray_trains_on_a_local_ray(tiny_encoder, hotpot_file, tmp_path):
    out = installed(
        [
            "train",
            "--ray",
            "--config",
            str(ROOT / "configs" / "smoke.yaml"),
            f"model.encoder={tiny_encoder}",
            f"data.path={hotpot_file}",
            f"out_dir={tmp_path / 'runs'}",
            "name=pip",
            "updates=2",
            "eval_limit=4",
            "learner.episodes_per_update=4",
            "learner.micro_batch=4",
            "data.chunk_tokens=48",
            "distributed.runners=1",
            "distributed.runner_cpus=0.5",
            "distributed.mlflow_uri=none",
        ],
        tmp_path,
        timeout=600,
        RAY_USAGE_STATS_ENABLED="0",
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    summary = json.loads([line for line in out.stdout.splitlines() if line.startswith('{"run_dir"')][-1])
    assert summary["updates"] == 2 and Path(summary["checkpoint"]).is_dir()
    assert "qrag train: Ray started locally on 127.0.0.1" in out.stdout


JSON_LOG_APP = r"""
import json, os, sys, time, urllib.request
import ray
from ray import serve
from qrag.distributed.serve_app import build

tmp, port, encoder = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=2, _temp_dir=tmp,
         logging_level="WARNING")
serve.start(http_options={"host": "127.0.0.1", "port": port})
serve.run(build({"encoder": encoder, "storage": os.path.join(tmp, "indexes"), "warm_up": "false", "preload": "false"}),
          name="qrag", route_prefix="/")
with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=60) as r:
    assert r.status == 200
time.sleep(2)  # the replica's access log line is flushed
serve.shutdown()
ray.shutdown()
"""


@pytest.mark.ray
def test_json_logs_on_request(tiny_encoder, tmp_path):
    """QRAG_SERVE_JSON_LOGS=1 (qrag serve --log-json): the replicas' Serve logs are JSON lines."""
    from conftest import free_ports

    import tempfile

    (port,) = free_ports(1)
    ray_dir = Path(tempfile.mkdtemp(prefix="qj", dir="/tmp"))  # Ray's socket paths must stay under 107 bytes
    script = tmp_path / "app.py"
    script.write_text(JSON_LOG_APP)
    env = {
        **os.environ,
        "QRAG_SERVE_JSON_LOGS": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": str(ROOT / "platform"),
    }
    env.pop("RAY_ADDRESS", None)
    try:
        out = subprocess.run(
            [sys.executable, str(script), str(ray_dir), str(port), tiny_encoder],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        logs = sorted(ray_dir.glob("session_*/logs/serve/replica_qrag_Ingress_*.log"))
        assert logs, sorted(p.name for p in ray_dir.glob("session_*/logs/serve/*"))
        lines = [line for p in logs for line in p.read_text().splitlines() if line.strip()]
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    records = [json.loads(line) for line in lines]  # every line parses
    assert records and all(r["deployment"] == "qrag_Ingress" and r["component_name"] == "replica" for r in records)
    assert any(
        r["message"].startswith("GET / 200") and r.get("request_id") for r in records
    )  # the request's access log


def test_log_json_reaches_every_deployment(tmp_path):
    """qrag serve --log-json, $QRAG_SERVE_JSON_LOGS or the config file's app-level logging_config:
    each deployment's options carry Serve's logging_config (checked by Serve's own schema)."""
    from argparse import Namespace

    from qrag.cli.serve import serve_logging_config
    from qrag.distributed.serve_app import with_logging
    from qrag.distributed.serving import deployment_overrides

    config = tmp_path / "serve.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "applications": [
                    {
                        "name": "qrag",
                        "import_path": "qrag.distributed.serve_app:build",
                        "logging_config": {"log_level": "DEBUG"},
                        "deployments": [{"name": "Shard1", "logging_config": {"log_level": "WARNING"}}],
                    }
                ]
            }
        )
    )
    args = Namespace(config=str(config))
    deployments = with_logging(
        [{"name": "Shard1", "logging_config": {"log_level": "WARNING"}}], 2, serve_logging_config(args), True
    )
    options = deployment_overrides(deployments, 2)
    assert (
        options["Ingress"]["logging_config"]
        == options["Shard0"]["logging_config"]
        == {"log_level": "DEBUG", "encoding": "JSON"}
    )
    assert options["Shard1"]["logging_config"] == {"log_level": "WARNING", "encoding": "JSON"}  # its own level wins
    assert with_logging([{"name": "Ingress", "num_replicas": 2}], 0, None, False) == [
        {"name": "Ingress", "num_replicas": 2}
    ]
