"""One multi-step search driver over every scoring backend: chunk vectors in memory (evaluation),
shards held in this process (the library index), shard holders behind the async client interface
(the Serve ingress), and an inline context scored in a worker thread — the same steps for the same
question under greedy, beam search and a threshold stop."""

from __future__ import annotations

import asyncio

import pytest

from qrag.config import SearchConfig
from qrag.retrieval.embedder import load_embedding_model, resolve_source
from qrag.index.local import LocalIndex
from qrag.index.shards import ShardOptions
from qrag.index.store import CorpusStore
from qrag.serving.service import RetrieveParams, local_service
from qrag.serving.service_config import ServeConfig

from test_index import make_documents, offline

QUESTIONS = ["who met the painter near the harbour", "where is the castle of the queen"]


@pytest.fixture(scope="module", params=["relative", "none"])
def model(request, tiny_encoder):
    return load_embedding_model(resolve_source(None, tiny_encoder), "cpu", positions=request.param)


@pytest.fixture(scope="module")
def corpus(model, tmp_path_factory):
    """A 3-shard corpus (the service holds it with 2 holders: merges within and across them)."""
    root = tmp_path_factory.mktemp("store")
    index = LocalIndex(CorpusStore(root), model, options=ShardOptions(faiss="never"))
    index.create("c", chunk_tokens=24, shards=3)
    index.add_documents("c", make_documents(8))
    m = index.store.read("c")
    texts = sorted(r for b in m.batches for s in range(m.shards) for r in index.store.read_texts(m, s, b))
    service = local_service(ServeConfig(storage=str(root), shards=2, chunk_tokens=24, faiss="never"), model)
    return index, service, [t for _, _, t in texts]


def threshold_that_stops(model, chunks: list[str], question: str) -> float:
    """A threshold between two greedy Qs, so the search stops after some steps (or before any)."""
    q = [s.q for s in offline(model, chunks, question, SearchConfig(max_steps=4)).steps]
    j = next((j for j in range(1, len(q)) if q[j] < min(q[:j])), None)
    return (q[j] + min(q[:j])) / 2 if j is not None else q[0] + 1e-3


def served_steps(service, params: RetrieveParams) -> tuple[list[tuple], bool, list[str]]:
    body = asyncio.run(service.retrieve(params))
    steps = [
        (s["chunk_id"], s["q"], s["position"], [(a["chunk_id"], a["q"]) for a in s["alternatives"]])
        for s in body["steps"]
    ]
    return steps, body["stopped_early"], body.get("chunks", [])


def steps_of(retrieval) -> list[tuple]:
    return [(s.chunk, s.q, s.position, s.alternatives) for s in retrieval.steps]


def same_steps(got: list[tuple], ref: list[tuple]) -> None:
    """Same chunks and alternatives; Qs and positions up to float rounding (the in-memory search
    embeds the chunks in other batches than the index did)."""
    assert [s[0] for s in got] == [s[0] for s in ref]
    assert [[a for a, _ in s[3]] for s in got] == [[a for a, _ in s[3]] for s in ref]
    assert [s[1] for s in got] == pytest.approx([s[1] for s in ref], abs=1e-5)
    assert [s[2] for s in got] == pytest.approx([s[2] for s in ref], abs=1e-5)


@pytest.mark.parametrize("kind", ["greedy", "beam", "threshold"])
def test_every_backend_gives_the_same_steps(model, corpus, kind):
    index, service, chunks = corpus
    stopped = 0
    for question in QUESTIONS:
        cfg = {
            "greedy": SearchConfig(max_steps=3),
            "beam": SearchConfig(max_steps=3, beam_width=3),
            "threshold": SearchConfig(max_steps=4, stop_threshold=threshold_that_stops(model, chunks, question)),
        }[kind]
        memory = offline(model, chunks, question, cfg)
        library, _, _ = index.retrieve("c", question, cfg)
        params = dict(
            question=question,
            max_steps=cfg.max_steps,
            beam_width=cfg.beam_width,
            stop_threshold=cfg.stop_threshold,
            alternatives=cfg.alternatives,
        )
        served, served_stop, _ = served_steps(service, RetrieveParams(corpus="c", **params))
        same_steps(steps_of(library), steps_of(memory))
        assert served == steps_of(library)  # the same stored vectors and state encoder: bit for bit
        assert memory.stopped_early == library.stopped_early == served_stop
        stopped += memory.stopped_early

        # An inline context: chunked by the service, scored in a worker thread, vs in memory.
        context = " ".join(d.text for d in make_documents(3))
        inline, inline_stop, inline_chunks = served_steps(
            service, RetrieveParams(context=context, chunk_tokens=24, return_chunks=True, **params)
        )
        ref = offline(model, inline_chunks, question, cfg)
        same_steps(inline, steps_of(ref))
        assert inline_stop == ref.stopped_early
    assert kind != "threshold" or stopped > 0
