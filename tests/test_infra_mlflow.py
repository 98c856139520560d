"""A real MLflow tracking server (infra/mlflow/server.sh) on 127.0.0.1, with a SQLite and (where
PostgreSQL is installed) a PostgreSQL backend store: a short Ray training job logs to it over
HTTP, and the run, its metrics and its checkpoint artifact are read back from the server.
On the same local Ray cluster: EpisodeFeeders carry the configured custom resource and no GPU, and
Serve-like GPU fractions put two shards on two different GPUs whatever the start order.

The server comes from its own venv (`make mlflow-server`: full mlflow at the client's version;
qrag itself only has mlflow-skinny, which cannot serve)."""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, free_ports
from ray_cluster import local_ray_cluster

pytestmark = pytest.mark.ray

SERVER_SCRIPT = ROOT / "infra" / "mlflow" / "server.sh"
MARKER = "qrag_cpu_node"  # the CPU worker group's marker resource (infra/kuberay, infra/cluster.yaml)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def stop_group(proc: subprocess.Popen, timeout: float = 5) -> None:
    """SIGTERM the process group this test started (and only it), then SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def mlflow_bin() -> str:
    path = os.environ.get("QRAG_MLFLOW_SERVER_BIN") or str(ROOT / ".venv" / "mlflow-server" / "bin" / "mlflow")
    if not Path(path).is_file():
        message = f"no MLflow server at {path}: run `make mlflow-server` (or set QRAG_MLFLOW_SERVER_BIN)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI builds it with `make test`: a missing server is a failure there
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """`ray start --head` on 127.0.0.1: 3 CPUs, 2 logical GPUs (placement only; nothing runs CUDA),
    the CPU-node marker resource; own ports, temp dir and auth token; stopped by process group."""
    with local_ray_cluster(
        tmp_path_factory.mktemp("ray"),
        num_gpus=2,
        resources={MARKER: 100},
        drop_env=("RAY_ADDRESS", "MLFLOW_TRACKING_URI"),
    ) as c:
        yield c


# -- PostgreSQL (skipped where it is not installed) ----------------------------------------------


def postgres_bin() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(versions[-1]).parent if versions else None


class Postgres:
    """A throwaway PostgreSQL cluster on 127.0.0.1 (trust auth, loopback only)."""

    def __init__(self, bindir: Path):
        self.bindir = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="qrag-pg-"))
        self.port = free_ports(1)[0]
        self.as_user: list[str] = []
        if os.geteuid() == 0:  # PostgreSQL refuses to run as root
            user = pwd.getpwnam("postgres")
            os.chown(self.dir, user.pw_uid, user.pw_gid)
            self.as_user = ["runuser", "-u", "postgres", "--"]

    def run(self, tool: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*self.as_user, str(self.bindir / tool), *args], capture_output=True, text=True, timeout=120
        )

    def start(self) -> None:
        for step in (
            ("initdb", "-D", str(self.dir / "data"), "-U", "postgres", "-A", "trust", "--no-sync"),
            (
                "pg_ctl",
                "start",
                "-w",
                "-D",
                str(self.dir / "data"),
                "-l",
                str(self.dir / "log"),
                "-o",
                f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.dir} -c fsync=off",
            ),
            ("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "mlflow"),
        ):
            res = self.run(*step)
            if res.returncode:
                log = (self.dir / "log").read_text()[-1500:] if (self.dir / "log").exists() else ""
                raise RuntimeError(f"{step[0]} failed: {res.stderr.strip()} {log}")

    def sql(self, query: str) -> str:
        res = self.run(
            "psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d", "mlflow", "-At", "-c", query
        )
        assert res.returncode == 0, res.stderr
        return res.stdout.strip()

    @property
    def uri(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/mlflow"

    def stop(self) -> None:
        self.run("pg_ctl", "stop", "-D", str(self.dir / "data"), "-m", "immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request, tmp_path):
    """(backend store URI, PostgreSQL handle or None)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'server' / 'mlflow.db'}", None
        return
    bindir = postgres_bin()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed (apt-get install -y postgresql)")
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        if os.geteuid() == 0:
            pytest.skip("PostgreSQL is installed but there is no postgres user to run it as")
    pg = Postgres(bindir)
    try:
        pg.start()
        yield pg.uri, pg
    finally:
        pg.stop()


