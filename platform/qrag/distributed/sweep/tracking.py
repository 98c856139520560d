"""MLflow for a sweep: one parent run, every trial's training run nested under it.

* The parent run is found again by the sweep's directory (tag ``qrag.sweep_key``): a resumed
  sweep keeps its parent. Its params are the sweep's settings; they cannot change on resume.
* Trial runs are opened by ``train_with_ray`` (``qrag.integrations.tracking``) with the parent's
  id in ``mlflow.parentRunId``. A trial stopped by the scheduler dies with its Ray Train run, so
  the sweep closes its MLflow run afterwards (status KILLED, tag ``qrag.stopped_early``). A trial
  that had to start over (interrupted before its first checkpoint) leaves a superseded run
  behind; it is deleted, so that the parent holds exactly one run per trial.
* At the end the parent records the best trial (params ``best.<key>``, metric ``best/<metric>``,
  tags with its run id and checkpoint) and gets the results CSV, the plot and the best config.
  With ``distributed.mlflow_registered_model`` the best trial's model is registered under that
  name and the alias (``distributed.mlflow_model_alias``, default ``champion``) points at it.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import yaml

from qrag.config import ConfigError, flatten, to_dict
from qrag.distributed.sweep.results import SweepReport, TrialOutcome
from qrag.distributed.sweep.spec import Sweep
from qrag.integrations.tracking import PARENT_TAG, RUN_KEY_TAG, _experiment_id, client_for

SWEEP_KEY_TAG = "qrag.sweep_key"
DEFAULT_ALIAS = "champion"  # the registered version of a sweep's best trial


def sweep_params(sweep: Sweep) -> dict[str, str]:
    summary = {k: v for k, v in sweep.summary().items() if k not in ("source", "name")}
    return {key: str(value) for key, value in flatten(summary).items()}


def open_parent(uri: str, sweep: Sweep, *, resuming: bool) -> str:
    """The sweep's parent run: the existing one when resuming, else a new one. Its id."""
    from mlflow.entities import Param

    client = client_for(uri)
    exp = _experiment_id(client, sweep.base.distributed.mlflow_experiment, uri)
    key = hashlib.sha1(sweep.sweep_dir().encode()).hexdigest()[:20]
    found = client.search_runs([exp], filter_string=f"tags.`{SWEEP_KEY_TAG}` = '{key}'", max_results=1)
    if found and not resuming:  # the sweep's storage was cleared: it starts over
        client.set_tag(found[0].info.run_id, SWEEP_KEY_TAG, f"{key}-superseded")
        found = []
    params = sweep_params(sweep)
    if found:
        run = found[0]
        changed = sorted(
            k
            for k in params
            if k in run.data.params
            and run.data.params[k] != params[k]
            and not k.startswith(("max_concurrent", "resources."))
        )
        if changed:
            shown = ", ".join(f"{k}: {run.data.params[k]} -> {params[k]}" for k in changed[:3])
            raise ConfigError(
                f"sweep {sweep.name!r} in {sweep.sweep_dir()} was started with other settings ({shown}); "
                "resume it unchanged or choose a new --name"
            )
        run_id = run.info.run_id
        params = {k: v for k, v in params.items() if k not in run.data.params}
        client.update_run(run_id, status="RUNNING")
        client.set_tag(run_id, "qrag.resumed", str(int(run.data.tags.get("qrag.resumed", "0")) + 1))
    else:
        run_id = client.create_run(
            exp,
            run_name=sweep.name,
            tags={
                SWEEP_KEY_TAG: key,
                "qrag.sweep_dir": sweep.sweep_dir(),
                "qrag.kind": "sweep",
            },
        ).info.run_id
        client.log_text(run_id, yaml.safe_dump(to_dict(sweep.base), sort_keys=False), "base_config.yaml")
        client.log_text(run_id, Path(sweep.source).read_text(encoding="utf-8"), "sweep.yaml")
    items = [Param(k, v) for k, v in params.items()]
    for i in range(0, len(items), 100):
        client.log_batch(run_id, params=items[i : i + 100])
    return run_id


