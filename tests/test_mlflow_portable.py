"""The MLflow model serves elsewhere: it carries qrag's source (code_paths) and pins only packages
an index holds, so `mlflow models serve -m models:/<name>@champion --env-manager virtualenv`
against the real tracking server builds an environment without qrag, loads the model there and
answers /invocations like the model in this process."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import free_ports
from test_infra_mlflow import listening, mlflow_bin, mlflow_server, stop_group  # noqa: F401 - fixtures: the real server

CHUNKS = [
    "Paris is the capital of France.",
    "The Seine flows through Paris.",
    "Bananas are yellow.",
    "Berlin is in Germany.",
]
ROWS = [{"question": "Which river flows through the capital of France?", "chunks": CHUNKS}]


@pytest.fixture
def backend(tmp_path):
    """SQLite only (test_infra_mlflow.py covers PostgreSQL): (backend store URI, no PostgreSQL)."""
    yield f"sqlite:///{tmp_path / 'server' / 'mlflow.db'}", None


@pytest.fixture
def saved_model(tiny_encoder, tmp_path):
    import torch

    from qrag.config import load_config
    from qrag.integrations.mlflow_model import save_model
    from qrag.model.checkpoint import save_checkpoint, untrained_qnet

    cfg = load_config(None, [f"model.encoder={tiny_encoder}", "model.positions=relative"])
    qnet, tok, _ = untrained_qnet(cfg.model, torch.device("cpu"), use_target=False)
    checkpoint = save_checkpoint(tmp_path / "final", qnet, tok, cfg)
    return checkpoint, save_model(checkpoint, tmp_path / "model")


def test_the_model_carries_qrag_and_pins_only_indexed_packages(saved_model):
    from qrag.integrations.mlflow_model import RUNTIME_PACKAGES

    _, model = saved_model
    requirements = (model / "requirements.txt").read_text().split()
    assert not [r for r in requirements if r.lower().startswith("qrag")]  # no index holds qrag
    assert [r.split("==")[0] for r in requirements] == list(RUNTIME_PACKAGES) and all(
        "==" in r and "+" not in r for r in requirements
    )
    assert (model / "code" / "qrag" / "retrieval" / "search.py").is_file() and not list(
        (model / "code").rglob("__pycache__")
    )
    assert "code: code" in (model / "MLmodel").read_text()


@pytest.mark.slow
def test_mlflow_models_serve_restores_an_environment_without_qrag(mlflow_server, mlflow_bin, saved_model, tmp_path):  # noqa: F811
    import mlflow.pyfunc
    from mlflow import MlflowClient

    from qrag.integrations.mlflow_model import log_model, register

    virtualenv = Path(mlflow_bin).parent / "virtualenv"
    if not virtualenv.is_file():
        pytest.skip(f"no {virtualenv}: run `make mlflow-server`")
    checkpoint, saved = saved_model
    url = mlflow_server["url"]
    client = MlflowClient(url)
    run = client.create_run(client.create_experiment("portable")).info.run_id
    log_model(client, run, checkpoint)
    client.set_terminated(run)
    register(client, run, "qrag-portable", "champion")
    uri = "models:/qrag-portable@champion"
    expected = mlflow.pyfunc.load_model(str(saved)).predict(ROWS)  # the same checkpoint, in this process

    port = free_ports(1)[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PYTHONPATH", "VIRTUAL_ENV"))}
    env.update(
        MLFLOW_TRACKING_URI=url,
        MLFLOW_ENV_ROOT=str(tmp_path / "envs"),
        PATH=f"{Path(mlflow_bin).parent}{os.pathsep}{env['PATH']}",
    )
    log = open(tmp_path / "models_serve.log", "w")
    proc = subprocess.Popen(
        [mlflow_bin, "models", "serve", "-m", uri, "--env-manager", "virtualenv", "-h", "127.0.0.1", "-p", str(port)],
        env=env,
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 900  # the environment is built once: pip installs torch, transformers, mlflow-skinny
        while not listening(port):  # the scoring server listens once the model has loaded
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"mlflow models serve did not start: {(tmp_path / 'models_serve.log').read_text()[-4000:]}")
            time.sleep(1)
        body = json.dumps({"dataframe_records": ROWS}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/invocations", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as r:
            served = json.loads(r.read())["predictions"]
    finally:
        stop_group(proc)
        log.close()
    assert [[s["chunk"] for s in p["steps"]] for p in served] == [[s["chunk"] for s in p["steps"]] for p in expected]
    assert served[0]["steps"][0]["text"] == CHUNKS[served[0]["steps"][0]["chunk"]]

    # The environment it built has no qrag installed; the model loads there from its own copy.
    [python] = list((tmp_path / "envs").glob("mlflow-*/bin/python"))
    probe = (
        "import importlib.util, json, sys, mlflow.pyfunc\n"
        "assert importlib.util.find_spec('qrag') is None, 'qrag is installed'\n"
        "m = mlflow.pyfunc.load_model(sys.argv[1])\n"
        "print(json.dumps(m.predict(json.loads(sys.argv[2]))))\n"
    )
    out = subprocess.run(
        [str(python), "-c", probe, uri, json.dumps(ROWS)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == served
