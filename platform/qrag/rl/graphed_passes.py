"""The learner's encoder passes without gradients, replayed from CUDA graphs (``learner.graphs``).

Soft PQN runs several encoder forwards without gradients for each one with them: the online chunk
encoder to act, the target encoders for V(s_{t+1}), and with dropout the online state encoder to
act. Run eagerly, each forward is about a hundred kernel launches, and at a training micro-batch's
sizes their host cost exceeds the GPU's work (docs/benchmarks.md, where an update's time goes).
Replayed from a graph captured per padded (rows, length) shape, a forward is one launch.

A graph reads the encoder's parameters where they lie, so it follows every optimiser step and
target update (both write in place). It is captured with the encoder in eval mode, the mode these
passes run in: acting without dropout, bootstrapped values always without.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from qrag.model.encoder import EncodeStats
from qrag.model.state_graphs import GraphedEncoder, shape_keyed

# Finer than the serving buckets: a training pass meets every length up to the state limit, and a
# coarse length bucket pads a whole batch of rows.
TRAIN_LENGTH_BUCKETS = (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)
TRAIN_BATCH_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class GraphedPasses:
    """One :class:`GraphedEncoder` per encoder module the learner runs without gradients."""

    def __init__(self, qnet, pad_id: int, device: torch.device, max_tokens: int):
        self.qnet, self.pad_id, self.device, self.max_tokens = qnet, pad_id, torch.device(device), max_tokens
        self._graphed: dict[int, GraphedEncoder] = {}

    def graphed(self, encoder: nn.Module) -> GraphedEncoder:
        key = id(encoder)  # the learner's encoders live as long as it does
        if key not in self._graphed:
            self._graphed[key] = GraphedEncoder(
                self.qnet,
                self.pad_id,
                self.device,
                encoder=encoder,
                batch_buckets=TRAIN_BATCH_BUCKETS,
                length_buckets=TRAIN_LENGTH_BUCKETS,
            )
        return self._graphed[key]

    @property
    def captured_shapes(self) -> int:
        return sum(len(g.captured_shapes) for g in self._graphed.values())

    @property
    def fallbacks(self) -> dict[str, str]:
        """Shapes whose capture failed (they run eagerly), with why."""
        graphed = enumerate(self._graphed.values())
        return {f"{i}:{shape}": why for i, g in graphed for shape, why in shape_keyed(g.fallbacks).items()}

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
        with stats.timing(self.device, kind):
            vectors = graphed.encode_sorted(seqs, self.max_tokens)
        stats.padded_tokens += graphed.padded_tokens - before
        stats.count(lengths)
        return vectors
