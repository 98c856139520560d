"""MLflow tracking of training runs, for ``qrag train`` and the Ray path alike (mlflow-skinny is
enough; nothing here imports Ray, and mlflow is imported only when tracking is on).

* One MLflow run per training run, found again by its storage location (tag ``qrag.run_dir``):
  re-submitting a run resumes the same MLflow run instead of starting a new one.
* Params: the flattened resolved config. A resumed run must not change them (MLflow could not
  record the change), except the ``distributed.*`` ones, which only say how the run is executed.
* Metrics are logged by the learner with ``step = update``. After a restart from a checkpoint the
  learner repeats the updates since that checkpoint; a metric is logged only for steps past the
  last one MLflow already holds for it, so the history has no duplicated and no missing updates.
* Artifacts: the resolved config, the final eval JSON, the final checkpoint and, with
  ``distributed.mlflow_model``, the reported checkpoint as a pyfunc model (``model/``,
  ``qrag.integrations.mlflow_model``), registered under ``distributed.mlflow_registered_model`` when set.
* Provenance: the git commit (``mlflow.source.git.commit``, where there is a checkout or
  ``$QRAG_COMMIT``), a digest of qrag's sources (``qrag.source_sha256``) and the data as dataset
  inputs.
* Default store: ``sqlite:///<out_dir>/mlflow.db`` with artifacts in ``<out_dir>/mlruns``;
  ``distributed.mlflow_uri`` or ``$MLFLOW_TRACKING_URI`` point elsewhere; ``none`` switches it off.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from qrag.config import ConfigError, TrainConfig, flatten, to_dict
from qrag.file_lock import file_lock

RUN_KEY_TAG = "qrag.run_key"
PARENT_TAG = "mlflow.parentRunId"
GIT_COMMIT_TAG = "mlflow.source.git.commit"
SOURCE_TAG = "qrag.source_sha256"


def is_uri(path: str) -> bool:
    return "://" in path


def tracking_uri(cfg: TrainConfig) -> str | None:
    """The MLflow store of this run, or None when tracking is off."""
    uri = cfg.distributed.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri is None:
        if is_uri(cfg.out_dir):
            raise ConfigError(
                f"out_dir {cfg.out_dir} is a URI: set distributed.mlflow_uri or $MLFLOW_TRACKING_URI "
                "(the default SQLite store lives in a local out_dir)"
            )
        uri = f"sqlite:///{Path(cfg.out_dir).resolve() / 'mlflow.db'}"
    return None if uri.strip().lower() == "none" else uri


def _artifact_root(uri: str) -> str | None:
    """Artifacts of a SQLite store go beside the database (MLflow would use the cwd)."""
    if uri.startswith("sqlite:///"):
        return str(Path(uri[len("sqlite:///") :]).parent / "mlruns")
    return None


def client_for(uri: str):
    """An ``MlflowClient`` (mlflow is imported here: tracking-free runs do not need it)."""
    from mlflow import MlflowClient

    if not uri.startswith("sqlite:///"):
        return MlflowClient(tracking_uri=uri)
    db = Path(uri[len("sqlite:///") :])
    db.parent.mkdir(parents=True, exist_ok=True)
    # Runs started together on one out_dir (seeds side by side) would each create the new
    # database's tables and all but one fail ("table ... already exists"): one at a time.
    with file_lock(db.with_name(db.name + ".lock")):
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)  # builds (or migrates) the schema
    return client


def _experiment_id(client, name: str, uri: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=_artifact_root(uri))
    except Exception:  # created by a concurrent run (a Tune sweep starts many at once)
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def config_params(cfg: TrainConfig) -> dict[str, str]:
    return {key: str(value) for key, value in flatten(to_dict(cfg)).items()}


def open_run(
    cfg: TrainConfig, uri: str, run_dir: str, run_name: str, *, resuming: bool, parent_run_id: str | None = None
) -> str:
    """The MLflow run of the training run stored at ``run_dir``: the existing one when
    ``resuming`` from a checkpoint there, else a new one. Logs params and the config; its id."""
    from mlflow.entities import Param

    client = client_for(uri)
    exp = _experiment_id(client, cfg.distributed.mlflow_experiment, uri)
    key = hashlib.sha1(run_dir.encode()).hexdigest()[:20]  # quote-free, whatever the path holds
    found = client.search_runs([exp], filter_string=f"tags.`{RUN_KEY_TAG}` = '{key}'", max_results=1)
    if found and not resuming:
        # The storage was cleared: training starts over, and so does its history.
        client.set_tag(found[0].info.run_id, RUN_KEY_TAG, f"{key}-superseded")
        found = []
    params = config_params(cfg)
    if found:
        run = found[0]
        logged = run.data.params
        changed = sorted(
            k for k in params if k in logged and logged[k] != params[k] and not k.startswith("distributed.")
        )
        if changed:
            shown = ", ".join(f"{k}: {logged[k]} -> {params[k]}" for k in changed[:3])
            raise ConfigError(
                f"run {run_name!r} already exists in {run_dir} with other settings ({shown}); "
                "resume it unchanged or choose a new name="
            )
        run_id = run.info.run_id
        params = {k: v for k, v in params.items() if k not in logged}
        client.update_run(run_id, status="RUNNING")
        client.set_tag(run_id, "qrag.resumed", str(int(run.data.tags.get("qrag.resumed", "0")) + 1))
    else:
        tags = {RUN_KEY_TAG: key, "qrag.run_dir": run_dir}
        if parent_run_id:
            tags[PARENT_TAG] = parent_run_id
        run_id = client.create_run(exp, run_name=run_name, tags=tags).info.run_id
    items = [Param(k, v) for k, v in params.items()]
    for i in range(0, len(items), 100):  # MLflow takes at most 100 params per call
        client.log_batch(run_id, params=items[i : i + 100])
    client.log_text(run_id, yaml.safe_dump(to_dict(cfg), sort_keys=False), "config.yaml")
    log_provenance(client, run_id, cfg)
    return run_id


def data_sources(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(name, source) of every dataset the run reads: a hub name, a path, or the loader's default."""
    d = cfg.data
    entries = (
        d.sources
        if d.dataset == "mixed" and getattr(d, "sources", None)
        else [{"dataset": d.dataset, "path": d.path, "hub": getattr(d, "hub", None)}]
    )
    out = []
    for e in entries:
        name = str(e.get("dataset", d.dataset))
        source = e.get("hub") and f"hf://{e['hub']}" or e.get("path") or f"{name} (the loader's default file)"
        out.append((name, str(source)))
    return out


