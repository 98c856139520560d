"""Training on a real local Ray cluster (127.0.0.1): `ray job submit`, MLflow, checkpoints that
survive a dead EpisodeFeeder, a crashed learner and a re-submitted job."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from ray_cluster import RAY, local_ray_cluster

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """`ray start --head` on 127.0.0.1 with its own ports, temp dir and auth token; stopped by pid."""
    if shutil.which(RAY) is None and not Path(RAY).exists():
        pytest.skip("the ray CLI is not installed")
    with local_ray_cluster(tmp_path_factory.mktemp("ray")) as c:
        yield c


def _args(tiny_encoder, hotpot_file, out_dir, name, *extra):
    return [
        "--config",
        "configs/smoke.yaml",
        f"model.encoder={tiny_encoder}",
        f"data.path={hotpot_file}",
        f"out_dir={out_dir}",
        f"name={name}",
        "learner.episodes_per_update=6",
        "learner.micro_batch=6",
        "learner.warmup_updates=2",
        "eval_limit=6",
        "log_every=1",
        "data.chunk_tokens=48",
        "checkpoint_every=2",
        "distributed.runners=2",
        "distributed.runner_cpus=0.5",
        *extra,
    ]


def _train(cluster, args, timeout=420):
    """`python jobs/train_hotpot.py` against the cluster (the plain-python path of the job)."""
    return subprocess.run(
        [sys.executable, "jobs/train_hotpot.py", "--address", cluster["gcs"], *args],
        cwd=ROOT,
        env=cluster["env"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _mlflow_run(out_dir: Path, name: str):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{out_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("qrag")
    runs = [r for r in client.search_runs([exp.experiment_id]) if r.info.run_name == name]
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return client, runs[0]


def _summary(stdout: str) -> dict:
    """The job's closing JSON line (Ray may forward worker log lines after it)."""
    return json.loads([line for line in stdout.splitlines() if line.startswith('{"run_dir"')][-1])


def _steps(client, run, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run.info.run_id, key))


