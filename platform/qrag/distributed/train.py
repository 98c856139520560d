"""The learner under Ray Train: one ``TorchTrainer`` worker runs ``qrag.rl.train.TrainingRun``.

The worker runs the same ``TrainingRun.run()`` as ``qrag train``; only three things differ:

* episodes come from a ``FeederPool`` of EpisodeFeeder actors (or, with ``distributed.runners=0``,
  from the worker's own copy of the training split);
* checkpoints are written to a scratch directory and reported to Ray Train, which persists them
  in ``<storage>/<run name>/`` with the layout ``qrag train`` uses (``checkpoints/update_N``,
  ``final``) and hands the latest back through ``ray.train.get_checkpoint()`` after a crash or
  when the same run is submitted again;
* metrics go to MLflow (``qrag.integrations.tracking``) by update, and evaluations and checkpoints
  to ``ray.train.report`` (what Ray Tune sees when a sweep wraps this trainer).

``train_with_ray`` is the entry point of both ``jobs/`` and the Tune sweep.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qrag.config import ConfigError, TrainConfig
from qrag.data.prepared import prepare_split
from qrag.model.encoder import load_tokenizer, resolve_encoder
from qrag.data.tokens import TokenizedSample, TokenLayout
from qrag.rl.train import EpisodeSource, TrainingRun
from qrag.distributed.faults import FaultPlan
from qrag.distributed.placement import check_cluster_has, cluster_capacity, learner_worker_resources
from qrag.integrations.tracking import is_uri

EVAL_FILES = ("eval.json", "eval.records.jsonl")


def _say(text: str) -> None:
    """One line to the job log (Ray Train's print patch would print it twice)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def cpu_need(cfg: TrainConfig) -> float:
    """Logical CPUs the run reserves: the learner's and every runner's."""
    d = cfg.distributed
    return d.learner_cpus + d.runners * d.runner_cpus


def learner_resources(cfg: TrainConfig, cluster: dict[str, float]) -> tuple[bool, dict[str, float]]:
    """(use a GPU?, resources of the learner worker); an error when the cluster, grown as far as
    its autoscaler may (``placement.cluster_capacity``), cannot hold the run."""
    d = cfg.distributed
    cluster = cluster_capacity(cfg, cluster)
    gpus = cluster.get("GPU", 0.0)
    use_gpu = d.learner_gpu if d.learner_gpu is not None else gpus >= 1
    if use_gpu and gpus < 1:
        raise ConfigError("distributed.learner_gpu is true but the Ray cluster has no GPU")
    need = cpu_need(cfg)
    have = cluster.get("CPU", 0.0)
    if need > have + 1e-9:
        raise ConfigError(
            f"the run needs {need:g} CPUs (learner {d.learner_cpus:g} + {d.runners} runners x {d.runner_cpus:g}) "
            f"but the Ray cluster has {have:g}: lower distributed.runners or distributed.runner_cpus, "
            "or give Ray more CPUs "
            "(an autoscaling cluster: state its maximum in distributed.autoscale_to or $QRAG_AUTOSCALE_TO)"
        )
    check_cluster_has(cfg, cluster)  # custom resources (qrag.distributed.placement)
    return use_gpu, learner_worker_resources(cfg, use_gpu)


def storage_run_dir(storage_path: str, run_name: str) -> str:
    return f"{storage_path.rstrip('/')}/{run_name}"


# Our own marker that Ray Train has committed a checkpoint of the run (written by the learner
# after ``get_all_reported_checkpoints(COMMITTED)``), so the driver need not read Ray's files.
COMMITTED_MARKER = ".qrag/checkpoint_committed"


def _storage(run_dir: str):
    from pyarrow.fs import FileSystem

    return FileSystem.from_uri(run_dir if is_uri(run_dir) else os.path.abspath(run_dir))


def has_checkpoint(run_dir: str) -> bool:
    """Whether Ray Train will resume the run at ``run_dir`` from a checkpoint."""
    from pyarrow.fs import FileType

    fs, path = _storage(run_dir)
    return fs.get_file_info(f"{path}/{COMMITTED_MARKER}").type == FileType.File


def mark_committed(run_dir: str, update: int) -> None:
    fs, path = _storage(run_dir)
    fs.create_dir(f"{path}/{os.path.dirname(COMMITTED_MARKER)}", recursive=True)
    with fs.open_output_stream(f"{path}/{COMMITTED_MARKER}") as out:
        out.write(json.dumps({"update": update}).encode())


def finished_updates(run_dir: str) -> int | None:
    """Updates in the run's final checkpoint, if the run (in local storage) has one."""
    state = Path(run_dir) / "final" / "trainer" / "state.json"
    if is_uri(run_dir) or not state.is_file():
        return None
    return int(json.loads(state.read_text())["learner"]["update"])


# -- inside the Ray Train worker -------------------------------------------------------------


class _Feed:
    """The episode source as the learner sees it: timed, with the fault hooks in front."""

    def __init__(self, source: EpisodeSource, run: TrainingRun, faults: FaultPlan):
        self.source, self.run, self.faults = source, run, faults
        self.wait_s = 0.0
        self.started = time.perf_counter()

    def next_batch(self) -> list[TokenizedSample]:
        self.faults.before_update(self.run.learner.update)
        t0 = time.perf_counter()
        batch = self.source.next_batch()
        self.wait_s += time.perf_counter() - t0
        return batch

    @property
    def wait_share(self) -> float:
        return self.wait_s / max(1e-9, time.perf_counter() - self.started)


class _WorkerRun(TrainingRun):
    """A TrainingRun that writes into a scratch directory: Ray Train persists what is reported."""

    def __init__(self, cfg: TrainConfig, scratch: Path, **kwargs: Any):
        self._scratch = scratch
        super().__init__(cfg, **kwargs)

    @property
    def run_dir(self) -> Path:
        return self._scratch


class _Reporter:
    """Metrics to stdout and MLflow; evaluations and checkpoints to Ray Train."""

    def __init__(self, cfg: TrainConfig, run: _WorkerRun, run_dir: str, feed: _Feed, logger, pool):
        self.cfg, self.run, self.run_dir, self.feed, self.logger, self.pool = cfg, run, run_dir, feed, logger, pool

    def _checkpoint_follows(self, update: int) -> bool:
        """A periodic checkpoint follows this report (``TrainingRun.run``'s rule) and carries its metrics."""
        every = self.cfg.checkpoint_every
        return bool(every) and update % every == 0 and update < self.cfg.updates

    def __call__(self, update: int, metrics: dict[str, float]) -> None:
        import ray.train

        metrics = {**metrics, "perf/runner_wait_share": self.feed.wait_share}
        if self.pool is not None:
            metrics["perf/runner_requests_lost"] = float(self.pool.lost)
            metrics["perf/runner_restarts"] = float(self.pool.restarts)
        _say(
            json.dumps(
                {"update": update, **{k: round(v, 6) if isinstance(v, float) else v for k, v in metrics.items()}}
            )
        )
        if self.logger is not None:
            self.logger.log(update, metrics)
        # A checkpoint report right after carries these metrics: report an evaluation only once.
        if any(k.startswith("eval/") for k in metrics) and not self._checkpoint_follows(update):
            ray.train.report({"update": update, **metrics})

    def _keep_eval_files(self, final: Path) -> None:
        """The final eval files travel inside final/, naming checkpoints by their storage path."""
        scratch = str(self.run.run_dir)
        for file in EVAL_FILES:
            src = self.run.run_dir / file
            if src.is_file():
                (final / file).write_text(src.read_text().replace(scratch, self.run_dir))

    def checkpoint(self, path: Path, metrics: dict[str, float]) -> None:
        import ray.train
        from pyarrow.fs import copy_files
        from ray.train import Checkpoint, CheckpointConsistencyMode

        name = path.relative_to(self.run.run_dir).as_posix()
        if name == "best":
            # keep_best: an inference-only checkpoint, not one to resume from. Stored as soon as it
            # is chosen, so that a restarted learner (whose selection key comes back with its
            # checkpoint) still has it.
            copy_files(str(path), f"{self.run_dir}/best")
            return
        if name == "final":
            self._keep_eval_files(path)
        ray.train.report(
            {"update": self.run.learner.update, **metrics},
            checkpoint=Checkpoint.from_directory(str(path)),
            checkpoint_dir_name=name,
            delete_local_checkpoint_after_upload=True,
        )
        # A report is only a request: wait until Ray Train has committed the checkpoint, so that
        # a crash from here on restarts from it (and not from the one before).
        ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)
        mark_committed(self.run_dir, self.run.learner.update)


