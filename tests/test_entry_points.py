"""What a pip user runs: the installed ``qrag`` command (``qrag train --ray``, ``qrag sweep``) and
the Serve app's import path inside the package, with no checkout on ``sys.path``."""

from __future__ import annotations

import importlib
import json
import os
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
    return subprocess.run([str(QRAG), *args], cwd=cwd, env={**clean, **env}, capture_output=True, text=True, timeout=timeout)


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
    bad.write_text(yaml.safe_dump({"name": "s", "base": str(ROOT / "configs" / "smoke.yaml"),
                                   "space": {"model.positions": {"choice": ["none", "relativ"]}}}))
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

    args = typed_args({"shards": "4", "warm_up": "false", "checkpoint": "runs/x/final", "api_keys": "k:write",
                       "allowed_hosts": "[a, b]", "shard_memory_bytes": "null", "dtype": "float16", "encoder_device": "cuda:0"})
    cfg = from_dict(ServeConfig, args)
    assert (cfg.shards, cfg.warm_up, cfg.checkpoint, cfg.api_keys) == (4, False, "runs/x/final", "k:write")
    assert (cfg.allowed_hosts, cfg.shard_memory_bytes, cfg.dtype, cfg.encoder_device) == (["a", "b"], None, "float16", "cuda:0")


@pytest.mark.ray
def test_qrag_train_ray_trains_on_a_local_ray(tiny_encoder, hotpot_file, tmp_path):
    out = installed(["train", "--ray", "--config", str(ROOT / "configs" / "smoke.yaml"), f"model.encoder={tiny_encoder}",
                     f"data.path={hotpot_file}", f"out_dir={tmp_path / 'runs'}", "name=pip", "updates=2", "eval_limit=4",
                     "learner.episodes_per_update=4", "learner.micro_batch=4", "data.chunk_tokens=48", "distributed.runners=1",
                     "distributed.runner_cpus=0.5", "distributed.mlflow_uri=none"], tmp_path, timeout=600, RAY_USAGE_STATS_ENABLED="0")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    summary = json.loads([line for line in out.stdout.splitlines() if line.startswith('{"run_dir"')][-1])
    assert summary["updates"] == 2 and Path(summary["checkpoint"]).is_dir()
    assert "qrag train: Ray started locally on 127.0.0.1" in out.stdout
