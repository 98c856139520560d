"""Where Ray puts qrag's work: CPU or GPU nodes, and which GPU each index shard gets.

Two mechanisms, both plain Ray resources, so that config alone decides:

* **Node pinning.** Node types declare a marker resource (``infra/``: the CPU worker group
  declares ``qrag_cpu_node: 1000``). An actor that asks for a sliver of it (0.001, the way Ray's
  own ``accelerator_type`` option works) can only be placed on such nodes. EpisodeFeeders take
  ``distributed.runner_resources`` and never a GPU; the learner takes ``distributed.learner_gpus``
  and ``distributed.learner_resources``.
* **GPU fractions.** Within a node Ray gives every GPU request a device; fractions are the only
  lever on which device. With shard fraction f > 1/(k+1) no GPU can hold more than k shards, and
  with k·f + (everything else on the GPUs) <= 1 every placement order succeeds (a GPU with fewer
  than k shards always has room for one more, and any GPU has room for the rest). So
  ``shard_gpu_fraction`` spreads N shards over G GPUs, k = ceil(N/G) per GPU: one per GPU when
  G >= N, whatever order Serve and Ray Train start things in.

No Ray import: the driver checks a run against ``ray.cluster_resources()`` before any actor
starts, and the manifest tests and ``bench/two_gpu.py`` use the same arithmetic.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from qrag.config import ConfigError, TrainConfig

# Ray's resource granularity: requests are rounded to 1/10000.
RESOURCE_STEP = 1e-4
# Resources with a field of their own (num_cpus / num_gpus / memory), not custom ones.
BUILT_IN = ("CPU", "GPU", "memory", "object_store_memory")


def check_resource_map(key: str, resources: Mapping[str, Any]) -> dict[str, float]:
    """A custom-resource request as Ray takes it; ConfigError naming the key otherwise."""
    if not isinstance(resources, Mapping):
        raise ConfigError(f"{key}: expected a mapping of resource name to amount, got {resources!r}")
    out: dict[str, float] = {}
    for name, amount in resources.items():
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"{key}: resource names must be non-empty strings, got {name!r}")
        if name in BUILT_IN or name.startswith("node:"):
            raise ConfigError(
                f"{key}.{name}: {name!r} is not a custom resource (CPUs and GPUs have fields of their own)"
            )
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
            raise ConfigError(f"{key}.{name}: expected a positive amount, got {amount!r}")
        if amount > 1 and not float(amount).is_integer():
            raise ConfigError(
                f"{key}.{name}: Ray takes fractions only up to 1 (a sliver such as 0.001 pins to a node type), "
                f"got {amount!r}"
            )
        out[name] = float(amount)
    return out


def check_gpu_amount(key: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{key}: expected a positive number of GPUs, got {value!r}")
    if value > 1 and not float(value).is_integer():
        raise ConfigError(f"{key}: Ray takes GPU fractions only up to 1, got {value!r}")
    return float(value)


def runner_resources(cfg: TrainConfig) -> dict[str, float]:
    """Custom resources of one EpisodeFeeder actor (it never asks for a GPU)."""
    return check_resource_map("distributed.runner_resources", cfg.distributed.runner_resources)


def learner_worker_resources(cfg: TrainConfig, use_gpu: bool) -> dict[str, float]:
    """``resources_per_worker`` of the Ray Train learner."""
    d = cfg.distributed
    resources = {"CPU": float(d.learner_cpus)}
    if use_gpu:
        resources["GPU"] = check_gpu_amount("distributed.learner_gpus", d.learner_gpus)
    resources.update(check_resource_map("distributed.learner_resources", d.learner_resources))
    return resources


def cluster_capacity(cfg: TrainConfig, now: Mapping[str, float]) -> dict[str, float]:
    """What the run may count on: the resources of the nodes up ``now``, raised to what an
    autoscaling cluster can grow to (``distributed.autoscale_to``, else ``$QRAG_AUTOSCALE_TO``).
    Ray has no public API for an autoscaler's limits, so the cluster's owner states them
    (infra/ sets the variable to the worker groups' maxima)."""
    limits: Any = cfg.distributed.autoscale_to
    if not limits and os.environ.get("QRAG_AUTOSCALE_TO"):
        try:
            limits = json.loads(os.environ["QRAG_AUTOSCALE_TO"])
        except ValueError:
            raise ConfigError(f"$QRAG_AUTOSCALE_TO is not JSON: {os.environ['QRAG_AUTOSCALE_TO']!r}") from None
    if not isinstance(limits, Mapping):
        raise ConfigError(f"distributed.autoscale_to: expected a mapping of resource name to amount, got {limits!r}")
    out = {k: float(v) for k, v in now.items()}
    for name, amount in limits.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0:
            raise ConfigError(f"distributed.autoscale_to.{name}: expected an amount >= 0, got {amount!r}")
        out[name] = max(out.get(name, 0.0), float(amount))
    return out


def check_cluster_has(cfg: TrainConfig, cluster: Mapping[str, float]) -> None:
    """Every custom resource the run asks for is declared by some node of the cluster; otherwise
    its actors would wait forever for a node that never comes."""
    d = cfg.distributed
    wanted = [
        ("distributed.runner_resources", name, amount) for name, amount in runner_resources(cfg).items() if d.runners
    ]
    wanted += [
        ("distributed.learner_resources", name, amount)
        for name, amount in check_resource_map("distributed.learner_resources", d.learner_resources).items()
    ]
    for key, name, amount in wanted:
        have = float(cluster.get(name, 0.0))
        if have + 1e-9 < amount:
            declared = (
                ", ".join(sorted(k for k in cluster if k not in BUILT_IN and not k.startswith("node:"))) or "none"
            )
            raise ConfigError(
                f"{key} asks for {amount:g} of {name!r} but the Ray cluster has {have:g} "
                f"(custom resources it declares: {declared}); "
                f"start the nodes meant for it with --resources='{{\"{name}\": 1000}}' "
                "(infra/ declares qrag_cpu_node on the CPU workers) "
                f"or drop {key}"
            )


# -- GPU fractions for Serve (and a learner sharing the GPUs) ----------------------------------


def _floor_step(x: float) -> float:
    return math.floor(x / RESOURCE_STEP + 1e-6) * RESOURCE_STEP


def shard_gpu_fraction(shards: int, gpus: int, reserved: float = 0.0) -> float:
    """GPUs per shard replica that spreads ``shards`` evenly over ``gpus`` GPUs (one per GPU when
    ``gpus >= shards``), leaving ``reserved`` of a GPU for everything else placed on the GPUs
    (encoder replicas, a learner). 0 when there is no GPU."""
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    if gpus <= 0:
        return 0.0
    per_gpu = math.ceil(shards / gpus)
    fraction = _floor_step((1.0 - reserved) / per_gpu)
    if fraction * (per_gpu + 1) <= 1.0:
        raise ValueError(
            f"{shards} shards on {gpus} GPUs with {reserved:g} GPU reserved for the rest: "
            f"a shard would get {fraction:g} GPU, "
            f"too little to keep more than {per_gpu} shard(s) off one GPU; "
            f"reserve at most {1 - per_gpu / (per_gpu + 1):.3f}"
        )
    return fraction


def gpu_plan_problems(shards: int, shard_gpus: float, gpus: int, others: Mapping[str, float]) -> list[str]:
    """Why ``shards`` replicas of ``shard_gpus`` each plus ``others`` (name -> GPUs) would not
    spread one shard per GPU (k = ceil(shards/gpus) per GPU) in every placement order; [] if they do."""
    if gpus <= 0:
        return [f"{name} asks for {g:g} GPU but there is none" for name, g in others.items() if g > 0] + (
            [f"shards ask for {shard_gpus:g} GPU each but there is none"] if shard_gpus > 0 else []
        )
    problems = []
    per_gpu = math.ceil(shards / gpus)
    rest = float(sum(others.values()))
    if shard_gpus <= 0:
        problems.append("shards ask for no GPU: they run on CPU")
    elif shard_gpus * (per_gpu + 1) <= 1.0 + 1e-9:
        problems.append(
            f"shard_gpus {shard_gpus:g} lets {per_gpu + 1} shards share one GPU (needs > {1 / (per_gpu + 1):.4f})"
        )
    if per_gpu * shard_gpus + rest > 1.0 + 1e-9:
        shown = ", ".join(f"{k} {v:g}" for k, v in others.items())
        problems.append(
            f"{per_gpu} shard(s) x {shard_gpus:g} + the rest ({shown}) = {per_gpu * shard_gpus + rest:g} > 1 GPU: "
            "some placement order leaves a shard without a GPU"
        )
    return problems
