"""The sweep file: which training config the trials start from, what they vary, how they are
stopped and what each one may use. No Ray here (``tune/sweep.py --local`` runs without it).

    name: hotpot_alpha_lambda_tau          # <out_dir>/<name>/ and the MLflow parent run
    base: ../configs/hotpot.yaml           # training preset, relative to this file
    overrides: {updates: 200, eval_every: 20}
    space:                                 # dotted TrainConfig keys
      learner.alpha: {loguniform: [0.005, 0.5]}
      learner.lam: {uniform: [0.0, 1.0]}
      learner.episodes_per_update: {choice: [128, 256]}
    trials: 16                             # draws (each grid point is run this many times)
    scheduler: {type: asha, metric: eval/fact_f1, mode: max, grace_period: 40, reduction_factor: 3}
    resources: {gpus: 0.25, learner_cpus: 2, runners: 2}
    max_concurrent: 4

Everything is checked before anything starts: an unknown key (in the file or the space), a
range that a config field cannot take, a sweep that would select on dev.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from qrag.config import (
    ConfigError,
    TrainConfig,
    apply_overrides,
    describe,
    from_dict,
    opt,
    read_yaml,
    to_dict,
)

KINDS = ("uniform", "loguniform", "randint", "choice", "grid")
METRICS = ("eval/fact_f1", "eval/fact_em")
# Keys a trial may not vary: the sweep sets them (names, storage, resources) or its scheduler
# depends on them (the length of a trial and when it is evaluated, the split it is judged on).
FIXED_KEYS = ("name", "out_dir", "updates", "eval_every", "data.val_fraction")
FIXED_PREFIXES = ("distributed.",)


@dataclass
class SchedulerSpec:
    """Early stopping of bad trials (ASHA: asynchronous successive halving)."""

    type: str = opt("asha", "asha | none (every trial runs all its updates).")
    metric: str = opt(
        "eval/fact_f1",
        "What the scheduler and the best-trial choice compare: eval/fact_f1 | eval/fact_em, "
        "evaluated every eval_every updates on data.val_fraction of train (never on dev).",
    )
    mode: str = opt("max", "max | min.")
    grace_period: int = opt(0, "Updates a trial runs before it can be stopped (the first rung); 0 = eval_every.")
    reduction_factor: float = opt(
        3.0, "At each rung a trial goes on only if it is in the best 1/reduction_factor so far."
    )
    max_t: int = opt(
        0,
        "Updates of a trial that passes every rung (its training length; rungs are grace_period * "
        "reduction_factor^k up to it); 0 = the training config's updates.",
    )


@dataclass
class ResourcesSpec:
    """What one trial's training run reserves (written into its distributed.* keys)."""

    gpus: float | None = opt(
        None,
        "GPUs of the learner: a fraction lets trials share a GPU (0.25 = four per GPU); "
        "0 = CPU only; null = the training config's distributed.learner_gpu(s).",
    )
    learner_cpus: float | None = opt(None, "CPUs of the learner (its torch threads); null = the training config's.")
    runners: int | None = opt(None, "EpisodeFeeder actors per trial; null = the training config's.")
    runner_cpus: float | None = opt(None, "CPUs per EpisodeFeeder; null = the training config's.")
    trial_cpus: float = opt(
        0.01,
        "CPUs reserved for the Tune trial process itself: a sliver, it only waits for its Ray Train run "
        "(the learner and runners reserve their own).",
    )


@dataclass
class SweepSpec:
    """A hyperparameter sweep over a training config."""

    name: str = opt(
        "",
        "Sweep name: <out_dir>/<name>/ holds its trials and results; the MLflow parent run's name. "
        "Default: the file name. Starting a sweep with an existing name resumes it.",
    )
    base: str = opt("", "Training preset the trials start from (a path relative to this file).")
    overrides: dict[str, Any] = opt(
        {}, "Training config keys set on top of the preset, e.g. {updates: 200, learner.top_k: 16}."
    )
    space: dict[str, Any] = opt(
        {}, "Dotted training config key -> {uniform|loguniform|randint: [lo, hi]} or {choice|grid: [values]}."
    )
    trials: int = opt(1, "Draws from the space; grid dimensions are crossed with them (trials x grid points runs).")
    seed: int = opt(0, "Seed of the random draws.")
    max_concurrent: int = opt(0, "Trials running at once; 0 = as many as the cluster's resources allow.")
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec, metadata={"help": "Scheduler."})
    resources: ResourcesSpec = field(default_factory=ResourcesSpec, metadata={"help": "Resources per trial."})


