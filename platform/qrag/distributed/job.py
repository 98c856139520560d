"""Training jobs: what ``qrag train --ray`` and ``jobs/train_*.py`` run, under ``ray job submit`` or plain ``python``.

    qrag train --ray [--config YAML] [key=value ...]                 # starts a local Ray on 127.0.0.1
    ray job submit --working-dir . -- \
        python jobs/train_hotpot.py [--config YAML] [key=value ...]   # runs in ~/ray_results/

Order of work: parse and validate everything on the driver (config, paths, encoder, data) and
stop with a one-line error (exit code 2) before Ray is touched; then connect to the cluster
(``--address``, else ``$RAY_ADDRESS``, else a new local one), train with ``train_with_ray`` and
print where the run, its checkpoints and its metrics are.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qrag.model.checkpoint import CheckpointError
from qrag.config import ConfigError, TrainConfig, load_config
from qrag.data import DataError
from qrag.model.encoder import ModelPathError
from qrag.distributed.options import add_cluster_arguments
from qrag.distributed.loopback import keep_ray_on_loopback
from qrag.distributed.preflight import base_directory, preflight, resolve_paths, worker_env
from qrag.distributed.train import cpu_need, finished_updates, storage_run_dir, train_with_ray
from qrag.integrations.tracking import tracking_uri

USER_ERRORS = (ConfigError, DataError, ModelPathError, CheckpointError)


@dataclass
class Job:
    cfg: TrainConfig
    address: str | None
    env: dict[str, str]
    prog: str

    @property
    def run_dir(self) -> str:
        return storage_run_dir(self.cfg.out_dir, self.cfg.name)

    def say(self, text: str) -> None:
        print(f"{self.prog}: {text}", flush=True)


def build_parser(default_config: str, prog: str) -> argparse.ArgumentParser:
    from qrag.config import config_keys_epilog

    p = argparse.ArgumentParser(
        prog=prog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=config_keys_epilog(),
        description="Train a Q-RAG retriever on Ray: EpisodeFeeder actors feed a Ray Train learner; "
        "MLflow tracks the run. "
        "Submitting the same run name again resumes it.",
    )
    p.add_argument("--config", default=default_config, metavar="YAML", help=f"config preset (default {default_config})")
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides, e.g. updates=200 distributed.runners=4"
    )
    add_cluster_arguments(p)
    return p


def prepare(argv: list[str], default_config: str, prog: str | None = None) -> Job:
    """Parse and validate; raises one of ``USER_ERRORS`` with a one-line message."""
    prog = prog or Path(sys.argv[0]).name or "qrag-job"
    args = build_parser(default_config, prog).parse_args(argv)
    return make_job(args.config, args.overrides, args.base_dir, args.address, prog)


def make_job(config: str | None, overrides: list[str], base_dir: str | None, address: str | None, prog: str) -> Job:
    """Validate a job's settings (``qrag train --ray`` parses its own); raises one of ``USER_ERRORS``."""
    # The preset is part of the project (uploaded with the working dir): relative to the cwd.
    address = address or os.environ.get("RAY_ADDRESS") or None
    cfg = resolve_paths(load_config(config, overrides), base_directory(base_dir, cluster=address is not None))
    preflight(cfg)
    return Job(cfg, address, worker_env(), prog)


def _runtime_env(env_vars: dict[str, str], job_env: dict[str, Any] | None = None) -> dict[str, Any]:
    """Ship this copy of qrag and the driver's data/encoder variables to every Ray process,
    leaving alone what the job's own runtime env (``ray job submit --runtime-env*``) sets:
    Ray refuses to merge two runtime envs that set the same field or variable."""
    import qrag

    job_env = job_env or {}
    taken = job_env.get("env_vars") or {}
    env: dict[str, Any] = {}
    ours = {k: v for k, v in env_vars.items() if k not in taken}
    if ours:
        env["env_vars"] = ours
    if not job_env.get("py_modules"):
        env["py_modules"] = [str(Path(qrag.__file__).resolve().parent)]
    return env


def join_cluster(address: str, env_vars: dict[str, str], ship_code: bool = True) -> None:
    """``ray.init`` on a running cluster with our runtime env added to the job's."""
    import ray

    if not ship_code:
        ray.init(address=address, logging_level="WARNING")
        return
    try:
        ray.init(address=address, runtime_env=_runtime_env(env_vars), logging_level="WARNING")
        return
    except ValueError as exc:
        if "runtime env" not in str(exc):
            raise
    # The job's own runtime env sets some of the same fields or variables. It is readable once
    # connected (public API): reconnect with the part of ours that does not clash.
    ray.init(address=address, logging_level="WARNING")
    extra = _runtime_env(env_vars, dict(ray.get_runtime_context().runtime_env or {}))
    if extra:
        ray.shutdown()
        ray.init(address=address, runtime_env=extra, logging_level="WARNING")


