"""One scoring step of every shard on a GPU, replayed from a CUDA graph.

With one pass and one copy per step (:func:`qrag.index.shards.score_shards`), a 4-step query over
four shards still spends most of a step on the host, not the GPU: Python and about fifteen kernel
launches per shard (the compiled scorer's call and guards, top-k, the positions
of the picks, the packing of the results). A graph per (shards, batch bucket, selected-set width,
n_total, k) replays all of them with one launch; the states and the selected set are copied into
the graph's input buffers, and the packed results come back in one copy as before.

Rows are padded to a batch bucket (the padded rows' results are dropped), so a handful of
graphs serve every concurrency. The graphs share one memory pool: each replay's results are
copied to the host before any other graph runs (one lock), so no graph needs another's memory
afterwards. A key whose capture fails is answered eagerly from then on and says why in
:attr:`ScoreGraphs.failures`.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from qrag.model.state_graphs import BATCH_BUCKETS, bucket_of, capture_graph, capture_lock


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``tensors`` (any dtypes, one device) in one uint8 buffer on that device."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {}


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """numpy's dtype for a torch dtype (looked up once: unpack runs on every scoring step)."""
    if dtype not in _NUMPY_DTYPES:
        _NUMPY_DTYPES[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
    return _NUMPY_DTYPES[dtype]


def unpack(buf: np.ndarray, specs: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> list[np.ndarray]:
    """Host arrays from a :func:`pack`ed buffer copied to the host; ``specs`` = (dtype, shape) of each."""
    out, lo = [], 0
    for dtype, shape in specs:
        np_dtype = numpy_dtype(dtype)
        size = int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize
        # A copy: aligned for its dtype and writable, as .cpu().numpy() would give.
        out.append(buf[lo : lo + size].copy().view(np_dtype).reshape(shape))
        lo += size
    return out


@dataclass
class _Captured:
    shards: list[weakref.ref]
    graph: Any  # torch.cuda.CUDAGraph
    states: torch.Tensor  # [bucket, d] input buffer
    sel: torch.Tensor  # [bucket, width] input buffer
    packed: torch.Tensor  # the results, packed
    specs: list[tuple[torch.dtype, tuple[int, ...]]]
    has_pos: list[bool]


class ScoreGraphs:
    """Captured scoring steps for the shards of one process on one GPU."""

    def _record(self, step, device: torch.device):
        """Warm ``step`` up on a side stream (the fused scorer compiles for these shapes there),
        capture it, replay it once for the inputs it was captured with; (graph, its outputs)."""
        with capture_lock(device):
            graph, outputs, self._pool = capture_graph(step, device, self._pool)
            graph.replay()  # capture only records
        return graph, outputs

    def __init__(self, capacity: int = 48, batch_buckets: Sequence[int] = BATCH_BUCKETS):
        self.capacity, self.batch_buckets = capacity, tuple(batch_buckets)
        self._captured: OrderedDict[tuple, _Captured] = OrderedDict()
        self._pool = None
        self._lock = threading.Lock()
        self.failures: dict[tuple, str] = {}  # key -> why its capture failed (answered eagerly since)
        self.replays = 0
        self.captures = 0

    def replay_best_chunks(
        self, shards: Sequence[Any], states: torch.Tensor, sel: np.ndarray, n_total: int, k: int
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray | None]] | None:
        """Each shard's :meth:`~qrag.index.shards.ShardIndex.best_chunks_on_device` for the rows of ``states``
        (on the shards' GPU) and ``sel`` (:func:`~qrag.index.shards.selected_matrix`), on the host;
        None where no graph serves (more rows than the largest bucket, a failed capture)."""
        rows, width = len(states), sel.shape[1]
        size = bucket_of(rows, self.batch_buckets)
        if size is None:
            return None
        key = (
            tuple((id(s), s.rows_within(n_total), s.vectors.data_ptr(), s.model.positions) for s in shards),
            size,
            width,
            n_total,
            k,
            str(states.device),
        )
        if key in self.failures:
            return None
        with self._lock:
            entry = self._captured.get(key)
            if entry is not None and any(ref() is not s for ref, s in zip(entry.shards, shards)):
                del self._captured[key]  # a shard of that id was dropped and another took its place
                entry = None
            if entry is None:
                try:
                    entry = self._capture(shards, states, sel, n_total, k, size)
                except Exception as exc:  # noqa: BLE001 - not capturable here: answer eagerly
                    self.failures[key] = f"{type(exc).__name__}: {exc}"[:300]
                    return None
                self._captured[key] = entry
                while len(self._captured) > self.capacity:
                    self._captured.popitem(last=False)
            else:
                self._captured.move_to_end(key)
                entry.states[:rows].copy_(states)
                entry.sel[:rows].copy_(torch.from_numpy(sel))
                entry.graph.replay()
                self.replays += 1
            host = unpack(entry.packed.cpu().numpy(), entry.specs)  # the one sync of the step
        out, it = [], iter(host)
        for has_pos in entry.has_pos:
            q, top_i = next(it)[:rows], next(it)[:rows]
            out.append((q, top_i, next(it)[:rows] if has_pos else None))
        return out

    def _capture(self, shards, states: torch.Tensor, sel: np.ndarray, n_total: int, k: int, size: int) -> _Captured:
        device = states.device
        st = torch.zeros(size, states.shape[1], dtype=torch.float32, device=device)
        st[: len(states)] = states
        sl = torch.full((size, sel.shape[1]), n_total, dtype=torch.long, device=device)
        sl[: len(sel)] = torch.from_numpy(sel).to(device)

        def step():
            tops = [s.best_chunks_on_device(st, sl, n_total, k) for s in shards]
            return tops, pack([t for top in tops for t in top if t is not None])

        graph, (tops, packed) = self._record(step, device)
        self.captures += 1
        return _Captured(
            [weakref.ref(s) for s in shards],
            graph,
            st,
            sl,
            packed,
            [(t.dtype, tuple(t.shape)) for top in tops for t in top if t is not None],
            [top[2] is not None for top in tops],
        )


_BY_DEVICE: dict[str, ScoreGraphs] = {}


def score_graphs_for(device: torch.device) -> ScoreGraphs:
    """The process's graphs for ``device`` (shards of several corpora share them)."""
    return _BY_DEVICE.setdefault(str(device), ScoreGraphs())


def graph_stats() -> dict[str, Any]:
    """Captures, replays and failures over every device (for benchmarks and /metrics)."""
    return {
        "captures": sum(g.captures for g in _BY_DEVICE.values()),
        "replays": sum(g.replays for g in _BY_DEVICE.values()),
        "failures": {repr(k): v for g in _BY_DEVICE.values() for k, v in g.failures.items()},
    }
