"""Tokenised episodes in a few flat arrays, for the trip from a runner to the learner.

A batch of a hundred episodes holds thousands of small token arrays; pickling each one costs
more than the data. Packed, a batch is four numpy arrays that Ray's object store hands to the
learner without copying, and unpacking makes views, not copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from qrag.data.tokens import TokenizedSample


@dataclass
class EpisodeBatch:
    ids: list[str]
    tokens: np.ndarray  # int32: every question, then its chunks, episode after episode
    seq_offsets: np.ndarray  # int64 [n_seqs + 1]: boundaries of the sequences in ``tokens``
    seq_counts: np.ndarray  # int64 [n_episodes]: sequences per episode (1 question + chunks)
    support: np.ndarray  # int64: support chunk indices, episode after episode
    support_counts: np.ndarray  # int64 [n_episodes]

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def pack(cls, episodes: Sequence[TokenizedSample]) -> EpisodeBatch:
        seqs = [seq for ep in episodes for seq in (ep.question, *ep.chunks)]
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
        offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.concatenate(seqs).astype(np.int32, copy=False) if seqs else np.zeros(0, np.int32)
        supports = [np.asarray(ep.support, dtype=np.int64) for ep in episodes]
        return cls(
            ids=[ep.id for ep in episodes],
            tokens=tokens,
            seq_offsets=offsets,
            seq_counts=np.array([1 + ep.n_chunks for ep in episodes], dtype=np.int64),
            support=np.concatenate(supports) if supports else np.zeros(0, np.int64),
            support_counts=np.array([len(s) for s in supports], dtype=np.int64),
        )

    def unpack(self) -> list[TokenizedSample]:
        out: list[TokenizedSample] = []
        seq, sup = 0, 0
        off, tok = self.seq_offsets, self.tokens
        for i, rid in enumerate(self.ids):
            n, k = int(self.seq_counts[i]), int(self.support_counts[i])
            views = [tok[off[j] : off[j + 1]] for j in range(seq, seq + n)]
            out.append(TokenizedSample(rid, views[0], views[1:], self.support[sup : sup + k]))
            seq, sup = seq + n, sup + k
        return out
