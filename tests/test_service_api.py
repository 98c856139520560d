"""The HTTP API in one process (no Ray): corpora, retrieval, jobs, and bad input -> 4xx naming the field."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from qrag.config import SearchConfig
from qrag.retrieval.embedder import load_embedding_model, resolve_source
from qrag.serving.http_api import build_api
from qrag.index.local import LocalIndex
from qrag.serving.retrieval import RetrieveParams
from qrag.serving.service import local_service
from qrag.serving.service_config import ServeConfig

from test_index import make_documents


@pytest.fixture(scope="module")
def model(tiny_encoder):
    return load_embedding_model(resolve_source(None, tiny_encoder), "cpu", positions="relative")


class LoopThread:
    """One event loop for a test's requests, as a server has: background jobs keep running
    between requests (asyncio.run per request would cancel them)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        async def drain():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(drain())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def make_client(service, loop: LoopThread, keys=None, static=None, on_request=None, headers=None):
    api = build_api(service, static, on_request, keys)
    transport = httpx.ASGITransport(app=api)

    def call(method: str, path: str, **kw):
        async def go():
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", headers=headers or {}) as c:
                return await c.request(method, path, **kw)

        return loop.run(go())

    call.service, call.loop = service, loop
    return call


@pytest.fixture
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


def serve_cfg(tmp_path, **kw) -> ServeConfig:
    return ServeConfig(
        **{
            "storage": str(tmp_path / "store"),
            "shards": 2,
            "chunk_tokens": 24,
            "max_body_bytes": 200_000,
            "max_documents": 50,
            **kw,
        }
    )


@pytest.fixture
def client(model, tmp_path, loop):
    return make_client(local_service(serve_cfg(tmp_path), model), loop, static={"index.html": b"<html>page</html>"})


def docs_json(n=6, seed=0):
    return [{"id": d.id, "text": d.text} for d in make_documents(n, seed)]