def source_digest() -> str:
    """sha256 of qrag's Python sources (paths and contents), first 16 hex digits."""
    root = Path(__file__).resolve().parents[1]  # the qrag package
    digest = hashlib.sha256()
    for file in sorted(root.rglob("*.py")):
        digest.update(file.relative_to(root).as_posix().encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:16]


def log_provenance(client, run_id: str, cfg: TrainConfig) -> None:
    """The git commit and the data (as MLflow dataset inputs: name, source, a digest of the
    source and the chunking settings)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    from qrag import __version__
    from qrag.integrations.provenance import git_commit

    commit = git_commit()
    if commit:
        client.set_tag(run_id, GIT_COMMIT_TAG, commit)
    # A `ray job submit` driver runs in a copy without .git ($QRAG_COMMIT names the commit there):
    # the digest of the library's sources identifies the code whatever the checkout.
    client.set_tag(run_id, SOURCE_TAG, source_digest())
    client.set_tag(run_id, "qrag.version", __version__)
    d = cfg.data
    inputs = []
    for name, source in data_sources(cfg):
        digest = hashlib.sha1(
            f"{source}|{d.chunk_tokens}|{d.question_tokens}|{d.dev_fraction}|{d.limit}".encode()
        ).hexdigest()[:12]
        kind = "hf" if source.startswith("hf://") else "local"
        dataset = Dataset(name=name, digest=digest, source_type=kind, source=json.dumps({"uri": source}))
        inputs.append(DatasetInput(dataset, tags=[InputTag("mlflow.data.context", "train")]))
    try:
        client.log_inputs(run_id, datasets=inputs)
    except Exception:  # noqa: BLE001 - an old server without dataset support: keep the run
        client.set_tag(run_id, "qrag.data", "; ".join(f"{n}={s}" for n, s in data_sources(cfg)))


def finish_run(uri: str, run_id: str, status: str = "FINISHED", tags: dict[str, str] | None = None) -> None:
    from mlflow.entities import RunTag

    client = client_for(uri)
    if tags:
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    client.set_terminated(run_id, status)


def log_final_checkpoint(
    uri: str, run_id: str, final: Path, checkpoint: Path, mode: str, cfg: TrainConfig | None = None
) -> None:
    """The final eval files (kept in ``final``), ``checkpoint`` (``mode``: inference | full | none)
    and, per ``cfg.distributed``, its inference part as a pyfunc model, registered under a name
    and alias."""
    client = client_for(uri)
    d = cfg.distributed if cfg is not None else None
    if d is not None and d.mlflow_model:
        from qrag.integrations.mlflow_model import log_model, register

        log_model(client, run_id, checkpoint)
        if d.mlflow_registered_model:
            version = register(client, run_id, d.mlflow_registered_model, d.mlflow_model_alias)
            client.set_tag(run_id, "qrag.registered_model", f"{d.mlflow_registered_model}/{version}")
    for name in ("eval.json", "eval.records.jsonl"):
        if (final / name).is_file():
            client.log_artifact(run_id, str(final / name))
    if mode == "full":
        client.log_artifacts(run_id, str(checkpoint), "checkpoint")
    elif mode == "inference":
        from qrag.model.checkpoint import INFERENCE_PARTS  # torch only where a checkpoint is logged

        for name in INFERENCE_PARTS:
            part = checkpoint / name
            if part.is_dir():
                client.log_artifacts(run_id, str(part), f"checkpoint/{name}")
            elif part.is_file():
                client.log_artifact(run_id, str(part), "checkpoint")


class MetricLogger:
    """Logs metrics by update, skipping updates MLflow already has (see the module doc)."""

    def __init__(self, uri: str, run_id: str):
        self.client, self.run_id = client_for(uri), run_id
        data = self.client.get_run(run_id).data
        self.last_step: dict[str, int] = {
            key: max((m.step for m in self.client.get_metric_history(run_id, key)), default=-1) for key in data.metrics
        }

    def log(self, step: int, metrics: dict[str, Any]) -> int:
        """Log the numeric ``metrics`` at ``step``; returns how many were new."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        fresh = [
            Metric(key, float(value), now, step)
            for key, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and step > self.last_step.get(key, -1)
        ]
        if fresh:
            self.client.log_batch(self.run_id, metrics=fresh)
            for m in fresh:
                self.last_step[m.key] = step
        return len(fresh)


