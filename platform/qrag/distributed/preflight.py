"""Everything a job checks on the driver before it starts a single actor.

* Paths: Ray workers run in other directories (``ray job submit --working-dir`` even runs the
  driver in a temporary copy of the project), so every relative path in the config is made
  absolute here (``PathBase``): against ``--base-dir`` / ``$QRAG_BASE_DIR`` when given; else
  inputs against the cwd and outputs against the cwd (a local Ray) or Ray's storage root
  (``$RAY_STORAGE``, else ``~/ray_results``) when joining a cluster.
* Values: the ``distributed`` section, the encoder and its tokenizer, and one record of each data
  split are loaded, so a wrong key, path or model fails in a second with a one-line message.
* Environment: the variables workers need to find the same data and encoder.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from qrag.config import ConfigError, TrainConfig
from qrag.data import DataError, load_samples
from qrag.data.chunking import tokenizer_counter
from qrag.data.paths import data_root
from qrag.model.encoder import load_tokenizer, resolve_encoder
from qrag.integrations.tracking import is_uri, tracking_uri

MLFLOW_CHECKPOINT_MODES = ("inference", "full", "none")
# Passed on to every runner and learner process when set on the driver.
# QRAG_DATA_CACHE / QRAG_CACHE_DIR / HF_DATASETS_CACHE: runners read the same prepared splits and hub data.
FORWARDED_ENV = (
    "QRAG_DATA_DIR",
    "QRAG_ENCODER",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_HUB_CACHE",
    "QRAG_DATA_CACHE",
    "QRAG_CACHE_DIR",
    "HF_DATASETS_CACHE",
    "HF_DATASETS_OFFLINE",
)


def storage_root() -> str:
    """Where runs of a cluster job land when out_dir is relative: Ray Train's own default
    ``storage_path`` (``$RAY_STORAGE``, else ``~/ray_results``), absolute on every node."""
    root = os.environ.get("RAY_STORAGE") or "~/ray_results"
    return root if is_uri(root) else str(Path(root).expanduser().resolve())


@dataclass(frozen=True)
class PathBase:
    """What relative paths of a config mean.

    * ``explicit`` (``--base-dir`` / ``$QRAG_BASE_DIR``): every relative path is under it.
    * Otherwise inputs (data, encoder) are read from the cwd (under ``ray job submit``: the
      uploaded working directory, which every worker of the job gets too), and outputs go to the
      cwd when this process starts its own Ray, or to ``storage_root()`` when it joins a cluster
      (``--address`` / ``$RAY_ADDRESS``, as a submitted job does), whose nodes cannot see the
      submitter's directory and whose driver runs in a temporary copy.
    """

    files: Path
    outputs: str
    explicit: bool = False
    cluster: bool = False


def base_directory(explicit: str | None, cluster: bool = False) -> PathBase:
    chosen = explicit or os.environ.get("QRAG_BASE_DIR")
    if chosen:
        base = Path(chosen).expanduser()
        if not base.is_dir():
            raise ConfigError(f"--base-dir {chosen}: no such directory")
        return PathBase(base.resolve(), str(base.resolve()), explicit=True, cluster=cluster)
    return PathBase(Path.cwd(), storage_root() if cluster else str(Path.cwd()), cluster=cluster)


def _join(root: str, value: str) -> str:
    return f"{root.rstrip('/')}/{value}" if is_uri(root) else str(Path(root) / value)


def _is_absolute(value: str) -> bool:
    return is_uri(value) or os.path.isabs(os.path.expanduser(value))


def _input(value: str, key: str, base: PathBase) -> str:
    if _is_absolute(value):
        return os.path.expanduser(value)
    path = base.files / value
    if base.cluster and not base.explicit and not path.exists():
        # Under `ray job submit` the cwd is the uploaded working directory: a path outside it
        # (data beside the checkout, .rayignored files) has no meaning on the cluster.
        raise ConfigError(
            f"{key}={value} is a relative path and {path} does not exist on the driver (a cluster job runs in "
            f"a copy of the uploaded working directory): give an absolute {key} the cluster can read, or pass "
            '--base-dir "$PWD" after the script name when the cluster shares this machine\'s files'
        )
    return str(path)


def _sqlite_absolute(uri: str, base: PathBase) -> str:
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix) :].startswith("/"):
        return prefix + _join(base.outputs, uri[len(prefix) :])
    return uri


def resolve_paths(cfg: TrainConfig, base: PathBase | Path) -> TrainConfig:
    """A copy of ``cfg`` whose paths are absolute (or URIs); the data and encoder variables too."""
    if isinstance(base, Path):
        base = PathBase(base, str(base), explicit=True)
    data, model, dist = cfg.data, cfg.model, cfg.distributed
    if data.path is not None:
        data = dataclasses.replace(data, path=_input(data.path, "data.path", base))
    if not os.path.isabs(model.encoder) and (base.files / model.encoder).is_dir():
        model = dataclasses.replace(model, encoder=str(base.files / model.encoder))
    uri = dist.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        dist = dataclasses.replace(dist, mlflow_uri=_sqlite_absolute(uri, base))
    for var in ("QRAG_DATA_DIR", "QRAG_ENCODER"):
        if os.environ.get(var):
            os.environ[var] = _input(os.environ[var], var, base)
    if not os.environ.get("QRAG_DATA_DIR"):
        for candidate in (base.files / "shared" / "data", base.files.parent / "shared" / "data"):
            if candidate.is_dir():
                os.environ["QRAG_DATA_DIR"] = str(candidate)
                break
    out_dir = cfg.out_dir if _is_absolute(cfg.out_dir) else _join(base.outputs, cfg.out_dir)
    return dataclasses.replace(cfg, out_dir=os.path.expanduser(out_dir), data=data, model=model, distributed=dist)


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
        (
            "distributed.checkpoints_to_keep",
            d.checkpoints_to_keep,
            d.checkpoints_to_keep is None or d.checkpoints_to_keep >= 1,
            "null or at least 1",
        ),
        (
            "distributed.mlflow_checkpoint",
            d.mlflow_checkpoint,
            d.mlflow_checkpoint in MLFLOW_CHECKPOINT_MODES,
            " | ".join(MLFLOW_CHECKPOINT_MODES),
        ),
        (
            "learner.episodes_per_update",
            cfg.learner.episodes_per_update,
            cfg.learner.episodes_per_update >= 1,
            "at least 1",
        ),
        ("updates", cfg.updates, cfg.updates >= 1, "at least 1"),
    ]
    for key, value, ok, requirement in rules:
        if not ok:
            raise ConfigError(f"{key} must be {requirement}, got {value!r}")


def preflight(cfg: TrainConfig) -> None:
    """Fail now, with one line, on anything that would fail later in an actor."""
    check_distributed(cfg)
    if tracking_uri(cfg) and importlib.util.find_spec("mlflow") is None:
        raise ConfigError(
            "MLflow tracking needs the mlflow-skinny package (pip install 'qrag[ray]'), "
            "or switch it off with distributed.mlflow_uri=none"
        )
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