def test_ray_job_submit_trains_tracks_and_checkpoints(cluster, tiny_encoder, hotpot_file, tmp_path):
    out = tmp_path / "storage" / "runs"
    # No --base-dir: the relative out_dir lands under Ray's storage root ($RAY_STORAGE, else
    # ~/ray_results), not in Ray's temporary copy. The job's own runtime env sets a variable the
    # driver forwards too (QRAG_DATA_DIR): the job's value stays, nothing clashes.
    job_env = {"env_vars": {"RAY_STORAGE": str(tmp_path / "storage"), "QRAG_DATA_DIR": str(tmp_path)}}
    job = subprocess.run(
        [
            RAY,
            "job",
            "submit",
            "--address",
            cluster["api"],
            "--working-dir",
            ".",
            "--runtime-env-json",
            json.dumps(job_env),
            "--",
            "python",
            "jobs/train_hotpot.py",
            *_args(
                tiny_encoder,
                hotpot_file,
                "runs",
                "submitted",
                "updates=3",
                "eval_every=2",
                "keep_best=true",
                "data.val_fraction=0.2",
            ),
        ],
        cwd=ROOT,
        env=cluster["env"],
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert job.returncode == 0 and "succeeded" in job.stdout + job.stderr, (job.stdout + job.stderr)[-4000:]
    summary = _summary(job.stdout)
    assert summary["updates"] == 3 and summary["run_dir"] == str(
        out / "submitted"
    )  # Ray's storage root, not Ray's copy
    client, run = _mlflow_run(out, "submitted")
    assert run.info.status == "FINISHED" and run.info.run_id == summary["mlflow_run_id"]
    assert _steps(client, run, "train/loss") == [1, 2, 3]
    assert _steps(client, run, "eval/fact_f1") == [2, 3]  # on the validation part, which the learner kept
    assert "final/dev_fact_f1" in run.data.metrics and "perf/runner_wait_share" in run.data.metrics
    assert run.data.params["distributed.runners"] == "2" and run.data.params["out_dir"] == str(out)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "checkpoint")}
    assert {"checkpoint/qrag.json", "checkpoint/state_encoder", "checkpoint/tokenizer"} <= artifacts
    assert "model/MLmodel" in {a.path for a in client.list_artifacts(run.info.run_id, "model")}  # the pyfunc model
    # Ray's copy of the working dir has no .git: the sources' digest identifies the code.
    assert run.data.tags.get("qrag.source_sha256") and run.inputs.dataset_inputs[0].dataset.name == "hotpotqa"
    assert (out / "submitted" / "checkpoints" / "update_0000002" / "trainer").is_dir()
    assert (out / "submitted" / "final" / "eval.json").is_file() and (out / "submitted" / "final" / "trainer").is_dir()
    assert (
        summary["checkpoint"] == str(out / "submitted" / "best")
        and (out / "submitted" / "best" / "qrag.json").is_file()
    )
    local = client.download_artifacts(run.info.run_id, "checkpoint", str(tmp_path / "dl"))
    ev = subprocess.run(
        [sys.executable, "-m", "qrag", "eval", "--checkpoint", local, "--limit", "4", "--device", "cpu"],
        env=cluster["env"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ev.returncode == 0, ev.stderr
    assert json.loads(ev.stdout)["num_samples"] == 4


def test_dead_runner_and_crashed_learner_do_not_stop_the_run(cluster, tiny_encoder, hotpot_file, tmp_path):
    out = tmp_path / "runs"
    # Runner 0 dies while serving a request of update 2; the learner dies after update 3, one
    # update past its checkpoint at update 2, and Ray Train restarts it from there.
    args = _args(
        tiny_encoder,
        hotpot_file,
        out,
        "faults",
        "updates=5",
        "distributed.kill_runner_at_update=1",
        "distributed.fail_at_update=3",
        "distributed.max_failures=1",
    )
    res = _train(cluster, args)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    log = res.stdout + res.stderr
    assert "EpisodeFeeder 0 dies" in log and "the learner exits after update 3" in log
    assert "from update 2" in log  # the restarted learner resumed from the checkpoint
    assert _summary(res.stdout)["updates"] == 5
    client, run = _mlflow_run(out, "faults")
    assert _steps(client, run, "train/loss") == [1, 2, 3, 4, 5]  # continuous: nothing twice, nothing missing
    # Ray restarted the runner and re-ran its requests there (max_task_retries); the pool saw it.
    assert max(m.value for m in client.get_metric_history(run.info.run_id, "perf/runner_restarts")) >= 1
    assert max(m.value for m in client.get_metric_history(run.info.run_id, "perf/runner_requests_lost")) >= 1
    assert sorted(p.name for p in (out / "faults" / ".faults").iterdir()) == ["learner_after_3", "runner0_after_1"]


def test_resubmitting_a_failed_run_resumes_it(cluster, tiny_encoder, hotpot_file, tmp_path):
    out = tmp_path / "runs"
    # keep_best with an evaluation every update: the best checkpoint chosen before the crash
    # must survive it (the resumed run restores its selection key and may never choose another).
    args = _args(
        tiny_encoder,
        hotpot_file,
        out,
        "again",
        "updates=4",
        "distributed.fail_at_update=3",
        "distributed.max_failures=0",
        "keep_best=true",
        "eval_every=1",
        "data.val_fraction=0.3",
    )  # keep_best needs a validation part
    first = _train(cluster, args)
    assert first.returncode == 1 and "submit the same command again" in first.stderr, (first.stdout + first.stderr)[
        -4000:
    ]
    client, run = _mlflow_run(out, "again")
    assert run.info.status == "FAILED" and _steps(client, run, "train/loss") == [1, 2, 3]
    second = _train(cluster, args)
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    assert "from update 2" in second.stderr
    client, resumed = _mlflow_run(out, "again")
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    assert _steps(client, resumed, "train/loss") == [1, 2, 3, 4]
    state = json.loads((out / "again" / "final" / "trainer" / "state.json").read_text())
    assert state["learner"]["update"] == 4
    assert (out / "again" / "best").is_dir() and any((out / "again" / "best").iterdir())
    assert _summary(second.stdout)["checkpoint"].endswith("/again/best")  # the run reports its chosen checkpoint
    third = _train(cluster, args, timeout=120)  # finished: nothing to do, Ray is not even contacted
    assert third.returncode == 0 and "already finished (4 updates)" in third.stdout
