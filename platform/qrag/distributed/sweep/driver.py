"""Hyperparameter sweeps: what ``qrag sweep`` and ``tune/sweep.py`` run, on Ray Tune or (``--local``) without Ray.

    python tune/sweep.py --config tune/hotpot_alpha_lambda_tau.yaml [key=value ...]   # a local Ray on 127.0.0.1
    ray job submit --working-dir . -- \
        python tune/sweep.py --config tune/hotpot_alpha_lambda_tau.yaml   # lands in ~/ray_results
    python tune/sweep.py --local --config tune/smoke.yaml              # no Ray, no MLflow: trials one by one

Order of work, as for training jobs: read and check the sweep file, the training config and its
paths, encoder and data (one-line error, exit code 2, before Ray is touched); connect; check that
one trial fits the cluster; open (or find again) the MLflow parent run; run or resume the Tuner;
then write ``results.csv``, the plot and ``best.yaml`` into ``<out_dir>/<sweep name>/``, record
them and the best trial on the parent run, print the table. Starting the same sweep (same
``out_dir`` and name) again resumes it; a finished one is only reported again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import sys
from pathlib import Path
from typing import Any

from qrag.config import ConfigError, flatten, to_dict
from qrag.distributed.job import USER_ERRORS
from qrag.distributed.options import SWEEP_DESCRIPTION, add_sweep_arguments
from qrag.distributed.preflight import base_directory, check_distributed, preflight, resolve_paths, worker_env
from qrag.distributed.sweep.results import TrialOutcome, write_report
from qrag.distributed.loopback import keep_ray_on_loopback
from qrag.distributed.sweep.spec import Sweep, load_sweep
from qrag.integrations.tracking import is_uri, tracking_uri
from qrag.distributed.train import cpu_need, learner_resources

STATE_FILE = "sweep.json"


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=SWEEP_DESCRIPTION)
    add_sweep_arguments(p)
    return p


def parse(argv: list[str], prog: str = "sweep") -> argparse.Namespace:
    parser = build_parser(prog)
    # key=value overrides may come before or after the options (argparse stops at the first option).
    args, extra = parser.parse_known_args(argv)
    if extra:
        if any(a.startswith("-") or "=" not in a for a in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


def check(args: argparse.Namespace) -> Sweep:
    """The sweep of parsed arguments, checked before anything starts; raises one of
    ``USER_ERRORS`` with a one-line message."""
    sweep = load_sweep(
        args.config, args.overrides, name=args.name, trials=args.trials, max_concurrent=args.max_concurrent
    )
    address = args.address or os.environ.get("RAY_ADDRESS") or None
    sweep.base = resolve_paths(
        sweep.base, base_directory(args.base_dir, cluster=address is not None and not args.local)
    )
    if is_uri(sweep.base.out_dir):
        raise ConfigError(
            f"out_dir {sweep.base.out_dir} is a URI: a sweep keeps its scheduler state, table and plot in "
            "out_dir, so give it a local or shared (e.g. NFS) directory"
        )
    if args.local:  # no tracking without Ray: do not ask for MLflow
        sweep.base = dataclasses.replace(
            sweep.base, distributed=dataclasses.replace(sweep.base.distributed, mlflow_uri="none")
        )
    preflight(sweep.base)
    check_distributed(first_trial_config(sweep))
    return sweep


def first_trial_config(sweep: Sweep):
    """The config of a trial with the first value of every dimension (for resource checks)."""
    return sweep.trial_config({d.key: d.probe_values()[0] for d in sweep.dims}, f"{sweep.name}-probe", None)


def _say(text: str) -> None:
    print(f"sweep: {text}", file=sys.stderr, flush=True)


# -- the sweep directory's record of what it runs --------------------------------------------


def _identity(sweep: Sweep) -> dict[str, Any]:
    """What must not change when a sweep is resumed: its space, draws, scheduler and the
    training config of its trials (resources may, and where the sweep lives is its identity)."""
    summary = sweep.summary()
    base = {
        k: v
        for k, v in flatten(to_dict(sweep.base)).items()
        if not k.startswith("distributed.") and k not in ("name", "out_dir")
    }
    return {
        "space": summary["space"],
        "trials": summary["trials"],
        "seed": summary["seed"],
        "scheduler": summary["scheduler"],
        "training": base,
    }


def check_same_sweep(sweep: Sweep, resuming: bool) -> None:
    """Refuse to resume a sweep with other settings (Tune would silently keep the old ones)."""
    path = Path(sweep.sweep_dir()) / STATE_FILE
    now = json.loads(json.dumps(_identity(sweep), default=str))
    if resuming and path.is_file():
        before = json.loads(path.read_text())
        diffs = [
            k for k in sorted(set(flatten(before)) | set(flatten(now))) if flatten(before).get(k) != flatten(now).get(k)
        ]
        if diffs:
            shown = ", ".join(f"{k}: {flatten(before).get(k)!r} -> {flatten(now).get(k)!r}" for k in diffs[:3])
            raise ConfigError(
                f"sweep {sweep.name!r} in {sweep.sweep_dir()} was started with other settings ({shown}); "
                "resume it unchanged or choose a new --name"
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(now, indent=1))


# -- Ray --------------------------------------------------------------------------------------


def connect(sweep: Sweep, address: str | None) -> bool:
    """Connect to the cluster, or start a local one on 127.0.0.1 big enough for the concurrent
    trials; True if this call started it. Ships this copy of qrag to every worker."""
    import ray

    from qrag.distributed.job import _runtime_env, join_cluster

    env = worker_env()
    # Every process of the sweep gets the cluster's address: Ray Train's placement-group cleaner
    # looks the cluster up through the state API, and with no RAY_ADDRESS it guesses, which fails
    # (or finds another cluster) when several Ray instances run on one host. Without the cleaner a
    # stopped trial's learner resources are never freed and the next trial waits forever.
    if address:
        if ":" in address and "://" not in address:
            env.setdefault("RAY_ADDRESS", address)
        join_cluster(address, env)
        return False
    port = _free_port()
    env["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    per_trial = cpu_need(first_trial_config(sweep)) + sweep.spec.resources.trial_cpus
    concurrent = sweep.spec.max_concurrent or 1
    saved = os.environ.get("RAY_GCS_SERVER_PORT")
    os.environ["RAY_GCS_SERVER_PORT"] = str(port)  # the local head's GCS port (read when Ray starts it)
    try:
        keep_ray_on_loopback()
        ray.init(
            address="local",
            _node_ip_address="127.0.0.1",
            dashboard_host="127.0.0.1",
            logging_level="WARNING",
            num_cpus=max(os.cpu_count() or 1, math.ceil(per_trial * concurrent)),
            runtime_env=_runtime_env(env),
        )
    finally:
        if saved is None:
            os.environ.pop("RAY_GCS_SERVER_PORT", None)
        else:
            os.environ["RAY_GCS_SERVER_PORT"] = saved
    return True


def require_state_api(sweep: Sweep) -> None:
    """Fail at once, not hours later, where Ray's state API does not answer.

    Ray Train frees the resources of a trial that the scheduler stops through a placement-group
    cleaner that asks the state API (the dashboard) whether the trial's controller still lives.
    Without it (``ray`` installed without ``[default]``, or the dashboard not started) every
    stopped trial keeps its GPU share and the next trials wait for workers until they time out
    (seen on a GPU machine with a bare ``ray`` wheel: the first trials ran, the rest hung).
    A sweep where nothing is stopped early does not need it.
    """
    if sweep.spec.scheduler.type == "none" or sweep.total_trials() <= (sweep.spec.max_concurrent or 1):
        return
    try:
        from ray.util.state import list_actors

        list_actors(limit=1, raise_on_missing_output=False, timeout=20)
    except Exception as exc:  # noqa: BLE001 - any failure means the cleaner cannot work either
        raise ConfigError(
            f"Ray's state API does not answer ({type(exc).__name__}: {str(exc)[:200]}): "
            "trials that ASHA stops would keep "
            "their resources and later trials would wait for workers until they time out. Install ray[default] (the "
            "dashboard serves the state API) and start the cluster with its dashboard, or set max_concurrent to the "
            "number of trials"
        ) from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_ray(sweep: Sweep, address: str | None) -> tuple[list[TrialOutcome] | None, str | None, str | None]:
    """Run or resume the Tuner. (outcomes, or None if interrupted; MLflow URI; parent run id)."""
    import ray
    from ray import tune

    from qrag.distributed.sweep.tracking import mark_interrupted, open_parent, record_trials
    from qrag.distributed.sweep.ray_tune import (
        ASHA_STATE,
        TrialSetup,
        make_tuner,
        outcome_of,
        stopped_file,
        stopped_trials,
    )

    resuming = tune.Tuner.can_restore(sweep.tune_dir())
    check_same_sweep(sweep, resuming)
    if not resuming:
        Path(sweep.sweep_dir(), ASHA_STATE).unlink(missing_ok=True)  # left by a start that never got going
        Path(stopped_file(str(Path(sweep.sweep_dir(), ASHA_STATE)))).unlink(missing_ok=True)
    started = connect(sweep, address)
    try:
        cluster = ray.cluster_resources()
        try:
            learner_resources(first_trial_config(sweep), cluster)  # one trial must fit
        except ConfigError as exc:
            raise ConfigError(
                f"a trial does not fit the Ray cluster: {exc} (the sweep file's resources.* set each trial's "
                "distributed.* keys; resources.gpus: 0 trains on CPU)"
            ) from None
        if (
            started
        ):  # a cluster this process started from a bare `ray` may lack the dashboard; a joined one is the admin's
            require_state_api(sweep)
        _say(
            f"{'resuming' if resuming else 'starting'} {sweep.total_trials()} trials in {sweep.sweep_dir()} "
            f"(Ray: {cluster.get('CPU', 0):g} CPUs, {cluster.get('GPU', 0):g} GPUs)"
        )
        uri = tracking_uri(sweep.base)
        parent = open_parent(uri, sweep, resuming=resuming) if uri else None
        if parent:
            _say(f"MLflow parent run {parent} in {uri} (experiment {sweep.base.distributed.mlflow_experiment!r})")
        setup = TrialSetup(sweep, parent, uri)
        grid = make_tuner(setup, resuming).fit()
        stopped = stopped_trials(sweep)
        outcomes = [outcome_of(result, setup, stopped) for result in grid]
        # Interrupted (Ctrl-C / SIGUSR1): Tune returns early, with trials it never created or cut short.
        if len(outcomes) < sweep.total_trials() or any(o.status == "interrupted" for o in outcomes):
            if parent:
                mark_interrupted(uri, parent)
            return None, uri, parent
        if parent:
            record_trials(uri, parent, sweep, outcomes)
        return outcomes, uri, parent
    finally:
        if started:
            ray.shutdown()


# -- entry point ------------------------------------------------------------------------------


def finish(sweep: Sweep, outcomes: list[TrialOutcome], uri: str | None, parent: str | None) -> dict[str, Any]:
    """Table, CSV, plot and best config; the best trial on the MLflow parent run; a summary."""
    report = write_report(outcomes, sweep, Path(sweep.sweep_dir()))
    if parent:
        from qrag.distributed.sweep.tracking import record_sweep

        record_sweep(uri, parent, sweep, report, outcomes)
    print(report.table, flush=True)
    best = report.best
    summary = {
        "sweep_dir": sweep.sweep_dir(),
        "results_csv": str(report.csv),
        "plot": str(report.png) if report.png else None,
        "best_config": str(report.best_yaml) if report.best_yaml else None,
        "trials": {s: sum(o.status == s for o in outcomes) for s in ("completed", "stopped", "error")},
        "best": None
        if best is None
        else {
            "trial": best.trial_id,
            "params": best.params,
            "score": best.score(sweep.mode, sweep.score_scope),
            "metric": f"{sweep.score_scope} {sweep.metric}",
            "checkpoint": best.checkpoint,
            "mlflow_run_id": best.mlflow_run_id,
        },
        "mlflow_parent_run_id": parent,
        "tracking_uri": uri,
    }
    if report.best_yaml:
        _say(
            f"best config {report.best_yaml}: train it with `qrag train --config {report.best_yaml}` "
            f"or `qrag train --ray --config {report.best_yaml}`"
        )
    print(json.dumps(summary), flush=True)
    return summary


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """``tune/sweep.py``: parse, then :func:`run`."""
    prog = prog or Path(sys.argv[0]).name or "sweep"
    return run(parse(sys.argv[1:] if argv is None else argv, prog), prog)


def run(args: argparse.Namespace, prog: str) -> int:
    """0 when some trial completed, 2 on bad input (nothing started), 1 if every trial failed,
    130 when interrupted (start the same command again to resume)."""
    try:
        sweep = check(args)
        if args.local:
            from qrag.distributed.sweep.local import LocalSweep

            check_same_sweep(sweep, resuming=True)
            _say(f"{sweep.total_trials()} trials one after another in {sweep.sweep_dir()} (no Ray, no MLflow)")
            try:
                outcomes, uri, parent = LocalSweep(sweep).run()[0], None, None
            except KeyboardInterrupt:  # progress is saved after every evaluation
                outcomes, uri, parent = None, None, None
        else:
            outcomes, uri, parent = run_on_ray(sweep, args.address or os.environ.get("RAY_ADDRESS") or None)
    except USER_ERRORS as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - Tune's and Ray's own failures: say how to go on
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"{prog}: sweep failed: {type(exc).__name__}: {first}", file=sys.stderr)
        print(f"{prog}: start the same command again to resume it", file=sys.stderr)
        return 1
    if outcomes is None:
        _say(f"interrupted; start the same command again to resume the sweep in {sweep.sweep_dir()}")
        return 130
    finish(sweep, outcomes, uri, parent)
    return 0 if any(o.status == "completed" for o in outcomes) else 1
