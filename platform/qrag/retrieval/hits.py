"""What a scoring backend answers the search driver: each state row's top-k chunks (ids, Q,
positions) and the records of those chunks. Here, below both the driver and the shard index, so
that the index answers in the driver's terms without the driver importing the index."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class ChunkRecord:
    """What a caller needs of a chosen chunk: to show it and to put it into the next state."""

    doc_id: str
    text: str
    tokens: np.ndarray  # [CLS] chunk [SEP], int32


@dataclass
class ShardHits:
    """Top-k of one shard (or of several, merged) for each state row."""

    q: np.ndarray  # [B, k] float32, best first; -inf pads rows with fewer candidates
    ids: np.ndarray  # [B, k] int64 global positions (-1 for pads)
    pos: np.ndarray | None  # [B, k] float32 positions used in the rotation (None: positions off)
    records: dict[int, ChunkRecord] = field(default_factory=dict)

    def rows(self, lo: int, hi: int) -> ShardHits:
        """The hits of state rows [lo, hi) (records are shared, not filtered)."""
        return ShardHits(self.q[lo:hi], self.ids[lo:hi], None if self.pos is None else self.pos[lo:hi], self.records)

    @classmethod
    def empty(cls, rows: int, with_pos: bool) -> ShardHits:
        return cls(
            np.zeros((rows, 0), np.float32),
            np.zeros((rows, 0), np.int64),
            np.zeros((rows, 0), np.float32) if with_pos else None,
        )


def merge_hits(hits: Sequence[ShardHits], k: int) -> ShardHits:
    """The best ``k`` of every row over all shards (ties broken by position), padded with -inf."""
    # A shard (or holder) with nothing to score answers with zero columns and cannot know the
    # positions mode: it adds nothing, so it must not decide whether positions are merged.
    hits = [h for h in hits if h.q.shape[1]] or list(hits[:1])
    q = np.concatenate([h.q for h in hits], axis=1)
    ids = np.concatenate([h.ids for h in hits], axis=1)
    with_pos = hits[0].pos is not None
    pos = np.concatenate([h.pos for h in hits], axis=1) if with_pos else None
    rows, width = q.shape
    # Every row at once (a round merges the rows of many requests): best Q first, ties by position.
    order = np.lexsort((ids, -q), axis=-1)[:, :k]
    top_q = np.take_along_axis(q, order, axis=1)
    finite = np.isfinite(top_q)
    out_q = np.full((rows, k), -np.inf, np.float32)
    out_i = np.full((rows, k), -1, np.int64)
    out_p = np.zeros((rows, k), np.float32) if with_pos else None
    cols = min(k, width)
    out_q[:, :cols] = np.where(finite, top_q, -np.inf)
    out_i[:, :cols] = np.where(finite, np.take_along_axis(ids, order, axis=1), -1)
    if with_pos:
        out_p[:, :cols] = np.where(finite, np.take_along_axis(pos, order, axis=1), 0.0)
    records: dict[int, ChunkRecord] = {}
    keep = set(out_i[out_i >= 0].tolist())
    for h in hits:
        records.update({g: rec for g, rec in h.records.items() if g in keep})
    return ShardHits(out_q, out_i, out_p, records)