class RunTracker:
    """MLflow for ``qrag train`` (no Ray): the run opened and closed around ``TrainingRun.run()``,
    whose ``report`` callback it wraps. A do-nothing tracker when tracking is off."""

    def __init__(self, cfg: TrainConfig, uri: str | None, run_id: str | None):
        self.cfg, self.uri, self.run_id = cfg, uri, run_id
        self.metrics = MetricLogger(uri, run_id) if uri and run_id else None

    @classmethod
    def open(cls, cfg: TrainConfig, run_dir: str, *, resuming: bool) -> RunTracker:
        """``resuming`` (``--resume``) continues the MLflow run of ``run_dir``, as a resubmitted Ray run does."""
        uri = tracking_uri(cfg)
        if uri is None:
            return cls(cfg, None, None)
        if importlib.util.find_spec("mlflow") is None:  # the core install has no MLflow
            if cfg.distributed.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI"):
                raise ConfigError(
                    f"MLflow tracking to {uri} needs mlflow-skinny (pip install 'qrag[ray]'), "
                    "or switch it off with distributed.mlflow_uri=none"
                )
            sys.stderr.write("train: no MLflow tracking (mlflow-skinny is not installed)\n")
            return cls(cfg, None, None)
        return cls(cfg, uri, open_run(cfg, uri, run_dir, cfg.name, resuming=resuming))

    def reporter(self, inner):
        """``inner`` (printing) plus MLflow metrics by update."""
        if self.metrics is None:
            return inner

        def report(step: int, metrics: dict[str, Any]) -> None:
            inner(step, metrics)
            self.metrics.log(step, metrics)

        return report

    def finish(self, eval_dir: str | Path, reported: str | Path) -> None:
        """Eval files and the reported checkpoint (final/, or best/ with keep_best) as artifacts
        and as a model, as the Ray path logs them; the run FINISHED."""
        if not self.run_id:
            return
        d = self.cfg.distributed
        log_final_checkpoint(self.uri, self.run_id, Path(eval_dir), Path(reported), d.mlflow_checkpoint, self.cfg)
        finish_run(self.uri, self.run_id, "FINISHED", {"qrag.checkpoint": str(reported)})

    def close(self, status: str) -> None:
        if self.run_id:
            finish_run(self.uri, self.run_id, status)
