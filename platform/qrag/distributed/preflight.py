"""Everything a job checks on the driver before it starts a single actor.

* Paths: Ray workers run in other directories (``ray job submit --working-dir`` even runs the
  driver in a temporary copy of the project), so every relative path in the config is made
  absolute here, against the *submitter's* directory: the cwd for plain ``python jobs/...``,
  ``--base-dir`` (or ``$QRAG_BASE_DIR``) under ``ray job submit``.
* Values: the ``distributed`` section, the encoder and its tokenizer, and one record of each data
  split are loaded, so a wrong key, path or model fails in a second with a one-line message.
* Environment: the variables workers need to find the same data and encoder.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

from ..config import ConfigError, TrainConfig
from ..data import DataError, load_samples
from ..data.chunking import tokenizer_counter
from ..data.paths import data_root
from ..encoder import load_tokenizer, resolve_encoder
from .tracking import is_uri, tracking_uri

MLFLOW_CHECKPOINT_MODES = ("inference", "full", "none")
# Passed on to every runner and learner process when set on the driver.
FORWARDED_ENV = ("QRAG_DATA_DIR", "QRAG_ENCODER", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE")


def ray_job_working_dir() -> str | None:
    """The working_dir of the ``ray job submit`` this process runs under, if any."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return None
    try:
        return (json.loads(raw).get("runtime_env") or {}).get("working_dir")
    except (ValueError, AttributeError):
        return None


def base_directory(explicit: str | None) -> Path | None:
    """Where relative paths point: ``--base-dir``, ``$QRAG_BASE_DIR``, else the cwd unless this
    is a ``ray job submit`` driver (whose cwd is a temporary copy that nobody will look into)."""
    chosen = explicit or os.environ.get("QRAG_BASE_DIR")
    if chosen:
        base = Path(chosen).expanduser()
        if not base.is_dir():
            raise ConfigError(f"--base-dir {chosen}: no such directory")
        return base.resolve()
    return None if ray_job_working_dir() else Path.cwd()


def _absolute(value: str, key: str, base: Path | None) -> str:
    if is_uri(value) or os.path.isabs(os.path.expanduser(value)):
        return os.path.expanduser(value)
    if base is None:
        raise ConfigError(
            f"{key}={value} is a relative path, but this driver runs in Ray's temporary copy of the working "
            f"directory: pass --base-dir \"$PWD\" after the script name, or an absolute {key}"
        )
    return str(base / value)


def _sqlite_absolute(uri: str, key: str, base: Path | None) -> str:
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        return prefix + _absolute(uri[len(prefix):], key, base)
    return uri


def resolve_paths(cfg: TrainConfig, base: Path | None) -> TrainConfig:
    """A copy of ``cfg`` whose paths are absolute (or URIs); the data and encoder variables too."""
    data, model, dist = cfg.data, cfg.model, cfg.distributed
    if data.path is not None:
        data = dataclasses.replace(data, path=_absolute(data.path, "data.path", base))
    if base is not None and not os.path.isabs(model.encoder) and (base / model.encoder).is_dir():
        model = dataclasses.replace(model, encoder=str(base / model.encoder))
    uri = dist.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        dist = dataclasses.replace(dist, mlflow_uri=_sqlite_absolute(uri, "distributed.mlflow_uri", base))
    for var in ("QRAG_DATA_DIR", "QRAG_ENCODER"):
        if os.environ.get(var):
            os.environ[var] = _absolute(os.environ[var], var, base)
    if base is not None and not os.environ.get("QRAG_DATA_DIR"):
        for candidate in (base / "shared" / "data", base.parent / "shared" / "data"):
            if candidate.is_dir():
                os.environ["QRAG_DATA_DIR"] = str(candidate)
                break
    out_dir = _absolute(cfg.out_dir, "out_dir", base)
    return dataclasses.replace(cfg, out_dir=out_dir, data=data, model=model, distributed=dist)


def check_distributed(cfg: TrainConfig) -> None:
    d = cfg.distributed
    rules = [
        ("distributed.runners", d.runners, d.runners >= 0, "0 or more"),
        ("distributed.envs_per_runner", d.envs_per_runner, d.envs_per_runner >= 0, "0 (automatic) or more"),
        ("distributed.prefetch", d.prefetch, d.prefetch >= 1, "at least 1"),
        ("distributed.runner_cpus", d.runner_cpus, d.runner_cpus >= 0, "0 or more"),
        ("distributed.learner_cpus", d.learner_cpus, d.learner_cpus > 0, "positive"),
        ("distributed.request_retries", d.request_retries, d.request_retries >= 0, "0 or more"),
        ("distributed.request_timeout_s", d.request_timeout_s, d.request_timeout_s > 0, "positive"),
        ("distributed.max_failures", d.max_failures, d.max_failures >= -1, "-1 (always) or more"),
        ("distributed.checkpoints_to_keep", d.checkpoints_to_keep, d.checkpoints_to_keep is None or d.checkpoints_to_keep >= 1, "null or at least 1"),
        ("distributed.mlflow_checkpoint", d.mlflow_checkpoint, d.mlflow_checkpoint in MLFLOW_CHECKPOINT_MODES, " | ".join(MLFLOW_CHECKPOINT_MODES)),
        ("learner.episodes_per_update", cfg.learner.episodes_per_update, cfg.learner.episodes_per_update >= 1, "at least 1"),
        ("updates", cfg.updates, cfg.updates >= 1, "at least 1"),
    ]
    for key, value, ok, requirement in rules:
        if not ok:
            raise ConfigError(f"{key} must be {requirement}, got {value!r}")


def preflight(cfg: TrainConfig) -> None:
    """Fail now, with one line, on anything that would fail later in an actor."""
    check_distributed(cfg)
    if tracking_uri(cfg) and importlib.util.find_spec("mlflow") is None:
        raise ConfigError("MLflow tracking needs the mlflow-skinny package (pip install 'qrag[ray]'), "
                          "or switch it off with distributed.mlflow_uri=none")
    tokenizer = load_tokenizer(resolve_encoder(cfg.model.encoder))
    count = tokenizer_counter(tokenizer)
    probe = dataclasses.replace(cfg.data, limit=1)
    for split in ("train", "dev"):
        load_samples(probe, split, count)


def worker_env() -> dict[str, str]:
    """Variables every Ray process of the run gets: the same data and encoder as the driver."""
    env = {var: os.environ[var] for var in FORWARDED_ENV if os.environ.get(var)}
    try:
        env.setdefault("QRAG_DATA_DIR", str(data_root().resolve()))
    except DataError:
        pass  # no default data here; a config with data.path does not need one
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env