def _load_eval_splits(run: TrainingRun, cfg: TrainConfig) -> None:
    """What the learner evaluates on: dev and the validation part of train (the runners hold
    the rest of train). Same split rule as ``TrainingRun.load_data``."""
    d = cfg.data
    if d.val_fraction > 0:
        val = prepare_split(d, "train", run.tokenizer, run.layout).split_validation(d.val_fraction)[1]
        run.val_samples, run.val_tok = val.samples(), val.tokenized()
    dev = prepare_split(d, "dev", run.tokenizer, run.layout)
    run.dev_samples, run.dev_tok = dev.samples(), dev.tokenized()


def _restore_best(run_dir: str, scratch: Path) -> None:
    """The best checkpoint chosen before a restart, back where ``TrainingRun`` keeps it."""
    from pyarrow.fs import FileType, copy_files

    fs, path = _storage(run_dir)
    if fs.get_file_info(f"{path}/best").type == FileType.Directory:
        copy_files(f"{run_dir}/best", str(scratch / "best"))


def train_loop(config: dict[str, Any]) -> dict[str, Any]:
    """The Ray Train worker: the learner."""
    import ray.train

    from qrag.distributed.source import FeederPool

    cfg: TrainConfig = config["cfg"]
    run_dir: str = config["run_dir"]
    d = cfg.distributed
    torch.set_num_threads(max(1, int(d.learner_cpus)))
    logger = None
    if config.get("mlflow_run_id"):
        from qrag.integrations.tracking import MetricLogger

        logger = MetricLogger(config["mlflow_uri"], config["mlflow_run_id"])
    # Ray Train runs the worker in a directory of Ray's session: what a crash leaves there goes
    # away with the session.
    scratch = Path(tempfile.mkdtemp(prefix="scratch-", dir=os.getcwd()))
    pool = None
    try:
        tokenizer_path = resolve_encoder(cfg.model.encoder)
        layout = TokenLayout.from_tokenizer(load_tokenizer(tokenizer_path), cfg.model.max_state_tokens)
        faults = FaultPlan(cfg, run_dir)
        if d.runners:
            pool = FeederPool(cfg, tokenizer_path, layout, faults)  # the feeders load their shards meanwhile
        checkpoint = ray.train.get_checkpoint()
        with checkpoint.as_directory() if checkpoint else nullcontext(None) as resume:
            run = _WorkerRun(cfg, scratch, resume=resume, load_data=pool is None)
        if checkpoint is not None:
            _restore_best(run_dir, scratch)
        if run.layout != layout:
            raise ValueError(
                f"the checkpoint's tokenizer gives {run.layout}, the runners use {layout} ({tokenizer_path})"
            )
        if pool is not None:
            _load_eval_splits(run, cfg)
            t0 = time.perf_counter()
            pool.start(run.learner.update)
            _say(
                f"learner: {d.runners} EpisodeFeeders ready "
                f"({sum(i['samples'] for i in pool.infos)} training questions, "
                f"waited {time.perf_counter() - t0:.1f} s), {len(run.dev_tok)} dev questions, device {run.device}, "
                f"from update {run.learner.update}"
            )
        source = pool if pool is not None else run.local_source()
        feed = _Feed(source, run, faults)
        reporter = _Reporter(cfg, run, run_dir, feed, logger, pool)
        out = run.run(source=feed, report=reporter, on_checkpoint=reporter.checkpoint)
        in_storage = {
            key: f"{run_dir}/{Path(out[key]).relative_to(scratch).as_posix()}"
            for key in ("checkpoint", "final_checkpoint")
            if key in out
        }
        return {
            **out,
            **in_storage,
            "run_dir": run_dir,
            "runner_wait_s": feed.wait_s,
            "runner_wait_share": feed.wait_share,
            "runner_requests_lost": pool.lost if pool is not None else 0,
            "runner_restarts": pool.restarts if pool is not None else 0,
            # Per update, for throughput figures (bench/train_throughput.py).
            "update_seconds": [h["perf/update_s"] for h in run.history],
            "wait_seconds": [h["perf/runner_wait_s"] for h in run.history],
        }
    finally:
        if pool is not None:
            pool.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)


