"""Where a training update's time goes: torch.profiler over a few updates, reduced to what decides
the next optimisation (bench/train_speed.py --profile N).

- ``gpu_busy_share``: the union of every GPU kernel's and copy's time over the profiled wall time.
  Well below 1 means the GPU waits on the host (Python, dispatch, launches, syncs), so fewer and
  larger launches (micro-batch, CUDA graphs, compile) pay; near 1 means the math itself is the bound.
- ``kernels_per_update`` and ``wall_ms_per_kernel``: how many kernels an update runs, and the wall
  time per kernel (a few microseconds when the GPU is the bound; tens when the host is).
- ``top_host_ops`` / ``top_gpu_ops``: the operators with the most self time on each side.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def merged_ranges(ranges: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """[start, end) ranges merged where they touch or overlap (GPU streams may overlap), in order."""
    merged: list[list[float]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def _union_us(ranges: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) ranges."""
    return sum(hi - lo for lo, hi in merged_ranges(ranges))


def profiled(run_update: Callable[[], None], updates: int, device: torch.device) -> tuple[Any, float]:
    """``run_update`` ``updates`` times under the profiler (CPU, and CUDA on a GPU), the device
    synchronised before and after: the profile and the wall seconds it took."""
    if updates < 1:
        raise ValueError("profiling needs at least one update")
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    sync = (lambda: torch.cuda.synchronize(device)) if on_gpu else (lambda: None)
    sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(updates):
            run_update()
        sync()
        wall_s = time.perf_counter() - t0
    return prof, wall_s


def _top(rows: list[tuple[str, float, int]], n: int, updates: int) -> list[dict[str, Any]]:
    rows = sorted(rows, key=lambda r: r[1], reverse=True)[:n]
    return [
        {
            "op": name[:120],
            "ms_per_update": round(us / 1000 / updates, 3),
            "calls_per_update": round(calls / updates, 1),
        }
        for name, us, calls in rows
    ]


def profile_updates(
    run_update: Callable[[], None], updates: int, device: torch.device, top: int = 15
) -> dict[str, Any]:
    """Run ``run_update`` ``updates`` times under the profiler; the reduced breakdown (see module doc)."""
    on_gpu = device.type == "cuda"
    prof, wall_s = profiled(run_update, updates, device)
    events = prof.events()
    gpu = [e for e in events if e.device_type == DeviceType.CUDA]
    busy_us = _union_us([(e.time_range.start, e.time_range.end) for e in gpu])
    averages = prof.key_averages()
    host_rows = [(a.key, a.self_cpu_time_total, a.count) for a in averages if a.device_type == DeviceType.CPU]
    gpu_rows = [(a.key, a.self_device_time_total, a.count) for a in averages if a.device_type == DeviceType.CUDA]
    launches = sum(1 for e in events if e.device_type == DeviceType.CPU and "LaunchKernel" in e.name)
    host_self_us = sum(r[1] for r in host_rows)
    return {
        "updates": updates,
        "wall_s_per_update": round(wall_s / updates, 4),
        "gpu_busy_s_per_update": round(busy_us / 1e6 / updates, 4) if on_gpu else None,
        "gpu_busy_share": round(busy_us / 1e6 / wall_s, 4) if on_gpu else None,
        "kernels_per_update": round(len(gpu) / updates, 1) if on_gpu else None,
        "kernel_launches_per_update": round(launches / updates, 1) if on_gpu else None,
        "wall_ms_per_kernel": round(wall_s * 1000 / max(len(gpu), 1), 4) if on_gpu else None,
        "host_self_s_per_update": round(host_self_us / 1e6 / updates, 4),
        "top_host_ops": _top(host_rows, top, updates),
        "top_gpu_ops": _top(gpu_rows, top, updates) if on_gpu else [],
    }
