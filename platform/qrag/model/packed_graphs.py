"""Packed encoder passes without gradients, replayed from CUDA graphs at bucketed shapes.

A packed pass (:mod:`qrag.model.packed`) is ~80 kernels of real work, but each launch costs the
host more than the small ones take on the GPU: with the GPU's work halved by packing, a soft PQN
update became bound by its host. A pass without gradients (acting, the target values) has no
autograd state, so it can be captured once per shape and replayed with one launch.

A graph needs fixed shapes. A batch of ``n`` real tokens in ``b`` sequences of at most ``l`` tokens
is run at (tokens, sequences, length) buckets: the tokens rounded up to a step of the batch
budget, the longest sequence to a length bucket (the flash kernel's grid), and the sequences to a
power of two. The tokens beyond the real ones form filler sequences of at most the length bucket,
and the sequences beyond those are empty: every token of the buffer belongs to some sequence, so
nothing uninitialised flows through the layers, and the real sequences' vectors are those of the
unpadded pass (attention stays within a sequence; tests compare the two).

A graph reads the module's weights where they lie, so it follows every in-place refresh of them
(the learner's bf16 copies, its optimiser step and target move). It is captured in the mode the
module is in, which for these passes is eval: no dropout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from qrag.model.packed import Packing, packed_hidden, packed_mean_pool
from qrag.model.state_graphs import bucket_of, capture_graph, capture_lock

LENGTH_BUCKETS = (32, 64, 128, 256, 512)
MIN_SEQUENCES = 16
TOKEN_STEPS = 32  # the batch budget in this many steps: a full batch pads at most 1/32 of it


@dataclass(frozen=True)
class PackedShape:
    tokens: int
    sequences: int
    length: int


def packed_shape(lengths: np.ndarray, max_tokens: int, length_limit: int) -> PackedShape | None:
    """The bucketed shape that holds these sequences (None: larger than any bucket)."""
    step = max(64, -(-max_tokens // TOKEN_STEPS))
    total, longest = int(lengths.sum()), int(lengths.max())
    tokens = max(step, -(-total // step) * step)
    length = bucket_of(longest, [b for b in LENGTH_BUCKETS if b <= length_limit] or [length_limit])
    if length is None or tokens > -(-max_tokens // step) * step:
        return None
    fillers = -(-(tokens - total) // length)
    sequences = max(MIN_SEQUENCES, 1 << math.ceil(math.log2(len(lengths) + fillers)))
    return PackedShape(tokens, sequences, length)


def padded_inputs(flat_ids: np.ndarray, lengths: np.ndarray, shape: PackedShape, pad_id: int) -> np.ndarray:
    """One int64 row of a bucketed batch's inputs: ids, positions and segments ([tokens] each), then
    the sequences' offsets ([sequences + 1]). The real sequences come first; filler sequences of at
    most ``shape.length`` pad ids take the remaining tokens; the rest are empty."""
    total = int(lengths.sum())
    spare = shape.tokens - total
    fillers = np.full(-(-spare // shape.length), shape.length, dtype=np.int64)
    if len(fillers):
        fillers[-1] = spare - shape.length * (len(fillers) - 1)
    all_lengths = np.concatenate([np.asarray(lengths, np.int64), fillers])
    offsets = np.full(shape.sequences + 1, shape.tokens, dtype=np.int64)
    offsets[0] = 0
    np.cumsum(all_lengths, out=offsets[1 : len(all_lengths) + 1])
    segments = np.repeat(np.arange(len(all_lengths), dtype=np.int64), all_lengths)
    positions = np.arange(shape.tokens, dtype=np.int64) - offsets[segments]
    ids = np.full(shape.tokens, pad_id, dtype=np.int64)
    ids[:total] = flat_ids
    return np.concatenate([ids, positions, segments, offsets])


def packing_from_inputs(inputs: torch.Tensor, shape: PackedShape) -> Packing:
    """The :class:`Packing` a :func:`padded_inputs` row describes, derived on its device."""
    n = shape.tokens
    offsets = inputs[3 * n :]
    return Packing(
        ids=inputs[:n],
        positions=inputs[n : 2 * n],
        segments=inputs[2 * n : 3 * n],
        cu_seqlens=offsets.to(torch.int32),
        lengths=offsets.diff().to(torch.float32),
        max_len=shape.length,
        count=shape.sequences,
    )


class PackedGraphs:
    """Mean-pooled packed passes of any number of modules (each in eval mode, without gradients),
    one CUDA graph per (module, shape), every graph in one memory pool."""

    def __init__(self, device: torch.device, max_tokens: int, pad_id: int, max_shapes: int = 64):
        self.device, self.max_tokens, self.pad_id = torch.device(device), max_tokens, pad_id
        self.max_shapes = max_shapes  # per module: past it a new shape runs eagerly
        self._graphs: dict[tuple[int, PackedShape], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._shapes: dict[int, int] = {}
        self._pool = None
        self.fallbacks: dict[str, str] = {}
        self.replays = 0
        self.padded_tokens = 0  # tokens the replayed batches carried, fillers included

    @property
    def captured_shapes(self) -> int:
        return len(self._graphs)

    @torch.no_grad()
    def pool(self, model: nn.Module, flat_ids: np.ndarray, lengths: np.ndarray) -> torch.Tensor | None:
        """[len(lengths), d] float32 mean-pooled vectors of one packed batch, from a graph; None
        where no graph serves it (the caller runs it eagerly)."""
        limit = int(getattr(model.config, "max_position_embeddings", LENGTH_BUCKETS[-1]))
        shape = packed_shape(lengths, self.max_tokens, limit)
        if shape is None:
            return None
        entry = self._graph(model, shape)
        if entry is None:
            return None
        graph, inputs, out = entry
        inputs.copy_(
            torch.from_numpy(padded_inputs(flat_ids, lengths, shape, self.pad_id)).pin_memory(), non_blocking=True
        )
        graph.replay()
        self.replays += 1
        self.padded_tokens += shape.tokens
        return out[: len(lengths)].clone()  # the next replay of this shape writes over ``out``

    def _graph(self, model: nn.Module, shape: PackedShape):
        key = (id(model), shape)  # the learner's modules live as long as it does
        if key in self._graphs:
            return self._graphs[key]
        label = f"{type(model).__name__}@{id(model):x}:{shape.tokens}x{shape.sequences}x{shape.length}"
        if label in self.fallbacks or self._shapes.get(id(model), 0) >= self.max_shapes:
            return None
        inputs = torch.zeros(3 * shape.tokens + shape.sequences + 1, dtype=torch.long, device=self.device)
        # A valid batch to warm up on: every token a filler (the real ones are copied in per replay).
        empty = np.zeros(0, dtype=np.int64)
        inputs.copy_(torch.from_numpy(padded_inputs(empty, empty, shape, self.pad_id)))

        def run() -> torch.Tensor:
            packing = packing_from_inputs(inputs, shape)
            return packed_mean_pool(packed_hidden(model, packing), packing)

        with capture_lock(self.device):
            try:
                graph, out, self._pool = capture_graph(run, self.device, self._pool, "thread_local", free_caches=False)
            except RuntimeError as exc:  # an op that cannot be captured: this shape runs eagerly
                self.fallbacks[label] = f"{type(exc).__name__}: {exc}"[:300]
                torch.cuda.synchronize(self.device)
                return None
        self._shapes[id(model)] = self._shapes.get(id(model), 0) + 1
        self._graphs[key] = (graph, inputs, out)
        return self._graphs[key]