def mark_interrupted(uri: str, parent_id: str) -> None:
    client = client_for(uri)
    client.set_tag(parent_id, "qrag.interrupted", "true")
    client.set_terminated(parent_id, "KILLED")


def record_trials(uri: str, parent_id: str, sweep: Sweep, outcomes: list[TrialOutcome]) -> None:
    """Link each outcome to its MLflow run and close the runs the scheduler cut short."""
    client = client_for(uri)
    exp = client.get_run(parent_id).info.experiment_id
    by_dir = {}
    for run in client.search_runs([exp], filter_string=f"tags.`{PARENT_TAG}` = '{parent_id}'", max_results=10000):
        if run.data.tags.get(RUN_KEY_TAG, "").endswith("-superseded"):
            client.delete_run(run.info.run_id)  # an earlier start of a trial that began again from scratch
        else:
            by_dir[run.data.tags.get("qrag.run_dir")] = run
    for o in outcomes:
        run = by_dir.get(o.run_dir)
        if run is None:
            continue  # the trial failed before its training run opened
        o.mlflow_run_id = run.info.run_id
        for key, value in (
            ("qrag.sweep", sweep.name),
            ("qrag.trial_id", o.trial_id),
            ("qrag.trial_status", o.status),
            ("qrag.swept", ",".join(sweep.keys)),
        ):
            client.set_tag(run.info.run_id, key, value)
        if o.status == "stopped":
            client.set_tag(run.info.run_id, "qrag.stopped_early", "true")
            client.set_tag(run.info.run_id, "qrag.stopped_at_update", str(o.updates))
        # The scheduler's stop kills the trial mid-run: train_with_ray marks that FAILED, or nothing
        # at all when the process went first (and a learner a few updates from its end may even
        # finish before the kill reaches it). For the sweep it was stopped: KILLED, whatever came last.
        if o.status == "stopped" and run.info.status != "KILLED":
            client.set_terminated(run.info.run_id, "KILLED")
        elif o.status == "error" and run.info.status == "RUNNING":
            client.set_terminated(run.info.run_id, "FAILED")


def record_sweep(uri: str, parent_id: str, sweep: Sweep, report: SweepReport, outcomes: list[TrialOutcome]) -> None:
    """Results, plot, best config and the best trial on the parent run; the parent is finished."""
    from mlflow.entities import Metric, Param, RunTag

    client = client_for(uri)
    for path in (report.csv, report.png, report.best_yaml):
        if path is not None and path.is_file():
            client.log_artifact(parent_id, str(path))
    now = int(time.time() * 1000)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("completed", "stopped", "error")}
    metrics = [Metric(f"trials/{s}", float(n), now, 0) for s, n in counts.items()]
    tags = [RunTag("qrag.trials", str(len(outcomes)))]
    params: list = []
    best = report.best
    if best is not None:
        score = best.score(sweep.mode, sweep.score_scope)
        if score is not None:
            metrics.append(Metric(f"best/{sweep.metric}", float(score), now, 0))
        tags += [
            RunTag("qrag.best_trial", best.trial_id),
            RunTag("qrag.best_run_id", best.mlflow_run_id or ""),
            RunTag("qrag.best_checkpoint", best.checkpoint or ""),
            RunTag("qrag.best_config", str(report.best_yaml)),
        ]
        logged = client.get_run(parent_id).data.params
        params = [Param(f"best.{k}", str(v)) for k, v in best.params.items() if f"best.{k}" not in logged]
        d = sweep.base.distributed
        if d.mlflow_registered_model and best.mlflow_run_id and d.mlflow_model:
            from qrag.integrations.mlflow_model import register

            alias = d.mlflow_model_alias or DEFAULT_ALIAS
            version = register(client, best.mlflow_run_id, d.mlflow_registered_model, alias)
            tags.append(RunTag("qrag.best_model", f"models:/{d.mlflow_registered_model}@{alias} (version {version})"))
    client.log_batch(parent_id, metrics=metrics, params=params, tags=tags)
    client.set_terminated(parent_id, "FINISHED")