# -- on the driver ----------------------------------------------------------------------------


@dataclass(frozen=True)
class MlflowRun:
    tracking_uri: str
    run_id: str
    experiment: str


@dataclass(frozen=True)
class RayTrainRun:
    """What ``train_with_ray`` returns: Ray Train's result and the run's MLflow run."""

    result: Any  # ray.train.Result
    mlflow: MlflowRun | None

    @property
    def return_value(self) -> dict[str, Any] | None:
        return self.result.return_value

    @property
    def checkpoint(self):
        return self.result.checkpoint


def train_with_ray(
    cfg: TrainConfig,
    *,
    storage_path: str | None = None,
    run_name: str | None = None,
    parent_run_id: str | None = None,
    callbacks: list | tuple = (),
    tracking: bool = True,
):
    """Train ``cfg`` on the connected Ray cluster; returns the ``ray.train.Result``.

    ``storage_path`` (default ``cfg.out_dir``, absolute or a URI) and ``run_name`` (default
    ``cfg.name``) locate the run: a second call with the same pair resumes it from its latest
    checkpoint, and its MLflow run too. ``parent_run_id`` nests the MLflow run under a parent
    (a Tune sweep's); ``callbacks`` are Ray Train ``UserCallback``s (e.g. Tune's report callback).
    Raises ``ConfigError`` before anything starts when the cluster cannot hold the run.
    Returns a ``RayTrainRun``: ``.result`` is Ray Train's ``Result`` (``.return_value`` and
    ``.checkpoint`` are forwarded), ``.mlflow`` the ``MlflowRun`` (None without tracking).
    """
    import ray
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    storage_path = storage_path or cfg.out_dir
    run_name = run_name or cfg.name
    if not is_uri(storage_path) and not os.path.isabs(storage_path):
        raise ConfigError(f"storage path {storage_path!r} must be absolute or a URI (workers run in other directories)")
    run_dir = storage_run_dir(storage_path, run_name)
    d = cfg.distributed
    use_gpu, resources = learner_resources(cfg, ray.cluster_resources())

    uri = run_id = None
    if tracking:
        from qrag.integrations.tracking import finish_run, log_final_checkpoint, open_run, tracking_uri

        uri = tracking_uri(cfg)
        if uri:
            run_id = open_run(
                cfg, uri, run_dir, run_name, resuming=has_checkpoint(run_dir), parent_run_id=parent_run_id
            )
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"cfg": cfg, "run_dir": run_dir, "mlflow_uri": uri, "mlflow_run_id": run_id},
        scaling_config=ScalingConfig(num_workers=1, use_gpu=use_gpu, resources_per_worker=resources),
        run_config=RunConfig(
            name=run_name,
            storage_path=storage_path,
            failure_config=FailureConfig(max_failures=d.max_failures),
            # +1: the final checkpoint counts too.
            checkpoint_config=CheckpointConfig(
                num_to_keep=None if d.checkpoints_to_keep is None else d.checkpoints_to_keep + 1
            ),
            callbacks=list(callbacks),
            logging_config=LoggingConfig(log_level="WARNING"),
        ),
    )
    try:
        result = trainer.fit()
    except BaseException:
        if run_id:
            finish_run(uri, run_id, "FAILED")
        raise
    if run_id:
        reported = (result.return_value or {}).get("checkpoint", f"{run_dir}/final")
        if result.checkpoint is not None:
            with result.checkpoint.as_directory() as final:
                # keep_best reports <run>/best; it sits beside final/ in local storage.
                chosen = Path(reported) if not is_uri(reported) and Path(reported).is_dir() else Path(final)
                log_final_checkpoint(uri, run_id, Path(final), chosen, d.mlflow_checkpoint, cfg)
        finish_run(uri, run_id, "FINISHED", {"qrag.checkpoint": reported})
    return RayTrainRun(result, MlflowRun(uri, run_id, d.mlflow_experiment) if run_id else None)