@dataclass(frozen=True)
class Dimension:
    """One swept key: ``kind`` and its arguments (bounds, or the values to choose from)."""

    key: str
    kind: str
    values: tuple[Any, ...]

    @property
    def log_scale(self) -> bool:
        """Whether plots use a log axis for it."""
        if self.kind == "loguniform":
            return True
        numbers = [v for v in self.values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return (
            self.kind in ("choice", "grid")
            and len(numbers) == len(self.values) > 1
            and min(numbers) > 0
            and max(numbers) / min(numbers) >= 20
        )

    def describe(self) -> str:
        return f"{self.kind}{list(self.values)}"

    def probe_values(self) -> list[Any]:
        """Values that show whether the config field can take this dimension's draws."""
        if self.kind in ("choice", "grid"):
            return list(self.values)
        lo, hi = self.values
        inside = lo * (hi / lo) ** 0.37 if self.kind == "loguniform" else lo + 0.37 * (hi - lo)
        return [lo, hi, round(inside) if self.kind == "randint" else inside]

    def sample(self, rng: np.random.Generator) -> Any:
        """One draw (the sequential ``--local`` sweep; under Ray, Tune's domains draw)."""
        if self.kind == "choice":
            return self.values[int(rng.integers(len(self.values)))]
        if self.kind == "grid":
            raise ValueError("grid dimensions are enumerated, not sampled")
        lo, hi = self.values
        if self.kind == "uniform":
            return float(rng.uniform(lo, hi))
        if self.kind == "loguniform":
            return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        return int(rng.integers(lo, hi + 1))  # randint: inclusive bounds


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_dimension(key: str, raw: Any) -> Dimension:
    where = f"space.{key}"
    if not isinstance(raw, dict) or len(raw) != 1:
        raise ConfigError(
            f"{where}: expected one of {{{' | '.join(KINDS)}: ...}}, got {raw!r} (fixed values go in overrides)"
        )
    ((kind, args),) = raw.items()
    if kind not in KINDS:
        raise ConfigError(f"{where}: unknown kind {kind!r} (choose from {', '.join(KINDS)})")
    if not isinstance(args, list) or not args:
        raise ConfigError(f"{where}.{kind}: expected a non-empty list, got {args!r}")
    if kind in ("choice", "grid"):
        return Dimension(key, kind, tuple(args))
    # YAML 1.1 reads 1e-3 (no dot) as a string: accept it as the number it means.
    args = [float(a) if isinstance(a, str) and _is_float(a) else a for a in args]
    if len(args) != 2 or not all(_number(a) for a in args):
        raise ConfigError(f"{where}.{kind}: expected [low, high] numbers, got {args!r}")
    lo, hi = args
    if not lo < hi:
        raise ConfigError(f"{where}.{kind}: low must be below high, got {args!r}")
    if kind == "loguniform" and lo <= 0:
        raise ConfigError(f"{where}.loguniform: bounds must be positive, got {args!r}")
    if kind == "randint" and not (float(lo).is_integer() and float(hi).is_integer()):
        raise ConfigError(f"{where}.randint: bounds must be integers, got {args!r}")
    if kind == "randint":
        lo, hi = int(lo), int(hi)
    return Dimension(key, kind, (lo, hi))


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def set_keys(data: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of the nested config ``data`` with dotted ``values`` set."""
    out = json.loads(json.dumps(data))
    for key, value in values.items():
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {part} is not a section")
        node[parts[-1]] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    """numpy scalars (Tune's draws) as the Python values the config and YAML take."""
    return value.item() if isinstance(value, np.generic) else value


def with_values(cfg: TrainConfig, values: dict[str, Any]) -> TrainConfig:
    """``cfg`` with dotted keys replaced (validated like any config)."""
    return from_dict(TrainConfig, set_keys(to_dict(cfg), values))


def sweepable_keys() -> set[str]:
    return {key for key, _, _ in describe(TrainConfig)}


def check_space(dims: list[Dimension], base: TrainConfig) -> None:
    """Every key is a real, sweepable config key and every value is one its field can take."""
    known = sweepable_keys()
    for dim in dims:
        if dim.key not in known:
            close = sorted(k for k in known if k.split(".")[-1] == dim.key.split(".")[-1])
            hint = f" (did you mean {', '.join(close)}?)" if close else " (`qrag train --help` lists the keys)"
            raise ConfigError(f"space.{dim.key}: not a training config key{hint}")
        if dim.key in FIXED_KEYS or dim.key.startswith(FIXED_PREFIXES):
            raise ConfigError(
                f"space.{dim.key}: a sweep cannot vary {dim.key} (the sweep sets names, storage and resources, "
                "and its scheduler needs the same updates, eval_every and validation split in every trial)"
            )
        for value in dim.probe_values():
            try:
                with_values(base, {dim.key: value})
            except ConfigError as exc:
                raise ConfigError(
                    f"space.{dim.key}: {dim.describe()} gives {value!r}, which the config cannot take: {exc}"
                ) from None


def parse_space(raw: dict[str, Any]) -> list[Dimension]:
    if not raw:
        raise ConfigError("space: empty; name at least one training config key to vary")
    return [parse_dimension(str(key), value) for key, value in raw.items()]


# -- the resolved sweep ---------------------------------------------------------------------------


@dataclass
class Sweep:
    """A checked sweep: the spec, its dimensions and the base training config of every trial."""

    spec: SweepSpec
    dims: list[Dimension]
    base: TrainConfig
    source: str  # the sweep file

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def metric(self) -> str:
        return self.spec.scheduler.metric

    @property
    def mode(self) -> str:
        return self.spec.scheduler.mode

    @property
    def keys(self) -> list[str]:
        return [d.key for d in self.dims]

    @property
    def score_scope(self) -> str:
        """A trial's score: its best evaluation when training keeps the best checkpoint, else its last."""
        return "best" if self.base.keep_best else "last"

    @property
    def grace_period(self) -> int:
        return self.spec.scheduler.grace_period or self.base.eval_every

    @property
    def max_t(self) -> int:
        """The length of a trial that is never stopped (``scheduler.max_t`` sets the trials' updates)."""
        return self.base.updates

    def sweep_dir(self) -> str:
        return f"{self.base.out_dir.rstrip('/')}/{self.name}"

    def trials_dir(self) -> str:
        """The trials' training runs (checkpoints, eval files)."""
        return f"{self.sweep_dir()}/trials"

    def tune_dir(self) -> str:
        """Ray Tune's experiment (its state and each trial's results). Tune syncs this folder as a
        whole, so the sweep's own files stay beside it, never in it."""
        return f"{self.sweep_dir()}/tune"

    def grid_size(self) -> int:
        return math.prod(len(d.values) for d in self.dims if d.kind == "grid")

    def total_trials(self) -> int:
        return self.spec.trials * self.grid_size()

    def resource_values(self) -> dict[str, Any]:
        """The ``distributed.*`` values every trial runs with."""
        r = self.spec.resources
        out: dict[str, Any] = {}
        if r.gpus is not None:
            out["distributed.learner_gpu"] = r.gpus > 0
            if r.gpus > 0:
                out["distributed.learner_gpus"] = r.gpus
        for key in ("learner_cpus", "runners", "runner_cpus"):
            if getattr(r, key) is not None:
                out[f"distributed.{key}"] = getattr(r, key)
        return out

    def trial_config(self, params: dict[str, Any], run_name: str, mlflow_uri: str | None) -> TrainConfig:
        """The training config of one trial: base + its draws, stored under the sweep."""
        # Trials log their model but do not register it: the sweep registers its best trial's.
        values = {
            **self.resource_values(),
            **params,
            "name": run_name,
            "out_dir": self.trials_dir(),
            "distributed.mlflow_uri": mlflow_uri or "none",
            "distributed.mlflow_registered_model": None,
        }
        return with_values(self.base, values)

    def best_config(self, params: dict[str, Any]) -> TrainConfig:
        """What to train next: the base config with the best trial's values (its own name, the
        base's out_dir and resources, not a trial's share of a GPU)."""
        return with_values(self.base, {**params, "name": f"{self.name}-best"})

    def sample_trials(self) -> list[dict[str, Any]]:
        """Every trial's values without Ray: the grid crossed with ``trials`` seeded draws."""
        rng = np.random.default_rng(self.spec.seed)
        grid = [d for d in self.dims if d.kind == "grid"]
        points = list(itertools.product(*(d.values for d in grid))) or [()]
        out = []
        for _ in range(self.spec.trials):
            for point in points:
                params = dict(zip((d.key for d in grid), point))
                params.update({d.key: d.sample(rng) for d in self.dims if d.kind != "grid"})
                out.append({d.key: params[d.key] for d in self.dims})
        return out

    def summary(self) -> dict[str, Any]:
        """The sweep as plain data (``sweep.json``, MLflow params of the parent run)."""
        return {
            "name": self.name,
            "source": self.source,
            "trials": self.spec.trials,
            "total_trials": self.total_trials(),
            "seed": self.spec.seed,
            "max_concurrent": self.spec.max_concurrent,
            "space": {d.key: d.describe() for d in self.dims},
            "scheduler": {
                **dataclasses.asdict(self.spec.scheduler),
                "grace_period": self.grace_period,
                "max_t": self.max_t,
            },
            "resources": dataclasses.asdict(self.spec.resources),
        }


def load_sweep(
    path: str | Path,
    overrides: list[str] | None = None,
    *,
    name: str | None = None,
    trials: int | None = None,
    max_concurrent: int | None = None,
) -> Sweep:
    """Read and check a sweep file; ``overrides`` (``key=value``) apply to the training config.
    Paths in the training config stay as written (``preflight.resolve_paths`` makes them absolute)."""
    path = Path(path)
    raw = read_yaml(path)
    try:
        spec: SweepSpec = from_dict(SweepSpec, raw)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if name:
        spec.name = name
    if trials is not None:
        spec.trials = trials
    if max_concurrent is not None:
        spec.max_concurrent = max_concurrent
    spec.name = spec.name or path.stem
    try:
        base = _base_config(spec, path, overrides or [])
        dims = parse_space(spec.space)
        check_space(dims, base)
        check_spec(spec, base)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return Sweep(spec, dims, base, str(path))


def _base_config(spec: SweepSpec, path: Path, overrides: list[str]) -> TrainConfig:
    if not spec.base:
        raise ConfigError("base: name the training preset the trials start from, e.g. base: ../configs/hotpot.yaml")
    preset = Path(spec.base) if Path(spec.base).is_absolute() else path.parent / spec.base
    data = read_yaml(preset)
    try:
        from_dict(TrainConfig, data)
    except ConfigError as exc:
        raise ConfigError(f"base {preset}: {exc}") from None
    try:
        data = set_keys(data, spec.overrides)
        from_dict(TrainConfig, data)
    except ConfigError as exc:
        raise ConfigError(f"overrides: {exc}") from None
    base = from_dict(TrainConfig, apply_overrides(data, overrides))
    if spec.scheduler.max_t < 0:
        raise ConfigError(
            f"scheduler.max_t must be 0 (the training config's updates) or more, got {spec.scheduler.max_t}"
        )
    return with_values(base, {"updates": spec.scheduler.max_t}) if spec.scheduler.max_t else base


def check_spec(spec: SweepSpec, base: TrainConfig) -> None:
    s, r = spec.scheduler, spec.resources
    if not spec.name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ConfigError(
            f"name {spec.name!r}: use letters, digits, '-', '_' and '.' (it names a directory and MLflow runs)"
        )
    rules = [
        ("trials", spec.trials, spec.trials >= 1, "at least 1"),
        ("max_concurrent", spec.max_concurrent, spec.max_concurrent >= 0, "0 (as many as fit) or more"),
        ("scheduler.type", s.type, s.type in ("asha", "none"), "asha | none"),
        ("scheduler.metric", s.metric, s.metric in METRICS, " | ".join(METRICS)),
        ("scheduler.mode", s.mode, s.mode in ("max", "min"), "max | min"),
        ("scheduler.grace_period", s.grace_period, s.grace_period >= 0, "0 (eval_every) or more updates"),
        ("scheduler.reduction_factor", s.reduction_factor, s.reduction_factor > 1, "above 1"),
        (
            "resources.gpus",
            r.gpus,
            r.gpus is None or 0 <= r.gpus <= 1 or float(r.gpus).is_integer(),
            "null, 0, a fraction up to 1, or whole GPUs",
        ),
        ("resources.learner_cpus", r.learner_cpus, r.learner_cpus is None or r.learner_cpus > 0, "positive"),
        ("resources.runners", r.runners, r.runners is None or r.runners >= 0, "0 or more"),
        ("resources.runner_cpus", r.runner_cpus, r.runner_cpus is None or r.runner_cpus >= 0, "0 or more"),
        (
            "resources.trial_cpus",
            r.trial_cpus,
            r.trial_cpus > 0,
            "positive (Tune needs a resource to place the trial; 0.01 will do)",
        ),
    ]
    for key, value, ok, requirement in rules:
        if not ok:
            raise ConfigError(f"{key} must be {requirement}, got {value!r}")
    # Trials are judged by periodic evaluations on a validation part of train, never on dev.
    if base.eval_every <= 0:
        raise ConfigError(
            "the training config has eval_every=0: the scheduler needs periodic evaluations "
            "(set eval_every in overrides)"
        )
    if base.data.val_fraction <= 0:
        raise ConfigError(
            "the training config has data.val_fraction=0: a sweep selects on a validation part of train, "
            "never on dev (set data.val_fraction, e.g. 0.1, in overrides)"
        )
    if base.checkpoint_every % base.eval_every:
        raise ConfigError(
            f"checkpoint_every ({base.checkpoint_every}) must be a multiple of eval_every ({base.eval_every}): "
            "every result a trial reports must carry an evaluation"
        )
    if s.type == "asha" and (s.grace_period or base.eval_every) > base.updates:
        raise ConfigError(
            f"scheduler.grace_period ({s.grace_period or base.eval_every}) is past the last update ({base.updates})"
        )
