"""Where the GPU waits in a soft PQN update: the learner's host phases, and the GPU's idle time
attributed to the phase the host was in meanwhile (no Ray).

    PYTHONPATH=platform python bench/gpu_idle_phases.py --out bench/results/idle.json [key=value ...]

The learner's encoder passes (by kind), acting, the environment's steps, the backward pass, the
optimiser step, the target move and the bf16 refresh each run inside a named
``torch.profiler.record_function`` range; after ``--warmup`` updates, ``--updates`` more run
under the profiler. The GPU's kernels and copies are merged into busy intervals; every gap between
them is split by the innermost host phase open at each moment of it. The profiler slows the host,
so the figures say where the GPU waits, not how fast an update runs (bench/train_speed.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

from bench_common import machine_info, write_result  # noqa: E402
from step_profile import merged_ranges, profiled  # noqa: E402

Interval = tuple[float, float]
Phase = tuple[str, float, float]


def busy_intervals(spans: list[Interval], start: float, end: float) -> list[Interval]:
    """The GPU's spans that begin inside [start, end], merged where they touch or overlap."""
    return merged_ranges([(s, e) for s, e in spans if start <= s <= end])


def idle_gaps(busy: list[Interval], start: float, end: float) -> list[Interval]:
    """[start, end] less the busy intervals."""
    gaps, at = [], start
    for s, e in busy:
        if s > at:
            gaps.append((at, s))
        at = max(at, e)
    if end > at:
        gaps.append((at, end))
    return gaps


def idle_by_phase(gaps: list[Interval], phases: list[Phase], resolution: float = 20.0) -> dict[str, float]:
    """Each gap's time, sampled every ``resolution`` (the spans' unit), credited to the innermost
    (shortest) phase open at that moment, or to "(outside phases)"."""
    credit: dict[str, float] = {}
    for gs, ge in gaps:
        t = gs
        while t < ge:
            open_now = [p for p in phases if p[1] <= t < p[2]]
            name = min(open_now, key=lambda p: p[2] - p[1])[0] if open_now else "(outside phases)"
            step = min(resolution, ge - t)
            credit[name] = credit.get(name, 0.0) + step
            t += step
    return credit


@contextmanager
def phase(name: str):
    from torch.profiler import record_function

    with record_function("phase:" + name):
        yield


def annotate(learner) -> None:
    """Wrap the learner's phases (and its environment's) in named profiler ranges."""
    import qrag.rl.learner as learner_module
    from qrag.rl.env import RetrievalEnv

    def wrapped(owner, attr: str, label):
        inner = getattr(owner, attr)

        def run(*args, **kwargs):
            with phase(label(args, kwargs)):
                return inner(*args, **kwargs)

        setattr(owner, attr, run)

    kind = lambda args, kwargs: "encode:" + str(kwargs.get("kind", "?"))  # noqa: E731
    wrapped(learner, "_embed", kind)
    for name in ("sample_top_k", "policy_top_k", "_backward"):
        wrapped(learner, name, lambda a, k, n=name: n)
    for name in ("step", "zero_grad"):
        wrapped(learner.optimizer, name, lambda a, k, n=name: "optimizer." + n)
    wrapped(learner.qnet, "update_targets", lambda a, k: "update_targets")
    if getattr(learner, "bf16", None) is not None:
        wrapped(learner.bf16, "refresh", lambda a, k: "bf16_refresh")
    for name in ("states", "step", "available"):
        wrapped(RetrievalEnv, name, lambda a, k, n=name: "env." + n)
    wrapped(learner_module, "fetch_floats", lambda a, k: "fetch_floats")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "hotpot.yaml"))
    ap.add_argument("--warmup", type=int, default=6, help="updates before the profiled ones")
    ap.add_argument("--updates", type=int, default=3, help="updates under the profiler")
    ap.add_argument("--out", help="write the JSON result here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    from qrag.config import load_config
    from qrag.rl.train import TrainingRun

    total = args.warmup + args.updates
    cfg = load_config(args.config, ["learner.objective=pqn", *args.overrides, f"updates={total}"])
    run = TrainingRun(cfg)
    source, learner = run.local_source(), run.learner
    annotate(learner)
    for _ in range(args.warmup):
        learner.train_update(source.next_batch())

    def one_update() -> None:
        with phase("update"):
            learner.train_update(source.next_batch())

    prof, wall_s = profiled(one_update, args.updates, run.device)
    wall = wall_s / args.updates
    events = prof.events()
    spans = [(e.time_range.start, e.time_range.end) for e in events if e.device_type.name == "CUDA"]
    phases = [
        (e.name.removeprefix("phase:"), e.time_range.start, e.time_range.end)
        for e in events
        if e.name.startswith("phase:") and e.device_type.name == "CPU"
    ]
    updates = [p for p in phases if p[0] == "update"]
    start, end = min(p[1] for p in updates), max(p[2] for p in updates)
    inner = [p for p in phases if p[0] != "update"]
    busy = busy_intervals(spans, start, end)
    gaps = idle_gaps(busy, start, end)
    per = 1000.0 * args.updates  # microseconds over all updates -> ms per update
    host: dict[str, list[float]] = {}
    for name, s, e in inner:
        entry = host.setdefault(name, [0.0, 0.0])
        entry[0] += (e - s) / per
        entry[1] += 1 / args.updates
    credit = idle_by_phase(gaps, inner)
    result = {
        "benchmark": "gpu_idle_phases",
        "config": args.config,
        "overrides": args.overrides,
        "profiled_updates": args.updates,
        "wall_s_per_update_profiled": wall,
        "gpu_busy_ms_per_update": sum(e - s for s, e in busy) / per,
        "gpu_idle_ms_per_update": sum(e - s for s, e in gaps) / per,
        "idle_ms_by_host_phase": {k: round(v / per, 2) for k, v in sorted(credit.items(), key=lambda x: -x[1])},
        "host_ms_and_calls_per_update": {
            k: [round(v[0], 2), round(v[1], 1)] for k, v in sorted(host.items(), key=lambda x: -x[1][0])
        },
        "gaps_over_1ms": sorted([round((e - s) / 1000, 2) for s, e in gaps if e - s > 1000], reverse=True)[:30],
        **machine_info(),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
