"""The lockstep batcher: concurrent searches share each round's encoder call and scoring pass,
each gets exactly its own answer, and failures stay with the searches they belong to."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from qrag.config import SearchConfig
from qrag.data.tokens import TokenLayout
from qrag.index.local import LocalIndex
from qrag.index.store import CorpusStore
from qrag.retrieval.hits import ChunkRecord, ShardHits
from qrag.retrieval.multistep import SearchRun
from qrag.serving.batcher import LockstepBatcher
from qrag.serving.errors import ServiceError
from qrag.serving.retrieval import RetrieveParams
from qrag.serving.service import local_service

from test_index import make_documents
from test_service_api import model, serve_cfg  # noqa: F401 - fixtures

N_CHUNKS = 12
DIM = 4


def layout() -> TokenLayout:
    return TokenLayout(cls_id=1, sep_id=2, pad_id=0, max_state_tokens=64)


class CountingEncoder:
    """State vectors that encode the state's last token; records every call's batch size."""

    def __init__(self, in_process: bool = True, fail: bool = False):
        self.calls: list[int] = []
        self.fail = fail
        if in_process:
            self.embed_now = self._embed

    def _embed(self, seqs):
        self.calls.append(len(seqs))
        if self.fail:
            raise ServiceError(503, None, "the encoder failed (OutOfMemoryError); retry")
        return np.stack([np.full(DIM, float(s[-2]), np.float32) for s in seqs])

    async def embed_states(self, seqs):
        await asyncio.sleep(0)
        return self._embed(seqs)


class ScoreByDistance:
    """Chunk c scores -|c - (state's last token) - offset|; chosen chunks are excluded."""

    def __init__(self, offset: int = 1, in_process: bool = True, fail: bool = False):
        self.offset, self.fail, self.passes = offset, fail, []
        if in_process:
            self.score_now = self._score

    def _score(self, states, rows, selected, k):
        self.passes.append(len(states))
        if self.fail:
            raise RuntimeError("shard down")
        q = np.full((len(states), k), -np.inf, np.float32)
        ids = np.full((len(states), k), -1, np.int64)
        for r, (s, sel) in enumerate(zip(states, selected)):
            scores = [(-abs(c - s[0] - self.offset), c) for c in range(N_CHUNKS) if c not in sel]
            best = sorted(scores, key=lambda x: (-x[0], x[1]))[:k]
            q[r, : len(best)] = [b[0] for b in best]
            ids[r, : len(best)] = [b[1] for b in best]
        records = {
            int(c): ChunkRecord(f"d{c}", f"chunk {c}", np.array([1, 100 + c, 2], np.int32)) for c in ids[ids >= 0]
        }
        return [ShardHits(q, ids, None, records)]

    async def score(self, states, rows, selected, k):
        await asyncio.sleep(0)
        return self._score(states, rows, selected, k)


def run_of(first: int, steps: int = 3) -> SearchRun:
    return SearchRun(
        np.array([1, first, 2], np.int32), layout(), SearchConfig(max_steps=steps, alternatives=1), N_CHUNKS
    )


async def search_all(batcher, runs, backend_of, stagger: float = 0.0):
    async def one(i, run):
        await asyncio.sleep(stagger * i)
        await batcher.run(run, backend_of(i), backend_of(i))

    return await asyncio.gather(*(one(i, r) for i, r in enumerate(runs)), return_exceptions=True)


@pytest.mark.parametrize("in_process", [True, False])
def test_concurrent_searches_share_rounds_and_keep_their_own_answers(in_process):
    enc, backend = CountingEncoder(in_process), ScoreByDistance(in_process=in_process)
    batcher = LockstepBatcher(enc, max_states=64)
    runs = [run_of(q) for q in range(6)]
    solo = [run_of(q) for q in range(6)]
    assert all(r is None for r in asyncio.run(search_all(batcher, runs, lambda i: backend)))
    # Alone, each search gets the same picks.
    for run in solo:
        asyncio.run(
            LockstepBatcher(CountingEncoder(in_process), 64).run(run, ScoreByDistance(in_process=in_process), "k")
        )
    assert [r.result().selected for r in runs] == [r.result().selected for r in solo]
    # Six searches of three steps: three rounds of six states, one encoder call and one pass each.
    assert enc.calls == [6, 6, 6] and backend.passes == [6, 6, 6] and batcher.rounds == 3


def test_a_lone_search_runs_its_rounds_in_one_handoff_and_shared_rounds_hand_back_each():
    """Alone, a search's steps run back to back in the round thread (each hand-off is a thread
    switch and an event-loop wake); with others, every round goes back to the event loop."""
    lone = LockstepBatcher(CountingEncoder(), max_states=64)
    run = run_of(0, steps=3)
    asyncio.run(lone.run(run, ScoreByDistance(), "k"))
    assert len(run.result().steps) == 3 and lone.rounds == 3 and lone.handoffs == 1
    shared = LockstepBatcher(CountingEncoder(), max_states=64)
    asyncio.run(search_all(shared, [run_of(q) for q in range(4)], lambda i: ScoreByDistance()))
    assert shared.rounds == 3 and shared.handoffs == 3
    assert not lone._driving and not shared._driving


def test_a_late_search_joins_the_next_round_and_rows_are_bounded():
    enc, backend = CountingEncoder(in_process=False), ScoreByDistance(in_process=False)
    batcher = LockstepBatcher(enc, max_states=4)
    runs = [run_of(q, steps=2) for q in range(10)]
    out = asyncio.run(search_all(batcher, runs, lambda i: backend))
    assert all(r is None for r in out) and all(len(r.result().steps) == 2 for r in runs)
    assert max(enc.calls) <= 4 and sum(enc.calls) == 20  # every state embedded once, never more than 4 a round


def test_searches_of_different_corpora_share_the_encoder_not_the_pass():
    enc = CountingEncoder()
    near, far = ScoreByDistance(1), ScoreByDistance(3)
    batcher = LockstepBatcher(enc, max_states=64)
    runs = [run_of(0) for _ in range(4)]
    asyncio.run(search_all(batcher, runs, lambda i: near if i % 2 == 0 else far))
    assert enc.calls == [4, 4, 4] and near.passes == [2, 2, 2] and far.passes == [2, 2, 2]
    assert runs[0].result().selected != runs[1].result().selected  # each scored by its own corpus


def test_a_failed_pass_fails_only_its_corpus_and_a_failed_encoder_fails_its_round():
    batcher = LockstepBatcher(CountingEncoder(), max_states=64)
    good, bad = ScoreByDistance(), ScoreByDistance(fail=True)
    runs = [run_of(0), run_of(1)]
    out = asyncio.run(search_all(batcher, runs, lambda i: good if i == 0 else bad))
    assert out[0] is None and isinstance(out[1], RuntimeError) and len(runs[0].result().steps) == 3
    failing = LockstepBatcher(CountingEncoder(fail=True), max_states=64)
    out = asyncio.run(search_all(failing, [run_of(0), run_of(1)], lambda i: good))
    assert all(isinstance(e, ServiceError) and e.status == 503 for e in out)
    # The batcher goes on serving after failures.
    after = run_of(2)
    asyncio.run(batcher.run(after, good, "k"))
    assert len(after.result().steps) == 3


def test_an_abandoned_search_stops_taking_rounds():
    enc = CountingEncoder(in_process=False)
    batcher = LockstepBatcher(enc, max_states=64)

    async def go():
        slow = asyncio.ensure_future(batcher.run(run_of(0, steps=50), ScoreByDistance(in_process=False), "k"))
        await asyncio.sleep(0.01)
        slow.cancel()
        await asyncio.gather(slow, return_exceptions=True)
        rounds = batcher.rounds
        await asyncio.sleep(0.05)
        return rounds

    rounds = asyncio.run(go())
    assert batcher.rounds <= rounds + 1 and batcher.rounds < 50


def test_concurrent_service_requests_answer_as_offline_search(model, tmp_path):  # noqa: F811
    """Through the service, concurrent retrievals are batched and each equals the library's
    offline search of the same question."""
    store = CorpusStore(tmp_path / "store")
    index = LocalIndex(store, model)
    index.create("books", chunk_tokens=24, shards=2)
    index.add_documents("books", make_documents(6, 3))
    questions = ["the painter and the river", "who crossed the bridge", "a letter from the north", "the old mill"]
    cfg = SearchConfig(max_steps=3, alternatives=2)
    offline = [[s.chunk for s in index.retrieve("books", q, cfg)[0].steps] for q in questions]
    service = local_service(serve_cfg(tmp_path), model)
    assert service.holders[0].holder.preload() == ["books"]  # as a replica does at start

    async def all_at_once():
        return await asyncio.gather(
            *(
                service.retrieve(RetrieveParams(question=q, corpus="books", max_steps=3, alternatives=2))
                for q in questions
            )
        )

    answers = asyncio.run(all_at_once())
    assert [[s["chunk_id"] for s in a["steps"]] for a in answers] == offline
    assert service.batcher.rounds == 3 and service.encoder.forwards == 3  # one encoder call a step for all four


def test_warm_scoring_runs_every_shape_a_replica_serves(model, tmp_path):  # noqa: F811
    """What a GPU replica runs at start to capture its scoring graphs (here on the CPU: the same
    calls, eagerly): every batch bucket up to state_batch_size, every selected-set size."""
    from qrag.serving.warm_up import warm_holder

    store = CorpusStore(tmp_path / "store")
    index = LocalIndex(store, model)
    index.create("books", chunk_tokens=24, shards=2)
    index.add_documents("books", make_documents(4, 1))
    service = local_service(serve_cfg(tmp_path, state_batch_size=8, warm_steps=3), model)
    holder = service.holders[0].holder
    assert warm_holder(holder, service.cfg) == {
        "corpora": ["books"],
        "shapes": 0,
        "seconds": pytest.approx(0, abs=60),
    }  # CPU: no graphs
    assert holder.warm_scoring("books", 8, 2, 4) == 4 * 3  # buckets 1, 2, 4, 8; 0, 1 or 2 chunks selected


@pytest.mark.parametrize("in_process", [True, False])
def test_searches_arriving_at_any_moment_all_end(in_process):
    """Searches that arrive while the round thread is deciding to stop are never left waiting:
    exactly one driver runs at a time, and every search ends."""
    import random

    rng = random.Random(0)
    enc, backend = CountingEncoder(in_process), ScoreByDistance(in_process=in_process)
    batcher = LockstepBatcher(enc, max_states=8)

    async def one(i):
        await asyncio.sleep(rng.random() * 0.05)
        run = run_of(i % N_CHUNKS, steps=1 + i % 3)
        await batcher.run(run, backend, "k")
        return len(run.result().steps)

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(150))), 60)

    assert asyncio.run(main()) == [1 + i % 3 for i in range(150)]
    assert not batcher._driving and not batcher._active and not batcher._waiting
