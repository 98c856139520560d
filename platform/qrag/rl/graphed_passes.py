"""The learner's encoder passes without gradients, replayed from CUDA graphs (``learner.graphs``).

Soft PQN runs several encoder forwards without gradients for each one with them: the online chunk
encoder to act, the target encoders for V(s_{t+1}), and with dropout the online state encoder to
act. Run eagerly, each forward is about a hundred kernel launches, and at a training micro-batch's
sizes their host cost exceeds the GPU's work (docs/benchmarks.md, where an update's time goes).
Replayed from a graph captured per padded (rows, length) shape, a forward is one launch.

A graph reads the encoder's parameters where they lie, so it follows every optimiser step and
target update (both write in place). It is captured with the encoder in eval mode, the mode these
passes run in: acting without dropout, bootstrapped values always without.

Two switches change what the graphs compute, not what the learner does with it:

* ``learner.graphs_bf16``: each pass runs a bf16 copy of its encoder, every op in bf16, instead of the
  fp32 encoder under bf16 autocast (which casts every weight on every forward and keeps layer norms and
  residual adds in fp32). A copy is refreshed from its encoder before a pass whenever a parameter has
  changed since the last one (its version counter moved: the optimiser, the target update, a load).
* ``learner.graphs_cudnn_attention``: the graphs are captured with cuDNN's attention first. Its host
  cost per call, the reason it is off in eager training passes, is paid once at capture.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from contextlib import nullcontext

import numpy as np
import torch
from torch import nn

from qrag.model.encoder import EncodeStats, cudnn_attention_first
from qrag.model.state_graphs import GraphedEncoder

# Finer than the serving buckets: a training pass meets every length up to the state limit, and a
# coarse length bucket pads a whole batch of rows.
TRAIN_LENGTH_BUCKETS = (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)
TRAIN_BATCH_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class Bf16Copy:
    """A bf16 copy of an encoder for passes without gradients, kept equal to it (rounded) by
    :meth:`refresh`, which copies only the parameters whose version counter moved."""

    def __init__(self, source: nn.Module):
        self.module = copy.deepcopy(source).to(dtype=torch.bfloat16).requires_grad_(False).eval()
        self.pairs = [
            (mine, theirs)
            for mine, theirs in zip(
                [*self.module.parameters(), *self.module.buffers()], [*source.parameters(), *source.buffers()]
            )
            if theirs.is_floating_point()
        ]
        self.versions: list[int | None] = [None] * len(self.pairs)

    def refresh(self) -> int:
        """Copy every changed tensor of the source in one batched copy; how many were copied."""
        stale = [i for i, (_, theirs) in enumerate(self.pairs) if theirs._version != self.versions[i]]
        if stale:
            with torch.no_grad():
                torch._foreach_copy_([self.pairs[i][0] for i in stale], [self.pairs[i][1] for i in stale])
            for i in stale:
                self.versions[i] = self.pairs[i][1]._version
        return len(stale)


class GraphedPasses:
    """One :class:`GraphedEncoder` per encoder module the learner runs without gradients."""

    def __init__(
        self,
        qnet,
        pad_id: int,
        device: torch.device,
        max_tokens: int,
        *,
        bf16: bool = False,
        cudnn_attention: bool = False,
    ):
        self.qnet, self.pad_id, self.device, self.max_tokens = qnet, pad_id, torch.device(device), max_tokens
        self.bf16, self.cudnn_attention = bf16, cudnn_attention
        self._graphed: dict[int, GraphedEncoder] = {}
        self._copies: dict[int, Bf16Copy] = {}

    def graphed(self, encoder: nn.Module) -> GraphedEncoder:
        key = id(encoder)  # the learner's encoders live as long as it does
        if key not in self._graphed:
            runs = encoder
            if self.bf16:
                self._copies[key] = Bf16Copy(encoder)
                runs = self._copies[key].module
            self._graphed[key] = GraphedEncoder(
                self.qnet,
                self.pad_id,
                self.device,
                encoder=runs,
                batch_buckets=TRAIN_BATCH_BUCKETS,
                length_buckets=TRAIN_LENGTH_BUCKETS,
                autocast=not self.bf16,
            )
        if key in self._copies:
            self._copies[key].refresh()
        return self._graphed[key]

    @property
    def captured_shapes(self) -> int:
        return sum(len(g.captured_shapes) for g in self._graphed.values())

    @property
    def fallbacks(self) -> dict[str, str]:
        """Shapes whose capture failed (they run eagerly), with why."""
        return {f"{i}:{shape}": why for i, g in enumerate(self._graphed.values()) for shape, why in g.fallbacks.items()}

    def encode(
        self, encoder: nn.Module, seqs: Sequence[np.ndarray], stats: EncodeStats, kind: str
    ) -> torch.Tensor | None:
        """The vectors Q uses (``qnet.finish`` applied), in input order; None where a sequence is
        longer than the largest length bucket (the caller encodes eagerly then)."""
        graphed = self.graphed(encoder)
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        if len(seqs) == 0 or int(lengths.max()) > graphed.length_buckets[-1]:
            return None
        before = graphed.padded_tokens
        kernels = cudnn_attention_first() if self.cudnn_attention else nullcontext()
        with stats.timing(self.device, kind), kernels:
            vectors = graphed.encode_sorted(seqs, self.max_tokens)
        stats.padded_tokens += graphed.padded_tokens - before
        stats.count(lengths)
        return vectors