def connect(job: Job, ship_code: bool = True) -> bool:
    """Connect to the job's Ray cluster, or start a local one; True if this call started it.
    ``ship_code=False``: no runtime env (workers of a local Ray inherit this process's
    environment, ``PYTHONPATH`` included) for Ray installs without the runtime-env agent."""
    import ray

    runtime_env = _runtime_env(job.env) if ship_code else None
    if job.address:
        join_cluster(job.address, job.env, ship_code)
        return False
    keep_ray_on_loopback()
    ray.init(
        # The dashboard (when installed) serves the state API that Ray Train's clean-up actor polls.
        address="local",
        _node_ip_address="127.0.0.1",
        dashboard_host="127.0.0.1",
        logging_level="WARNING",
        # Logical CPUs: enough for the learner and every runner even on a small machine.
        num_cpus=max(os.cpu_count() or 1, math.ceil(cpu_need(job.cfg))),
        runtime_env=runtime_env,
    )
    return True


def launch(job: Job) -> dict[str, Any]:
    """Connect, train, print where everything is; the outcome as a dict (see ``run_job``)."""
    import ray

    cfg = job.cfg
    uri = tracking_uri(cfg)
    job.say(
        f"run {job.run_dir}  (checkpoints in checkpoints/update_*, final/; {cfg.updates} updates, "
        f"{cfg.distributed.runners} EpisodeFeeders)"
    )
    job.say(f"MLflow {uri or 'off'}" + (f"  (experiment {cfg.distributed.mlflow_experiment!r})" if uri else ""))
    started = connect(job)
    try:
        job.say(
            f"Ray {'started locally on 127.0.0.1' if started else 'at ' + job.address}: "
            f"{ray.cluster_resources().get('CPU', 0):g} CPUs, "
            f"{ray.cluster_resources().get('GPU', 0):g} GPUs"
        )
        result = train_with_ray(cfg)
    finally:
        if started:
            ray.shutdown()
    out = result.return_value or {}
    ev = out.get("eval") or {}  # the final evaluation on dev
    summary = {
        "run_dir": job.run_dir,
        "checkpoint": out.get("checkpoint", f"{job.run_dir}/final"),  # best/ with keep_best
        "updates": out.get("updates"),
        "fact_em": ev.get("fact_em"),
        "fact_f1": ev.get("fact_f1"),
        "eval_questions": ev.get("num_samples"),
        "runner_wait_share": out.get("runner_wait_share"),
        "seconds": out.get("seconds"),
        "total_seconds": out.get("total_seconds"),
    }
    if result.mlflow:
        summary.update(mlflow_run_id=result.mlflow.run_id, tracking_uri=result.mlflow.tracking_uri)
        job.say(
            f"MLflow run {result.mlflow.run_id} in {result.mlflow.tracking_uri}; "
            "UI (needs the full `mlflow` package): "
            f"mlflow ui --backend-store-uri {result.mlflow.tracking_uri} --host 127.0.0.1"
        )
    job.say(f"checkpoint {summary['checkpoint']} (evaluate it: qrag eval --checkpoint {summary['checkpoint']})")
    print(json.dumps(summary), flush=True)
    return summary


def run_job(argv: list[str], default_config: str) -> int:
    """The whole job of a ``jobs/train_*.py`` script (see :func:`run`)."""
    prog = Path(sys.argv[0]).name or "qrag-job"
    return run(lambda: prepare(argv, default_config, prog), prog)


def run(make: Callable[[], Job], prog: str) -> int:
    """Validate (``make``), train, report; 0 on success, 2 on bad input (before any actor
    starts), 1 if training failed."""
    try:
        job = make()
    except USER_ERRORS as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    done = finished_updates(job.run_dir)
    if done is not None and done >= job.cfg.updates:
        job.say(f"run {job.run_dir} already finished ({done} updates); its final checkpoint: {job.run_dir}/final")
        return 0
    try:
        launch(job)
    except USER_ERRORS as exc:  # the cluster cannot hold the run, or its MLflow run disagrees
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - Ray Train's TrainingFailedError and friends
        print(
            f"{prog}: training failed: {type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
            file=sys.stderr,
        )
        print(
            f"{prog}: submit the same command again to resume from the last checkpoint in {job.run_dir}",
            file=sys.stderr,
        )
        return 1
    return 0
