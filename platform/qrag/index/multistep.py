"""The multi-step search over shards, and the timings of one retrieval.

A query step sends the state vector to every shard; each returns its top-k for the *global*
selected set (relative RoPE positions depend on it) and the caller merges. The merged top-k
feeds the beam logic of :class:`qrag.search.Retriever`, so greedy, beam and threshold stopping
give the answers of the offline search over the corpus read as one long context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from ..config import SearchConfig
from ..search import Retrieval, Retriever, _Beam, best_path
from ..tokens import TokenLayout
from .shards import ShardHits, merge_hits
from .store import ChunkRecord, StoreError


class SearchRun:
    """One question's search over sharded chunks: the beam logic of :class:`Retriever` fed by
    merged shard hits. Drive it with any transport (in-process shards, Serve handles)::

        while live := run.live():
            states = embed_states(run.states(live))
            run.advance(live, [shard.topk(states, run.selected(live), run.n_total, run.k) ...])
    """

    def __init__(self, question: np.ndarray, layout: TokenLayout, cfg: SearchConfig, n_total: int):
        if n_total < 1:
            raise StoreError("the corpus has no chunks")
        self.question, self.layout, self.cfg, self.n_total = question, layout, cfg, n_total
        self.width = max(1, cfg.beam_width)
        self.k = min(n_total, max(self.width, cfg.alternatives + 1))
        self.beams: list[_Beam] = [_Beam(0)]
        self.records: dict[int, ChunkRecord] = {}
        self.steps_done = 0

    def live(self) -> list[_Beam]:
        if self.steps_done >= self.cfg.max_steps:
            return []
        return [b for b in self.beams if not b.finished]

    def states(self, live: Sequence[_Beam]) -> list[np.ndarray]:
        return [self.layout.state(self.question, [self.records[i].tokens for i in sorted(b.chosen)]) for b in live]

    @staticmethod
    def selected(live: Sequence[_Beam]) -> list[list[int]]:
        return [sorted(b.chosen) for b in live]

    def advance(self, live: Sequence[_Beam], hits: Sequence[ShardHits]) -> None:
        merged = merge_hits(hits, self.k)
        self.records.update(merged.records)
        self.beams = Retriever._advance(self.beams, list(live), merged.q, merged.ids, merged.pos, self.cfg, self.width)
        self.steps_done += 1

    def result(self, sample_id: str = "", seconds: float = 0.0) -> Retrieval:
        best = best_path(self.beams)  # the offline search's rule and tie-break
        stopped = best.finished and len(best.steps) < min(self.cfg.max_steps, self.n_total)
        return Retrieval(sample_id, best.steps, stopped_early=stopped, seconds=seconds)


@dataclass
class Timings:
    """Seconds per stage of one retrieval."""

    tokenize: float = 0.0
    encode: float = 0.0
    score: float = 0.0
    merge: float = 0.0
    total: float = 0.0

    def as_ms(self) -> dict[str, float]:
        return {f"{k}_ms": round(v * 1000.0, 3) for k, v in asdict(self).items()}
