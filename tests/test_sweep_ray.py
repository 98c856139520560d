"""The shipped smoke sweep (4 trials, tiny encoder) on a local Ray cluster (127.0.0.1): ASHA stops
the trials that cannot retrieve, every trial is an MLflow run under one parent run, a Ctrl-C'd
sweep resumes when submitted again (`ray job submit`), and the best config trains unchanged."""

from __future__ import annotations

import csv
import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT
from test_distributed_ray import RAY, cluster  # noqa: F401 - the module's local Ray cluster (ray start, 127.0.0.1)

pytestmark = pytest.mark.ray


def _lines(proc: subprocess.Popen) -> queue.Queue:
    """The process's output, line by line, read in a thread (so waiting can time out)."""
    out: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            out.put(line)
        out.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return out


def _interrupt_after_first_trial(cmd: list[str], env: dict, timeout: float = 300) -> tuple[int, str]:
    """Run the sweep; Ctrl-C it as soon as Tune reports its first trial finished."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, log, deadline = _lines(proc), [], time.time() + timeout
    try:
        while time.time() < deadline:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.time()))
            except queue.Empty:
                break
            if line is None:
                break
            log.append(line)
            if re.search(r"Trial smoke-\w+ completed after", line):
                proc.send_signal(signal.SIGINT)
                break
        proc.wait(timeout=180)
        while (line := lines.get(timeout=10)) is not None:
            log.append(line)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, "".join(log)


def test_sweep_stops_bad_trials_tracks_resumes_and_its_best_config_trains(cluster, tiny_encoder, hotpot_file, tmp_path):
    from mlflow import MlflowClient

    out = tmp_path / "runs"
    overrides = [
        f"model.encoder={tiny_encoder}",
        f"data.path={hotpot_file}",
        "distributed.mlflow_registered_model=qrag-smoke",
    ]

    # 1. plain `python tune/sweep.py` against the cluster, interrupted after its first trial
    code, log = _interrupt_after_first_trial(
        [
            sys.executable,
            "tune/sweep.py",
            "--address",
            cluster["gcs"],
            "--config",
            "tune/smoke.yaml",
            *overrides,
            f"out_dir={out}",
        ],
        cluster["env"],
    )
    assert code == 130 and "start the same command again to resume" in log, log[-4000:]
    parent_id = re.search(r"MLflow parent run (\w+)", log).group(1)

    # 2. the same sweep submitted as a Ray job (relative out_dir against --base-dir): it resumes
    job = subprocess.run(
        [
            RAY,
            "job",
            "submit",
            "--address",
            cluster["api"],
            "--working-dir",
            ".",
            "--",
            "python",
            "tune/sweep.py",
            "--base-dir",
            str(tmp_path),
            "--config",
            "tune/smoke.yaml",
            *overrides,
            "out_dir=runs",
        ],
        cwd=ROOT,
        env=cluster["env"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert job.returncode == 0 and "succeeded" in job.stdout + job.stderr, (job.stdout + job.stderr)[-4000:]
    assert "resuming 4 trials" in job.stdout + job.stderr
    summary = json.loads([line for line in job.stdout.splitlines() if line.startswith('{"sweep_dir"')][-1])
    assert summary["sweep_dir"] == str(out / "smoke") and summary["mlflow_parent_run_id"] == parent_id
    # Both trials with stop_threshold 10 retrieve nothing: ASHA stops them at the first rung, the
    # one started before the interruption too (its rungs survived the restart). Whether a good trial
    # passes the second rung depends on its learning curve; the first one always completes.
    assert summary["trials"]["error"] == 0 and summary["trials"]["completed"] >= 1 and summary["trials"]["stopped"] >= 2

    # 3. MLflow: one parent, four trial runs under it
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("qrag").experiment_id])
    parents = [r for r in runs if r.data.tags.get("qrag.kind") == "sweep"]
    assert [p.info.run_id for p in parents] == [parent_id]
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.tags["qrag.resumed"] == "1"
    trials = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent_id]
    assert len(trials) == 4 and len(runs) == 5
    stopped = [t for t in trials if t.data.tags.get("qrag.stopped_early") == "true"]
    finished = [t for t in trials if t.info.status == "FINISHED"]
    assert len(stopped) == summary["trials"]["stopped"] and len(finished) == summary["trials"]["completed"]
    assert {t.info.run_id for t in trials if t.data.params["search.stop_threshold"] == "10.0"} <= {
        t.info.run_id for t in stopped
    }
    for t in stopped:
        assert t.info.status == "KILLED" and t.data.tags["qrag.trial_status"] == "stopped"
        # its history starts at the first rung (a learner killed a moment after the decision may log a little more)
        assert min(m.step for m in client.get_metric_history(t.info.run_id, "eval/fact_f1")) == 2
    for t in finished:
        assert t.data.params["search.stop_threshold"] == "None" and "learner.alpha" in t.data.params
        assert sorted(m.step for m in client.get_metric_history(t.info.run_id, "eval/fact_f1")) == [2, 4, 6]
        assert "final/dev_fact_f1" in t.data.metrics
        assert "checkpoint/qrag.json" in {a.path for a in client.list_artifacts(t.info.run_id, "checkpoint")}
        assert t.data.tags["qrag.checkpoint"].endswith("/best")  # keep_best: the best checkpoint is the one logged
    best_id = parent.data.tags["qrag.best_run_id"]
    best_run = next(t for t in finished if t.info.run_id == best_id)
    assert parent.data.params["best.learner.alpha"] == best_run.data.params["learner.alpha"]
    assert parent.data.metrics["best/eval/fact_f1"] == max(
        m.value for m in client.get_metric_history(best_id, "eval/fact_f1")
    )
    assert {"results.csv", "fact_f1_vs_hparams.png", "best.yaml"} <= {a.path for a in client.list_artifacts(parent_id)}
    # The best trial's model is the registered version behind the alias `champion` (trials register nothing).
    assert client.get_model_version_by_alias("qrag-smoke", "champion").run_id == best_id
    assert len(client.search_model_versions("name='qrag-smoke'")) == 1

    # 4. the table, the plot and the best config
    rows = list(csv.DictReader(open(summary["results_csv"])))
    assert len(rows) == 4 and {r["status"] for r in rows} == {"completed", "stopped"}
    assert all(r["status"] == "stopped" and r["updates"] == "2" for r in rows if r["search.stop_threshold"] == "10.0")
    assert rows[0]["status"] == "completed"  # ranked by validation F1
    assert {r["mlflow_run_id"] for r in rows} == {t.info.run_id for t in trials}
    assert open(summary["plot"], "rb").read(4) == b"\x89PNG"
    best_yaml = summary["best_config"]
    train = subprocess.run(
        [sys.executable, "-m", "qrag", "train", "--config", best_yaml, "--no-progress"],
        cwd=tmp_path,
        env=cluster["env"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    trained = json.loads(train.stdout.strip().splitlines()[-1])
    assert trained["updates"] == 6 and trained["checkpoint"].startswith(str(out / "smoke-best"))

    from qrag.distributed.job import prepare

    job_cfg = prepare(["--config", best_yaml], str(ROOT / "configs" / "hotpot.yaml"), "train_hotpot.py").cfg
    assert job_cfg.learner.alpha == float(best_run.data.params["learner.alpha"]) and job_cfg.name == "smoke-best"