def test_corpus_lifecycle_and_retrieval_match_the_library(client, model, tmp_path):
    r = client("POST", "/v1/corpora", json={"name": "books", "documents": docs_json(4)})
    assert r.status_code == 201, r.text
    assert r.json()["corpus"]["documents"] == 4 and r.json()["job"]["state"] == "done"
    r = client("POST", "/v1/corpora/books/documents", json={"documents": docs_json(6)[4:]})
    assert r.status_code == 200 and r.json()["corpus"]["documents"] == 6
    stats = client("GET", "/v1/corpora/books").json()
    assert stats["shards"] == 2 and stats["chunks"] > 6 and stats["tokens"] > 0 and stats["bytes"] > 0
    assert [c["name"] for c in client("GET", "/v1/corpora").json()["corpora"]] == ["books"]

    question = "who met the painter near the harbour"
    r = client("POST", "/v1/retrieve", json={"corpus": "books", "question": question, "max_steps": 3, "beam_width": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    ref, records, _ = LocalIndex(client.service.store, model).retrieve(
        "books", question, SearchConfig(max_steps=3, beam_width=2)
    )
    assert [s["chunk_id"] for s in body["steps"]] == ref.selected
    assert [s["q"] for s in body["steps"]] == pytest.approx([s.q for s in ref.steps], abs=1e-5)
    assert all(s["text"] == records[s["chunk_id"]].text and s["doc_id"].startswith("doc-") for s in body["steps"])
    assert set(body["timings"]) >= {"tokenize_ms", "encode_ms", "score_ms", "merge_ms", "total_ms"}
    # The beam's rule and temperature reach the search (the library's answer under the same ones).
    logprob = {"beam_score": "logprob", "beam_temperature": 0.5}
    r = client("POST", "/v1/retrieve", json={"corpus": "books", "question": question, "beam_width": 3, **logprob})
    assert r.status_code == 200, r.text
    assert r.json()["search"]["beam_score"] == "logprob" and r.json()["search"]["beam_temperature"] == 0.5
    ref, _, _ = LocalIndex(client.service.store, model).retrieve(
        "books", question, SearchConfig(beam_width=3, **logprob)
    )
    assert [s["chunk_id"] for s in r.json()["steps"]] == ref.selected
    searched = client.service.requests.check(RetrieveParams(question, corpus="books", beam_width=3, **logprob))
    assert (searched.beam_score, searched.beam_temperature) == ("logprob", 0.5)

    r = client("POST", "/v1/corpora/books/documents", json={"documents": docs_json(8)[7:], "wait": False})
    assert r.status_code == 202
    job = client("GET", f"/v1/jobs/{r.json()['job']['id']}").json()
    assert job["state"] in ("queued", "running", "done")
    assert client("DELETE", "/v1/corpora/books").json() == {"deleted": "books"}
    assert client("GET", "/v1/corpora/books").status_code == 404


def test_inline_context(client):
    context = " ".join(d["text"] for d in docs_json(3))
    r = client(
        "POST",
        "/v1/retrieve",
        json={"context": context, "question": "the castle of the queen", "max_steps": 2, "return_chunks": True},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["steps"]) == 2 and len(body["chunks"]) == body["n_chunks"]
    assert all(body["chunks"][s["chunk_id"]] == s["text"] for s in body["steps"])


BAD = [
    ({"corpus": "books", "question": ""}, 422, "question"),
    ({"corpus": "books", "question": "x" * 3000}, 422, "question"),
    ({"corpus": "nope", "question": "q"}, 404, "corpus"),
    ({"corpus": "books", "question": "q", "max_steps": 0}, 422, "max_steps"),
    ({"corpus": "books", "question": "q", "max_steps": 99}, 422, "max_steps"),
    ({"corpus": "books", "question": "q", "max_steps": "2"}, 422, "max_steps"),
    ({"corpus": "books", "question": "q", "beam_width": 2.5}, 422, "beam_width"),
    ({"corpus": "books", "question": "q", "beam_score": "mean"}, 422, "beam_score"),
    ({"corpus": "books", "question": "q", "beam_temperature": 0}, 422, "beam_temperature"),
    ({"corpus": "books", "question": "q", "beam_temperature": "hot"}, 422, "beam_temperature"),
    ({"corpus": "books", "question": "q", "beam_temperature": 5e-324}, 422, "beam_temperature"),
    ({"corpus": "books", "question": "q", "stop_threshold": "low"}, 422, "stop_threshold"),
    ({"corpus": "books", "question": 7}, 422, "question"),
    ({"corpus": "books"}, 422, "question"),
    ({"corpus": "books", "question": "q", "colour": 1}, 422, "colour"),
    ({"question": "q"}, 422, "corpus"),
    ({"corpus": "books", "context": "text", "question": "q"}, 422, "corpus"),
    ({"corpus": "books", "question": "bad \ud800"}, 422, "question"),
    ({"corpus": "../etc", "question": "q"}, 422, "corpus"),
    ({"context": "x" * 250_000, "question": "q"}, 413, "body"),
]


def test_bad_requests_get_4xx_naming_the_field(client):
    assert client("POST", "/v1/corpora", json={"name": "books", "documents": docs_json(2)}).status_code == 201
    for payload, status, field in BAD:
        r = client(
            "POST", "/v1/retrieve", content=json.dumps(payload).encode(), headers={"content-type": "application/json"}
        )
        assert r.status_code == status, (payload, r.text)
        assert r.json()["error"]["field"] == field, (payload, r.json())
    raw = [
        (b"{not json", 400, "body"),
        (b'{"question": "caf\xe9", "corpus": "books"}', 400, "body"),
        (b"[1, 2]", 422, "body"),
    ]
    for body, status, field in raw:
        r = client("POST", "/v1/retrieve", content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (body, r.text)
        assert field is None or r.json()["error"]["field"] == field
    corpus_bad = [
        ("POST", "/v1/corpora", {"name": "books"}, 409, "name"),
        ("POST", "/v1/corpora", {"name": "a b"}, 422, "name"),
        ("POST", "/v1/corpora", {"name": "x", "chunk_tokens": 2}, 422, "chunk_tokens"),
        ("POST", "/v1/corpora/books/documents", {"documents": [{"id": "d", "text": ""}]}, 422, "documents[0].text"),
        ("POST", "/v1/corpora/books/documents", {"documents": [{"id": "d", "body": "t"}]}, 422, "documents[0].text"),
        ("POST", "/v1/corpora/books/documents", {"documents": docs_json(1)}, 409, "documents"),
        ("POST", "/v1/corpora/books/documents", {"documents": docs_json(60, seed=3)}, 413, "documents"),
        ("POST", "/v1/corpora/nope/documents", {"documents": docs_json(1)}, 404, "corpus"),
        ("GET", "/v1/jobs/abc", None, 404, "job"),
    ]
    for method, path, payload, status, field in corpus_bad:
        r = client(method, path, json=payload) if payload is not None else client(method, path)
        assert r.status_code == status, (path, payload, r.text)
        assert r.json()["error"]["field"] == field, (path, r.json())
    # still serving
    assert client("POST", "/v1/retrieve", json={"corpus": "books", "question": "q"}).status_code == 200
    assert client("GET", "/healthz").json()["model"]["trained"] is False
    assert "UNTRAINED" in client("GET", "/healthz").json()["message"]
    assert client("GET", "/").text == "<html>page</html>"
    assert (
        client("GET", "/docs").status_code == 200 and "/v1/retrieve" in client("GET", "/openapi.json").json()["paths"]
    )


def restarted(client, model):
    """A fresh service on the same storage: what a restarted app sees."""
    service = local_service(client.service.cfg, model)
    api = build_api(service)

    def call(method: str, path: str, **kw):
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://127.0.0.1") as c:
                return await c.request(method, path, **kw)

        return asyncio.run(go())

    call.service = service
    return call


def test_corrupt_shard_is_rebuilt_from_its_texts_and_lost_texts_are_reported(client, model):
    assert client("POST", "/v1/corpora", json={"name": "books", "documents": docs_json(6)}).status_code == 201
    ask = {"corpus": "books", "question": "the castle of the queen", "max_steps": 3}
    before = client("POST", "/v1/retrieve", json=ask).json()["steps"]
    store = client.service.store
    m = store.read("books")
    seg = m.batches[0].shards[1]
    path = store.path("books") / seg.vectors.file
    path.write_bytes(path.read_bytes()[:-40])  # a truncated vectors file
    embedded = model.chunks_embedded
    client = restarted(client, model)
    r = client("POST", "/v1/retrieve", json=ask)
    assert r.status_code == 200, r.text
    assert [s["chunk_id"] for s in r.json()["steps"]] == [s["chunk_id"] for s in before]
    assert model.chunks_embedded - embedded == seg.chunks  # only that segment was re-embedded
    m = store.read("books")
    (store.path("books") / m.batches[0].shards[0].texts.file).write_text("tampered\n")
    r = restarted(client, model)("POST", "/v1/retrieve", json=ask)
    assert (
        r.status_code == 503
        and r.json()["error"]["field"] == "corpus"
        and "texts are lost" in r.json()["error"]["message"]
    )


def test_a_corpus_of_another_model_is_refused_until_reindexed(client, tiny_encoder, tmp_path):
    from conftest import build_tiny_encoder

    assert client("POST", "/v1/corpora", json={"name": "books", "documents": docs_json(4)}).status_code == 201
    other = load_embedding_model(resolve_source(None, str(build_tiny_encoder(tmp_path / "other", seed=1))), "cpu")
    cfg = ServeConfig(storage=str(client.service.store.root), shards=2, chunk_tokens=24)
    api = build_api(local_service(cfg, other))

    async def go(method, path, **kw):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://127.0.0.1") as c:
            if path.endswith("/reindex"):
                job = (await c.request(method, path, json={})).json()["job"]
                while job["state"] in ("queued", "running"):
                    await asyncio.sleep(0.05)
                    job = (await c.get(f"/v1/jobs/{job['id']}")).json()
                return job
            return await c.request(method, path, **kw)

    ask = {"corpus": "books", "question": "the ship", "max_steps": 2}
    r = asyncio.run(go("POST", "/v1/retrieve", json=ask))
    assert r.status_code == 409 and "reindex" in r.json()["error"]["message"]

    async def reindex_then_ask():
        job = await go("POST", "/v1/corpora/books/reindex")
        return job, await go("POST", "/v1/retrieve", json=ask)

    job, r = asyncio.run(reindex_then_ask())
    assert job["state"] == "done" and job["progress"] == 1.0
    assert r.status_code == 200 and len(r.json()["steps"]) == 2


def test_checkpoint_from_an_mlflow_run_uri(tiny_encoder, tmp_path):
    import torch
    from mlflow import MlflowClient

    from qrag.model.checkpoint import fingerprint, save_checkpoint, untrained_qnet
    from qrag.config import load_config

    cfg = load_config(None, [f"model.encoder={tiny_encoder}", "model.positions=absolute"])
    qnet, tok, _ = untrained_qnet(cfg.model, torch.device("cpu"))
    ckpt = save_checkpoint(tmp_path / "final", qnet, tok, cfg)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow = MlflowClient(tracking_uri=uri)
    exp = mlflow.create_experiment("serve-test", artifact_location=str(tmp_path / "mlruns"))
    run = mlflow.create_run(exp)
    mlflow.log_artifacts(run.info.run_id, str(ckpt), "checkpoint")
    source = resolve_source(f"runs:/{run.info.run_id}/checkpoint", cache_dir=tmp_path / "cache", tracking_uri=uri)
    loaded = load_embedding_model(source, "cpu")
    assert (
        loaded.fingerprint == fingerprint(ckpt) and loaded.model_cfg.positions == "absolute" and loaded.source.trained
    )


def test_qrag_serve_rejects_a_bad_checkpoint_before_starting_ray(tmp_path, capsys):
    from qrag.cli import main

    assert main(["serve", "--checkpoint", str(tmp_path / "missing"), "--storage", str(tmp_path / "s")]) == 2
    assert "checkpoint directory not found" in capsys.readouterr().err
    assert main(["serve", "shards=zero"]) == 2
    assert "shards" in capsys.readouterr().err
