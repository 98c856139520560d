"""The one multi-step search: greedy, beam search over Q (Plan Q-RAG), and stopping when the best
available Q falls below a threshold, over any scoring backend.

A :class:`SearchRun` is one question's search. Runs step in lockstep (:func:`rounds`): a round
embeds the states of every live path of every run in one call, asks a scoring backend for each
state's top-k chunks, and advances every run. Backends differ only in where the chunk vectors
live — in memory for the contexts of evaluation (:class:`qrag.retrieval.search.ContextVectors`), in shards
held by this process (:class:`qrag.index.local.ShardsBackend`: the library index, an inline
context), or behind Serve handles (:class:`qrag.serving.backends.HoldersBackend`) — so every path of the
platform returns the same steps. :func:`search` and :func:`search_async` are the two transports
(the Serve ingress awaits its encoder and shards); the logic they drive lives here once.

Beam search keeps the ``beam_width`` best paths and returns the best-scoring one. How a path is
scored (``search.beam_score``) follows from what Q estimates: Q(s_t, a_t) is the expected return
of the whole episode from s_t (which holds the path's earlier picks) taking a_t, and the reward
comes only at the end. So for an exact Q every Q along a path estimates the value of that same
path, and the Bellman equation bounds the later ones by the earlier ones:
Q(s_t, a_t) = γ·V(s_{t+1}) ≥ γ·Q(s_{t+1}, a_{t+1}) (the soft value is at least the max).

* ``min`` (default): the lowest Q along the path. For an exact Q (γ ≈ 1) it is the Q of the last
  step, the path's own value; where the learned Q breaks the bound — a later step, in a state
  the policy rarely reaches (after a wrong pick), valued above what the earlier step promised —
  the earlier, better-trained estimate caps it.
* ``last``: the Q of the last step alone. It trusts exactly those off-policy over-estimates and
  measured far below greedy (docs/benchmarks.md, "Quality: HotpotQA and MuSiQue").
* ``logprob``: the path's log-probability under the policy π(a|s) = softmax(Q(s, ·)/τ)
  (``search.beam_temperature``), summed over its steps. This is what a supervised learner trains:
  its softmax leaves the level of Q free from state to state, so comparing Qs of different states
  (``min``, ``last``) compares numbers that were never made comparable, while each step's
  log-softmax is. Each step is normalised over its state's best ``LOGPROB_TOP_K`` available chunks
  (what a backend returns; at the learners' temperatures the rest holds no mass) and, with a
  ``stop_threshold``, the stop as one more option of Q = the threshold: a path that stops adds the
  stop's log-probability, so a stopped path and a longer one are compared on the same footing.

Ties go to the path whose last step has the higher Q (then to the better parent), so beam search
follows greedy's choice unless another path scores strictly higher. For T = 2 the greedy path is
always among the final candidates, so the returned path never scores below it. Chunks of equal Q
are ranked by position (:func:`qrag.index.shards.merge_hits`), whichever backend scored them.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from qrag.config import SearchConfig
from qrag.retrieval.hits import ShardHits, merge_hits
from qrag.retrieval.hits import ChunkRecord
from qrag.data.tokens import TokenLayout


@dataclass
class Step:
    chunk: int
    q: float
    position: float | None
    alternatives: list[tuple[int, float]]  # the best other candidates at this step


@dataclass
class Retrieval:
    sample_id: str
    steps: list[Step]
    stopped_early: bool = False  # a Q threshold ended it before max_steps
    seconds: float = 0.0

    @property
    def selected(self) -> list[int]:
        return [s.chunk for s in self.steps]


LOGPROB_TOP_K = 32  # candidates per state that normalise a ``logprob`` step


class QBound:
    """``min`` and ``last``: a path scores by the Qs along it (``combine(parent, q)``); the empty
    path scores +inf, and a path that ends keeps its score. A state's other candidates do not
    count: ``prepare`` has nothing to compute."""

    start = float("inf")

    def __init__(self, combine: Callable[[float, float], float]):
        self.combine = combine

    def prepare(self, q: np.ndarray, finite: np.ndarray, stop: float | None) -> None:
        return None

    def extend(self, parent: float, q: float, prepared: None) -> float:
        return self.combine(parent, q)

    def end(self, parent: float, prepared: None, stop: float | None) -> float:
        return parent


class LogProb:
    """``logprob``: the sum of the steps' log π(a|s) = Q/τ − logsumexp over the state's candidates
    (its finite top-k Qs, and the stop's Q where there is a threshold): ``prepare`` takes that
    normaliser once per state, None where the state has no candidate."""

    start = 0.0

    def __init__(self, temperature: float):
        if not temperature > 0:
            raise ValueError(f"search.beam_temperature must be > 0, got {temperature}")
        self.tau = temperature

    def prepare(self, q: np.ndarray, finite: np.ndarray, stop: float | None) -> float | None:
        if not finite.any():
            return None
        row_q = q[finite]
        logits = (row_q if stop is None else np.append(row_q, stop)) / self.tau
        top = float(logits.max())
        return top + float(np.log(np.exp(logits - top).sum()))

    def extend(self, parent: float, q: float, log_norm: float) -> float:
        return parent + q / self.tau - log_norm

    def end(self, parent: float, log_norm: float | None, stop: float | None) -> float:
        if stop is None or log_norm is None:  # out of chunks: nothing else was possible
            return parent
        return parent + stop / self.tau - log_norm


# How a path's score follows from its parent's and its new last step (or its end).
BEAM_SCORES = {
    "min": lambda cfg: QBound(min),
    "last": lambda cfg: QBound(lambda parent, q: q),
    "logprob": lambda cfg: LogProb(cfg.beam_temperature),
}


def beam_rule(cfg: SearchConfig) -> QBound | LogProb:
    if cfg.beam_score not in BEAM_SCORES:
        raise ValueError(f"search.beam_score must be one of {', '.join(BEAM_SCORES)}, got {cfg.beam_score!r}")
    return BEAM_SCORES[cfg.beam_score](cfg)


@dataclass
class _Beam:
    steps: list[Step] = field(default_factory=list)
    score: float = float("inf")  # the rule's start for the empty path (SearchRun sets it)
    finished: bool = False

    @property
    def chosen(self) -> frozenset[int]:
        return frozenset(s.chunk for s in self.steps)


def _rank(beam: _Beam) -> tuple[float, float]:
    """Sort key, best first: the path's score, then the Q of its last step."""
    return (-beam.score, -(beam.steps[-1].q if beam.steps else float("inf")))


class SearchRun:
    """One question's search: its paths, and how a round's top-k hits advance them.

    ``chunks`` are the context's chunk tokens when the caller holds them (evaluation); without
    them a chosen chunk's tokens come from the records the shards return with their hits.
    """

    def __init__(
        self,
        question: np.ndarray,
        layout: TokenLayout,
        cfg: SearchConfig,
        n_total: int,
        chunks: Sequence[np.ndarray] | None = None,
    ):
        self.question, self.layout, self.cfg, self.n_total, self.chunks = question, layout, cfg, n_total, chunks
        self.rule = beam_rule(cfg)
        self.width = max(1, cfg.beam_width)
        normalising = LOGPROB_TOP_K if isinstance(self.rule, LogProb) and self.width > 1 else 0
        self.k = min(n_total, max(self.width, cfg.alternatives + 1, normalising))
        self.beams: list[_Beam] = [_Beam(score=self.rule.start)]
        self.records: dict[int, ChunkRecord] = {}
        self.steps_done = 0

    def live(self) -> list[_Beam]:
        if self.steps_done >= self.cfg.max_steps:
            return []
        return [b for b in self.beams if not b.finished]

    def _tokens(self, g: int) -> np.ndarray:
        return self.chunks[g] if self.chunks is not None else self.records[g].tokens

    def states(self, live: Sequence[_Beam]) -> list[np.ndarray]:
        return [self.layout.state(self.question, [self._tokens(i) for i in sorted(b.chosen)]) for b in live]

    def advance(self, live: Sequence[_Beam], hits: Sequence[ShardHits]) -> None:
        """Expand the live paths by their best chunks (rows of ``hits`` follow ``live``); keep the
        ``width`` best paths."""
        merged = merge_hits(hits, self.k)
        self.records.update(merged.records)
        cfg, stop = self.cfg, self.cfg.stop_threshold
        candidates = [b for b in self.beams if b.finished]
        for row, b in enumerate(live):
            q, ids = merged.q[row], merged.ids[row]
            finite = np.isfinite(q)
            prepared = self.rule.prepare(q, finite, stop)
            # No chunk left, or even the best one is below the threshold: the path ends here.
            if not finite.any() or (stop is not None and q[0] < stop):
                candidates.append(_Beam(b.steps, self.rule.end(b.score, prepared, stop), True))
                continue
            for j in range(min(self.width, int(finite.sum()))):
                qj = float(q[j])
                if stop is not None and qj < stop:
                    break
                alts = [(int(ids[a]), float(q[a])) for a in range(len(ids)) if a != j and finite[a]]
                pos = None if merged.pos is None else float(merged.pos[row][j])
                step = Step(int(ids[j]), qj, pos, alts[: cfg.alternatives])
                candidates.append(_Beam([*b.steps, step], self.rule.extend(b.score, qj, prepared)))
        kept: list[_Beam] = []
        seen: set[frozenset[int]] = set()
        for cand in sorted(candidates, key=_rank):  # stable: equal keys keep the parents' order
            if cand.chosen not in seen:
                seen.add(cand.chosen)
                kept.append(cand)
                if len(kept) >= self.width:
                    break
        self.beams = kept
        self.steps_done += 1

    def result(self, sample_id: str = "", seconds: float = 0.0) -> Retrieval:
        best = min(self.beams, key=_rank)
        stopped = best.finished and len(best.steps) < min(self.cfg.max_steps, self.n_total)
        return Retrieval(sample_id, best.steps, stopped_early=stopped, seconds=seconds)


class ScoringBackend(Protocol):
    """What the search driver scores with: ``score`` gives each state row's best ``k`` chunks. Row
    r belongs to run ``rows[r]`` of the round (backends that hold one context per run use it; a
    corpus shared by all runs ignores it); ``selected[r]`` are its path's chosen global positions,
    sorted. Returns one :class:`ShardHits` per shard (or shard holder); the driver merges them.
    Implementations: ``ShardsBackend`` (qrag.index.local), ``ContextVectors`` (qrag.retrieval.search),
    and, awaited, ``HoldersBackend`` and ``InlineBackend`` (qrag.serving.backends)."""

    def score(self, states: Any, rows: list[int], selected: list[list[int]], k: int) -> Sequence[ShardHits]: ...


class AsyncScoringBackend(Protocol):
    """:class:`ScoringBackend` for :func:`search_async`: ``score`` is awaited (a backend whose work
    runs in this process may also offer ``score_now``, the same answer synchronously)."""

    async def score(self, states: Any, rows: list[int], selected: list[list[int]], k: int) -> Sequence[ShardHits]: ...


@dataclass
class Round:
    """One lockstep step of several runs: the states to embed and score, then :meth:`advance`."""

    live: list[tuple[int, SearchRun, list[_Beam]]]  # (run index, run, its live paths)

    @property
    def seqs(self) -> list[np.ndarray]:
        return [s for _, run, beams in self.live for s in run.states(beams)]

    @property
    def rows(self) -> list[int]:
        return [i for i, _, beams in self.live for _ in beams]

    @property
    def selected(self) -> list[list[int]]:
        return [sorted(b.chosen) for _, _, beams in self.live for b in beams]

    @property
    def k(self) -> int:
        return max(run.k for _, run, _ in self.live)

    def advance(self, hits: Sequence[ShardHits]) -> None:
        lo = 0
        for _, run, beams in self.live:
            run.advance(beams, [h.rows(lo, lo + len(beams)) for h in hits])
            lo += len(beams)


def rounds(runs: Sequence[SearchRun]) -> Iterator[Round]:
    """The rounds of ``runs`` until none has a live path (advance each round before the next)."""
    while True:
        live = [(i, run, beams) for i, run in enumerate(runs) for beams in [run.live()] if beams]
        if not live:
            return
        yield Round(live)


@dataclass
class Timings:
    """Seconds per stage of one retrieval."""

    tokenize: float = 0.0
    encode: float = 0.0
    score: float = 0.0
    merge: float = 0.0
    total: float = 0.0

    def add_round(self, t0: float, t1: float, t2: float, t3: float) -> None:
        """A round that embedded over [t0, t1), scored over [t1, t2) and merged over [t2, t3)."""
        self.encode += t1 - t0
        self.score += t2 - t1
        self.merge += t3 - t2

    def as_ms(self) -> dict[str, float]:
        return {f"{k}_ms": round(v * 1000.0, 3) for k, v in asdict(self).items()}


def search(
    runs: Sequence[SearchRun],
    embed: Callable[[list[np.ndarray]], Any],
    backend: ScoringBackend,
    timings: Timings | None = None,
) -> None:
    """Run ``runs`` to the end in this thread: ``embed`` maps state token ids to state vectors."""
    for r in rounds(runs):
        t0 = time.perf_counter()
        states = embed(r.seqs)
        t1 = time.perf_counter()
        hits = backend.score(states, r.rows, r.selected, r.k)
        t2 = time.perf_counter()
        r.advance(hits)
        if timings is not None:
            timings.add_round(t0, t1, t2, time.perf_counter())


async def search_async(
    runs: Sequence[SearchRun],
    embed: Callable[[list[np.ndarray]], Awaitable[Any]],
    backend: AsyncScoringBackend,
    timings: Timings | None = None,
) -> None:
    """:func:`search` for an event loop: the encoder and the backend are awaited."""
    for r in rounds(runs):
        t0 = time.perf_counter()
        states = await embed(r.seqs)
        t1 = time.perf_counter()
        hits = await backend.score(states, r.rows, r.selected, r.k)
        t2 = time.perf_counter()
        r.advance(hits)
        if timings is not None:
            timings.add_round(t0, t1, t2, time.perf_counter())
