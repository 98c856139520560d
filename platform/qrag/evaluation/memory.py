"""Peak memory of a stretch of work: CUDA's allocator on GPU, the process's peak RSS on CPU."""

from __future__ import annotations

import resource
import sys

import torch


def reset_peak(device: torch.device) -> None:
    """Start a new peak: CUDA's counter, or the kernel's RSS high-water mark (Linux)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as fh:  # "5" resets VmHWM to the current RSS
            fh.write("5")
    except OSError:
        pass  # not Linux: the peak below is then the whole process's


def peak_mb(device: torch.device) -> float:
    """Peak since :func:`reset_peak`, in MiB."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


def memory_kind(device: torch.device) -> str:
    return "cuda_max_allocated" if device.type == "cuda" else "rss_peak"
