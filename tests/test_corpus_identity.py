"""Corpus identity (issue 32, high 4): an append, re-index or repair that started on one generation
of a corpus is refused (409) when the corpus was deleted and created again before it committed,
and leaves the new corpus as it was. The races are interleaved with a gate in the encoder, no
sleeps. Also: a re-index swaps models in one commit, so an interrupted one leaves the corpus at
its old model (no mixed segments re-embedded by queries) and a second one goes on where it stopped."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from qrag.config import ModelConfig
from qrag.data.documents import Document, DocumentChunk
from qrag.index.store import CorpusChanged, CorpusStore, listed_files
from qrag.retrieval.embedder import load_embedding_model, resolve_source
from qrag.serving.errors import ServiceError
from qrag.serving.service import local_service

from test_service_api import docs_json, loop, make_client, model, serve_cfg  # noqa: F401 (loop, model: fixtures)
from test_service_hardening import wait_job


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    from conftest import build_tiny_encoder

    return load_embedding_model(
        resolve_source(None, str(build_tiny_encoder(tmp_path_factory.mktemp("other"), seed=1))),
        "cpu",
        positions="relative",
    )


class Gate:
    """The service's encoder, with a gate: the first chunk embedding after :meth:`arm` waits (in a
    thread, so the event loop serves other requests) until the test calls :meth:`release`."""

    def __init__(self, inner):
        self.inner, self.armed = inner, False
        self.entered, self.released = threading.Event(), threading.Event()

    def arm(self) -> Gate:
        self.armed = True
        return self

    def release(self) -> None:
        self.released.set()

    async def embed_states(self, seqs):
        return await self.inner.embed_states(seqs)

    async def embed_chunks(self, seqs):
        if self.armed:
            self.armed = False
            self.entered.set()
            await asyncio.to_thread(self.released.wait, 60)
        return await self.inner.embed_chunks(seqs)


def recreate(client, docs, **settings) -> dict:
    """Delete corpus 'books' and create it again with ``docs``; its manifest as created."""
    assert client("DELETE", "/v1/corpora/books").status_code == 200
    r = client("POST", "/v1/corpora", json={"name": "books", "documents": docs, **settings})
    assert r.status_code == 201, r.text
    return client.service.store.read("books").__dict__.copy()


def assert_untouched(store: CorpusStore, created: dict) -> None:
    """The new corpus is what its create wrote: same manifest, every segment whole, no extra file."""
    m = store.read("books")
    assert m.uid == created["uid"] and m.batches == created["batches"] and m.reindex is None
    assert all(store.read_segment(m, s, b)[1] is None for b in m.batches for s in range(m.shards))
    on_disk = {f"{p.parent.name}/{p.name}" for p in store.path("books").glob("*/*") if p.is_file()}
    assert on_disk == listed_files(m)


def test_an_append_racing_delete_and_create_is_refused(model, tmp_path, loop):
    service = local_service(serve_cfg(tmp_path), model)
    client = make_client(service, loop)
    assert client("POST", "/v1/corpora", json={"name": "books", "documents": docs_json(2)}).status_code == 201
    gate = service.encoder = Gate(service.encoder).arm()
    r = client("POST", "/v1/corpora/books/documents", json={"documents": docs_json(4)[2:], "wait": False})
    assert r.status_code == 202 and gate.entered.wait(60)  # chunked with chunk_tokens 24, now embedding
    created = recreate(client, docs_json(2, seed=5), chunk_tokens=40)
    gate.release()
    job = wait_job(client, r.json()["job"]["id"])
    assert job["state"] == "failed" and job["error"]["status"] == 409 and job["error"]["field"] == "corpus", job
    assert "created again" in job["error"]["message"]
    assert_untouched(service.store, created)
    assert service.store.read("books").chunk_tokens == 40 and service.store.read("books").documents == 2
    assert client("POST", "/v1/retrieve", json={"corpus": "books", "question": "the painter"}).status_code == 200


def test_a_reindex_racing_delete_and_create_is_refused(model, tmp_path, loop):
    service = local_service(serve_cfg(tmp_path, shards=1), model)
    client = make_client(service, loop)
    assert client("POST", "/v1/corpora", json={"name": "books", "documents": docs_json(2)}).status_code == 201
    gate = service.encoder = Gate(service.encoder).arm()
    r = client("POST", "/v1/corpora/books/reindex", json={})
    assert r.status_code == 202 and gate.entered.wait(60)  # the old corpus's texts read, now embedding
    created = recreate(client, docs_json(2, seed=7))
    gate.release()
    job = wait_job(client, r.json()["job"]["id"])
    assert job["state"] == "failed" and job["error"]["status"] == 409 and "created again" in job["error"]["message"], (
        job
    )
    assert_untouched(service.store, created)


def test_a_repair_racing_delete_and_create_is_refused(model, tmp_path, loop):
    service = local_service(serve_cfg(tmp_path, shards=1), model)
    client = make_client(service, loop)
    assert client("POST", "/v1/corpora", json={"name": "books", "documents": docs_json(2)}).status_code == 201
    store = service.store
    m = store.read("books")
    vectors = store.path("books") / m.batches[0].shards[0].vectors.file
    vectors.write_bytes(vectors.read_bytes()[:-8])  # the retrieve repairs it from the stored texts
    gate = service.encoder = Gate(service.encoder).arm()
    answers: list = []
    ask = {"corpus": "books", "question": "the painter"}
    asking = threading.Thread(target=lambda: answers.append(client("POST", "/v1/retrieve", json=ask)))
    asking.start()
    assert gate.entered.wait(60)  # the repair has read the old corpus's texts, now embedding
    created = recreate(client, docs_json(2, seed=9))
    gate.release()
    asking.join(60)
    assert answers[0].status_code == 409 and answers[0].json()["error"]["field"] == "corpus", answers[0].text
    assert_untouched(store, created)
    assert client("POST", "/v1/retrieve", json=ask).status_code == 200


def test_every_write_of_the_store_checks_the_generation_it_started_on(tmp_path):
    store = CorpusStore(tmp_path)

    def corpus() -> str:
        m = store.create("c", fingerprint="fp", model=ModelConfig(), dim=4, chunk_tokens=8, shards=1)
        store.append(
            "c",
            [Document("a", "t")],
            [DocumentChunk("a", "t", 1)],
            [np.asarray([1], np.int32)],
            np.ones((1, 4), np.float32),
            "fp",
        )
        return m.uid

    old = corpus()
    store.begin_reindex("c", old, "fp2", 4, ModelConfig())
    store.delete("c")
    new = corpus()
    created = store.read("c").__dict__.copy()
    one = (
        [Document("b", "t")],
        [DocumentChunk("b", "t", 1)],
        [np.asarray([1], np.int32)],
        np.ones((1, 4), np.float32),
        "fp",
    )
    writes = {
        "append": lambda: store.append("c", *one, uid=old),
        "repair": lambda: store.replace_vectors(
            "c", 0, 1, np.ones((1, 4), np.float32), [np.asarray([1], np.int32)], "fp", uid=old
        ),
        "re-index": lambda: store.begin_reindex("c", old, "fp2", 4, ModelConfig()),
        "staging": lambda: store.stage_vectors(
            "c", old, "fp2", 0, 1, np.ones((1, 4), np.float32), [np.asarray([1], np.int32)]
        ),
        "swap": lambda: store.finish_reindex("c", old, "fp2"),
    }
    for what, write in writes.items():
        with pytest.raises(CorpusChanged, match="created again"):
            write()
        assert store.read("c").__dict__ == created, what
    store.append("c", *one, uid=new)  # the new generation's own writes go through


def test_an_interrupted_reindex_keeps_the_old_model_and_a_second_one_resumes(model, other_model, tmp_path, loop):
    cfg = serve_cfg(tmp_path)
    old = make_client(local_service(cfg, model), loop)
    assert old("POST", "/v1/corpora", json={"name": "books", "documents": docs_json(3)}).status_code == 201
    assert old("POST", "/v1/corpora/books/documents", json={"documents": docs_json(6)[3:]}).status_code == 200
    store = old.service.store
    segments = [(b.id, s) for b in store.read("books").batches for s in range(store.read("books").shards)]
    assert len(segments) == 4

    class DiesAfterOne:
        """An encoder that fails on its second chunk embedding, as a replica killed mid-job."""

        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        async def embed_states(self, seqs):
            return await self.inner.embed_states(seqs)

        async def embed_chunks(self, seqs):
            self.calls += 1
            if self.calls == 2:
                raise ServiceError(503, None, "the encoder went away")
            return await self.inner.embed_chunks(seqs)

    new_service = local_service(cfg, other_model)
    new_service.encoder = DiesAfterOne(new_service.encoder)
    new = make_client(new_service, loop)
    r = new("POST", "/v1/corpora/books/reindex", json={"wait": True})
    assert r.status_code == 503, r.text
    m = store.read("books")
    assert m.fingerprint == model.fingerprint and m.reindex.fingerprint == other_model.fingerprint
    staged = [(b.id, s) for b in m.batches for s, e in enumerate(b.shards) if e.next is not None]
    assert len(staged) == 1 and all(e.fingerprint == model.fingerprint for b in m.batches for e in b.shards)

    ask = {"corpus": "books", "question": "the painter", "max_steps": 2}
    embedded = (model.chunks_embedded, other_model.chunks_embedded)
    assert old("POST", "/v1/retrieve", json=ask).status_code == 200  # the old model's corpus, whole
    r = new("POST", "/v1/retrieve", json=ask)
    assert r.status_code == 409 and "re-index" in r.json()["error"]["message"], r.text
    assert (model.chunks_embedded, other_model.chunks_embedded) == embedded  # no query re-embedded a segment

    restarted = make_client(local_service(cfg, other_model), loop)
    r = restarted("POST", "/v1/corpora/books/reindex", json={"wait": True})
    assert r.status_code == 200 and r.json()["job"]["state"] == "done", r.text
    staged_chunks = next(e.chunks for b in m.batches for s, e in enumerate(b.shards) if (b.id, s) in staged)
    assert other_model.chunks_embedded - embedded[1] == m.chunks - staged_chunks  # only what was left
    m = store.read("books")
    assert m.fingerprint == other_model.fingerprint and m.reindex is None and m.dim == other_model.dim
    assert all(e.fingerprint == other_model.fingerprint and e.next is None for b in m.batches for e in b.shards)
    assert set(p.name for p in store.path("books").glob("shard_*/*.safetensors")) == {
        e.vectors.file.split("/")[1] for b in m.batches for e in b.shards
    }  # the old vectors are gone
    assert restarted("POST", "/v1/retrieve", json=ask).status_code == 200
    assert old("POST", "/v1/retrieve", json=ask).status_code == 409
