"""Concurrent searches stepped together: the library's lockstep rounds across requests.

A request hands its :class:`~qrag.retrieval.multistep.SearchRun` to the replica's
:class:`LockstepBatcher` and awaits its end. One driver task runs rounds while any search is
live: a round embeds the states of every live path of every search in **one** encoder call and
scores them with **one** pass per corpus version (searches of the same corpus share it, whatever
step each is at), then advances them all. A request that arrives mid-search joins at the next
round, so nothing waits for a batch to fill and nothing is split across batches.

Where the encoder and every backend of a round live in this process, the whole round (state
tokens, encoder, scoring, merge) runs in one worker thread: the event loop only parses requests
and writes answers. Backends behind handles (Shard deployments) are awaited instead; each is
called once per round with the rows of all searches.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from qrag.retrieval.hits import ShardHits
from qrag.retrieval.multistep import SearchRun, Timings, _Beam

log = logging.getLogger("qrag.batcher")


class StateEncoder(Protocol):
    async def embed_states(self, seqs: list[np.ndarray]) -> np.ndarray: ...


class Scoring(Protocol):
    """A corpus version's scoring backend (``rows``: each state row's search in the group); one
    whose work runs in this process also has ``score_now``, the same answer synchronously."""

    async def score(self, states: Any, rows: list[int], selected: list[list[int]], k: int) -> Sequence[ShardHits]: ...


@dataclass(eq=False)
class _Search:
    run: SearchRun
    backend: Scoring
    key: Hashable  # searches with equal keys are scored in one pass (same corpus version)
    timings: Timings
    done: asyncio.Future
    beams: list[_Beam] = field(default_factory=list)  # this round's live paths


@dataclass
class _Group:
    backend: Scoring
    searches: list[_Search]
    lo: int  # first state row of the group in the round
    hi: int


class LockstepBatcher:
    """Steps the searches of one replica together (see the module doc). ``max_states``: state
    rows per round; searches beyond it wait for the next round (a search's paths stay together)."""

    def __init__(self, encoder: StateEncoder, max_states: int = 64):
        self.encoder, self.max_states = encoder, max(1, max_states)
        self._waiting: list[_Search] = []
        self._active: list[_Search] = []
        self._lock = threading.Lock()  # the queues: the event loop adds, the round thread takes
        self._driving = False
        self._driver: asyncio.Task | None = None  # kept: the event loop holds tasks weakly
        self.rounds = 0  # rounds run (tests and /metrics read how much was shared)
        self.rows = 0  # state rows embedded over all rounds
        self.handoffs = 0  # times the rounds went to a worker thread and back

    async def run(self, run: SearchRun, backend: Scoring, key: Hashable, timings: Timings | None = None) -> None:
        """Step ``run`` to its end together with every other search of this replica."""
        loop = asyncio.get_running_loop()
        search = _Search(run, backend, key, timings or Timings(), loop.create_future())
        with self._lock:
            self._waiting.append(search)
            start, self._driving = not self._driving, True
        if start:
            self._driver = loop.create_task(self._drive(loop))
        await search.done

    # -- the driver -------------------------------------------------------------------------

    def _next_round(self, loop: asyncio.AbstractEventLoop) -> tuple[list[_Search], list[_Group]] | None:
        """Under the lock: admit waiting searches, settle ended ones, and the next round (None:
        nothing left: the driver stops, and the next search starts another)."""
        with self._lock:
            rows = sum(len(s.run.live()) for s in self._active)
            while self._waiting:  # oldest first, while the round has rows to spare (one search at least)
                need = len(self._waiting[0].run.live())
                if self._active and rows + need > self.max_states:
                    break
                self._active.append(self._waiting.pop(0))
                rows += need
            live = []
            for s in self._active:
                if s.done.done():  # the request went away (deadline, disconnect): stop its work
                    continue
                s.beams = s.run.live()
                if s.beams:
                    live.append(s)
                else:
                    _settle(loop, s.done, None)
            self._active = live
            if not live:
                if self._waiting:
                    return [], []
                self._driving = False
                return None
            return live, _groups(live)

    async def _drive(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while (nxt := self._next_round(loop)) is not None:
                live, groups = nxt
                if not live:
                    continue
                if self._in_process(groups):
                    self.handoffs += 1
                    self._fail(loop, await asyncio.to_thread(self._rounds_in_thread, live, groups))
                else:
                    self._fail(loop, await self._round_async(live, groups))
        except BaseException as exc:  # cancelled (shutdown), or a bug: never leave a request waiting
            with self._lock:
                pending, self._active, self._waiting, self._driving = self._active + self._waiting, [], [], False
            for s in pending:
                _settle(
                    loop, s.done, exc if isinstance(exc, Exception) else RuntimeError("the server is shutting down")
                )
            raise

    def _in_process(self, groups: list[_Group]) -> bool:
        return getattr(self.encoder, "embed_now", None) is not None and all(
            getattr(g.backend, "score_now", None) is not None for g in groups
        )

    def _fail(self, loop: asyncio.AbstractEventLoop, failures: list[tuple[list[_Search], Exception]]) -> None:
        with self._lock:
            for searches, exc in failures:
                for s in searches:
                    _settle(loop, s.done, exc)
                self._active = [s for s in self._active if s not in searches]

    def _rounds_in_thread(self, live: list[_Search], groups: list[_Group]) -> list[tuple[list[_Search], Exception]]:
        """A round, and the next ones while one search is all the replica has. With others, each
        round is handed back: between rounds the event loop takes the new requests (a worker thread
        running round after round kept the GIL from the requests' parsing and answering, and served
        fewer of them). Alone, a search's steps need no hand-off, each a thread switch and a wake."""
        while True:
            failures = self._round_or_fail(live, groups)
            if failures or (alone := self._next_round_alone()) is None:
                return failures
            live, groups = alone

    def _next_round_alone(self) -> tuple[list[_Search], list[_Group]] | None:
        """Under the lock: the next round of the replica's only search, or None (others wait, or
        it ended or was abandoned: the driver settles it)."""
        with self._lock:
            if self._waiting or len(self._active) != 1 or self._active[0].done.done():
                return None
            search = self._active[0]
            search.beams = search.run.live()
            if not search.beams:
                return None
            live = [search]
            return live, _groups(live)

    def _round_or_fail(self, live: list[_Search], groups: list[_Group]) -> list[tuple[list[_Search], Exception]]:
        try:
            return self._round_now(live, groups)
        except Exception as exc:  # noqa: BLE001 - the encoder failed: the round's searches fail with it
            return [(live, exc)]

    def _round_now(self, live: list[_Search], groups: list[_Group]) -> list[tuple[list[_Search], Exception]]:
        """A round in this (worker) thread: states, one encoder call, each group's pass, advance."""
        t0 = time.perf_counter()
        seqs = [x for s in live for x in s.run.states(s.beams)]
        vectors = self.encoder.embed_now(seqs)
        t1 = time.perf_counter()
        failures = []
        for g in groups:
            try:
                hits = g.backend.score_now(vectors[g.lo : g.hi], *_rows(g))
            except Exception as exc:  # noqa: BLE001 - this corpus's searches fail; the others go on
                failures.append((g.searches, exc))
                continue
            _advance(g, hits, t0, t1, time.perf_counter())
        self.rounds += 1
        self.rows += len(seqs)
        return failures

    async def _round_async(self, live: list[_Search], groups: list[_Group]) -> list[tuple[list[_Search], Exception]]:
        t0 = time.perf_counter()
        seqs = [x for s in live for x in s.run.states(s.beams)]
        try:
            vectors = await self.encoder.embed_states(seqs)
        except Exception as exc:  # noqa: BLE001 - the round's searches fail with it
            return [(live, exc)]
        t1 = time.perf_counter()
        answers = await asyncio.gather(
            *(g.backend.score(vectors[g.lo : g.hi], *_rows(g)) for g in groups), return_exceptions=True
        )
        t2 = time.perf_counter()
        failures = []
        for g, hits in zip(groups, answers):
            if isinstance(hits, BaseException):
                if not isinstance(hits, Exception):
                    raise hits
                failures.append((g.searches, hits))
            else:
                _advance(g, hits, t0, t1, t2)
        self.rounds += 1
        self.rows += len(seqs)
        return failures


def _settle(loop: asyncio.AbstractEventLoop, done: asyncio.Future, exc: BaseException | None) -> None:
    """End a search's wait from any thread (once: an abandoned one stays as it is)."""

    def settle() -> None:
        if not done.done():
            if exc is None:
                done.set_result(None)
            else:
                done.set_exception(exc)

    if _in_loop(loop):
        settle()
    else:
        loop.call_soon_threadsafe(settle)


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _groups(live: list[_Search]) -> list[_Group]:
    """The round's searches by scoring key, each group's state rows contiguous."""
    by_key: dict[Hashable, list[_Search]] = {}
    for s in live:
        by_key.setdefault(s.key, []).append(s)
    groups, lo = [], 0
    ordered = [s for searches in by_key.values() for s in searches]
    live[:] = ordered  # the rows of the round follow this order
    for searches in by_key.values():
        hi = lo + sum(len(s.beams) for s in searches)
        groups.append(_Group(searches[0].backend, searches, lo, hi))
        lo = hi
    return groups


def _rows(g: _Group) -> tuple[list[int], list[list[int]], int]:
    """(each row's search within the group, each row's selected chunks, the group's k)."""
    rows = [i for i, s in enumerate(g.searches) for _ in s.beams]
    selected = [sorted(b.chosen) for s in g.searches for b in s.beams]
    return rows, selected, max(s.run.k for s in g.searches)


def _advance(g: _Group, hits: Sequence[ShardHits], t0: float, t1: float, t2: float) -> None:
    lo = 0
    for s in g.searches:
        n = len(s.beams)
        s.run.advance(s.beams, [h.rows(lo, lo + n) for h in hits])
        lo += n
        s.timings.add_round(t0, t1, t2, time.perf_counter())