@pytest.fixture
def mlflow_server(mlflow_bin, backend, tmp_path):
    """infra/mlflow/server.sh on 127.0.0.1:<free port>; its URL, artifact folder and database."""
    uri, pg = backend
    port = free_ports(1)[0]
    artifacts = tmp_path / "server" / "artifacts"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(
        MLFLOW_BIN=mlflow_bin,
        MLFLOW_BACKEND_STORE_URI=uri,
        MLFLOW_ARTIFACTS_DESTINATION=str(artifacts),
        MLFLOW_HOST="127.0.0.1",
        MLFLOW_PORT=str(port),
        MLFLOW_WORKERS="1",
    )
    log = open(tmp_path / "mlflow_server.log", "w")
    proc = subprocess.Popen(
        ["bash", str(SERVER_SCRIPT)],
        env=env,
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"mlflow server did not start: {(tmp_path / 'mlflow_server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield {"url": url, "artifacts": artifacts, "pg": pg, "log": tmp_path / "mlflow_server.log"}
    finally:
        stop_group(proc)
        log.close()


def train(
    cluster, tiny_encoder, hotpot_file, out_dir: Path, tracking_uri: str, name: str
) -> subprocess.CompletedProcess:
    """jobs/train_hotpot.py against the cluster, tracking to ``tracking_uri`` from the environment."""
    args = [
        "--config",
        "configs/smoke.yaml",
        f"model.encoder={tiny_encoder}",
        f"data.path={hotpot_file}",
        f"out_dir={out_dir}",
        f"name={name}",
        "updates=2",
        "learner.episodes_per_update=4",
        "learner.micro_batch=4",
        "learner.warmup_updates=1",
        "eval_limit=4",
        "log_every=1",
        "data.chunk_tokens=48",
        "distributed.runners=1",
        "distributed.runner_cpus=0.5",
        "distributed.learner_gpu=false",
        f"distributed.runner_resources={{{MARKER}: 0.001}}",
    ]
    env = {**cluster["env"], "MLFLOW_TRACKING_URI": tracking_uri}
    return subprocess.run(
        [sys.executable, "jobs/train_hotpot.py", "--address", cluster["gcs"], *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )


PROBE_RUNNERS = """
import json, sys
from ray.util.state import list_actors
actors = list_actors(address=sys.argv[1], filters=[("class_name", "=", "EpisodeFeeder")], detail=True, limit=1000)
print(json.dumps([a.required_resources for a in actors]))
"""


def test_training_logs_to_a_real_mlflow_server(cluster, mlflow_server, tiny_encoder, hotpot_file, tmp_path):
    from mlflow import MlflowClient

    from qrag.model.checkpoint import load_qnet
    from qrag.retrieval.embedder import resolve_source

    url, out = mlflow_server["url"], tmp_path / "runs"
    name = f"infra-{'pg' if mlflow_server['pg'] else 'sqlite'}"
    job = train(cluster, tiny_encoder, hotpot_file, out, url, name)
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    summary = json.loads(job.stdout.strip().splitlines()[-1])
    assert summary["tracking_uri"] == url and summary["updates"] == 2

    client = MlflowClient(url)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.run_name == name and run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == [1, 2]
    assert "final/dev_fact_f1" in run.data.metrics
    assert run.data.params[f"distributed.runner_resources.{MARKER}"] == "0.001"
    # Artifacts went through the server (proxied) into its artifact store, not onto the client's disk.
    files = {a.path for a in client.list_artifacts(run.info.run_id, "checkpoint")}
    assert {
        "checkpoint/qrag.json",
        "checkpoint/state_encoder",
        "checkpoint/action_encoder",
        "checkpoint/tokenizer",
    } <= files
    stored = list(mlflow_server["artifacts"].rglob("qrag.json"))  # checkpoint/ and the pyfunc model's copy
    assert len(stored) == 2 and all(run.info.run_id in str(p) for p in stored)
    assert "model/MLmodel" in {a.path for a in client.list_artifacts(run.info.run_id, "model")}
    assert not (out / "mlflow.db").exists() and not (out / "mlruns").exists()
    # What Serve does with `checkpoint: runs:/<run>/checkpoint`: download it and load the model.
    source = resolve_source(f"runs:/{run.info.run_id}/checkpoint", cache_dir=tmp_path / "models", tracking_uri=url)
    qnet, _, layout, cfg = load_qnet(source.directory, "cpu", False)
    assert cfg.name == name and layout.max_state_tokens == cfg.model.max_state_tokens
    if mlflow_server["pg"]:  # the server really wrote to PostgreSQL
        assert (
            mlflow_server["pg"].sql(f"select name || ' ' || status from runs where run_uuid = '{run.info.run_id}'")
            == f"{name} FINISHED"
        )
        assert (
            int(
                mlflow_server["pg"].sql(
                    f"select count(*) from metrics where run_uuid = '{run.info.run_id}' and key = 'train/loss'"
                )
            )
            == 2
        )

    # The runner asked Ray for the CPU nodes' marker and for no GPU.
    probe = subprocess.run(
        [sys.executable, "-c", PROBE_RUNNERS, cluster["api"]],
        env=cluster["env"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    asked = json.loads(probe.stdout.strip().splitlines()[-1])
    assert asked and all(r.get(MARKER) == 0.001 and not r.get("GPU") and r.get("CPU") == 0.5 for r in asked), asked


PROBE_SHARDS = """
import json, sys, time, ray
from qrag.distributed.placement import shard_gpu_fraction

@ray.remote(num_cpus=0)
class Holder:
    def gpu(self):
        return ray.get_gpu_ids()

ray.init(address=sys.argv[1], logging_level="ERROR")
shard = shard_gpu_fraction(2, 2, reserved=0.4)
orders = {
    "others_first": [("learner", 0.2), ("encoder", 0.2), ("shard0", shard), ("shard1", shard)],
    "shards_first": [("shard0", shard), ("shard1", shard), ("encoder", 0.2), ("learner", 0.2)],
}
out = {}
for label, order in orders.items():
    actors = {}
    for name, gpus in order:  # one at a time, in this order
        actors[name] = Holder.options(num_gpus=gpus).remote()
        ray.get(actors[name].gpu.remote(), timeout=120)
    out[label] = {name: ray.get(a.gpu.remote()) for name, a in actors.items()}
    for a in actors.values():
        ray.kill(a)
    deadline = time.time() + 60
    while ray.available_resources().get("GPU", 0) < 2 and time.time() < deadline:  # kills are asynchronous
        time.sleep(0.2)
print(json.dumps({"shard_gpus": shard, **out}))
"""


def test_shards_get_a_gpu_each_whatever_the_start_order(cluster):
    """Ray's own GPU assignment on the 2-GPU test cluster, with the fractions of the RayService."""
    probe = subprocess.run(
        [sys.executable, "-c", PROBE_SHARDS, cluster["gcs"]],
        env=cluster["env"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    assert result["shard_gpus"] == pytest.approx(0.6)
    for label in ("others_first", "shards_first"):
        ids = result[label]
        assert all(len(v) == 1 for v in ids.values()), ids
        assert ids["shard0"] != ids["shard1"], (label, ids)


def test_local_train_registers_a_model_that_serves_by_alias(
    mlflow_server, tiny_encoder, hotpot_file, tmp_path, monkeypatch
):
    """`qrag train` (no Ray) logs to the server with the Ray path's logger: the reported checkpoint
    becomes a pyfunc model, registered with an alias; `models:/<name>@<alias>` loads both as a
    pyfunc (questions + chunks in, steps out) and as the checkpoint `qrag serve` uses."""
    import mlflow.pyfunc
    from mlflow import MlflowClient

    from qrag.retrieval.embedder import load_embedding_model, resolve_source

    url = mlflow_server["url"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(MLFLOW_TRACKING_URI=url, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT / "platform"))
    args = [
        f"model.encoder={tiny_encoder}",
        f"data.path={hotpot_file}",
        f"out_dir={tmp_path / 'runs'}",
        "name=local",
        "updates=2",
        "log_every=1",
        "learner.episodes_per_update=4",
        "learner.micro_batch=4",
        "eval_limit=4",
        "data.chunk_tokens=48",
        "distributed.mlflow_registered_model=qrag-local",
        "distributed.mlflow_model_alias=champion",
        "--no-progress",
    ]
    job = subprocess.run(
        [sys.executable, "-m", "qrag", "train", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert job.returncode == 0, (job.stdout + job.stderr)[-4000:]
    summary = json.loads(job.stdout.strip().splitlines()[-1])
    client = MlflowClient(url)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags.get("mlflow.source.git.commit")
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == [1, 2]
    assert [d.dataset.name for d in run.inputs.dataset_inputs] == ["hotpotqa"]
    version = client.get_model_version_by_alias("qrag-local", "champion")
    assert version.run_id == run.info.run_id

    uri = "models:/qrag-local@champion"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)  # the registry too
    model = mlflow.pyfunc.load_model(uri)
    assert [c.name for c in model.metadata.get_input_schema().inputs] == ["question", "chunks"]
    chunks = [
        "Paris is the capital of France.",
        "The Seine flows through Paris.",
        "Bananas are yellow.",
        "Berlin is in Germany.",
    ]
    out = model.predict(
        [{"question": "Which river flows through the capital of France?", "chunks": chunks}], params={"max_steps": 2}
    )
    steps = out[0]["steps"]
    assert (
        len(steps) == 2
        and len({s["chunk"] for s in steps}) == 2
        and all(s["text"] == chunks[s["chunk"]] for s in steps)
    )
    params = {p.name: p.default for p in model.metadata.get_params_schema().params}
    assert params == {"max_steps": 2, "beam_width": 1, "beam_score": "min"}
    beam = model.predict(
        [{"question": "Which river?", "chunks": chunks}], params={"beam_width": 2, "beam_score": "logprob"}
    )
    assert len(beam[0]["steps"]) == 2
    with pytest.raises(ValueError, match="beam_score"):  # a rule the search does not know
        model.predict([{"question": "Which river?", "chunks": chunks}], params={"beam_width": 2, "beam_score": "mean"})
    # What `qrag serve --checkpoint models:/qrag-local@champion` (and the RayService) loads.
    source = resolve_source(uri, cache_dir=tmp_path / "models", tracking_uri=url)
    served = load_embedding_model(source, "cpu")
    assert served.info()["trained"] and served.model_cfg.encoder == tiny_encoder
    # The alias moves to a new version: the next load follows it (the cache is per version).
    from qrag.integrations.mlflow_model import register

    assert register(client, run.info.run_id, "qrag-local", "champion") == "2"
    moved = resolve_source(uri, cache_dir=tmp_path / "models", tracking_uri=url)
    assert moved.directory != source.directory and (moved.directory / "qrag.json").is_file()
