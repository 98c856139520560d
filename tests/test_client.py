"""qrag.client (issue 35 item 6): every route through the blocking client against uvicorn and
the asyncio one in process, answers parsed into the service's models, errors as ApiError, and
retries that honour Retry-After within a bound (429 always, 503 only for calls that change
nothing)."""

from __future__ import annotations

import asyncio
import email.utils
import json
import time

import httpx
import pytest

from qrag.client import ApiError, AsyncClient, Client, RetryPolicy
from qrag.retrieval.embedder import load_embedding_model, resolve_source
from qrag.serving.api_models import CorpusSummary, Deleted, RetrieveAnswer

from test_http_hardening import READ, WRITE, keyed_app, uvicorn_server
from test_service_api import docs_json


@pytest.fixture(scope="module")
def model(tiny_encoder):
    return load_embedding_model(resolve_source(None, tiny_encoder), "cpu", positions="relative")


def test_every_route_through_the_blocking_client(model, tmp_path):
    with uvicorn_server(keyed_app(model, tmp_path)) as url, Client(url, WRITE) as c, Client(url, READ) as reader:
        assert c.health().model.trained is False
        created = c.create_corpus("books", docs_json(3), chunk_tokens=24)
        assert created.corpus.documents == 3 and created.job.state == "done"
        assert [s.name for s in reader.list_corpora().corpora] == ["books"]
        appended = c.append("books", docs_json(5)[3:], wait=False)
        assert c.wait_for_job(appended.job.id).state == "done"
        stats = reader.stats("books")
        assert stats.documents == 5 and stats.compatible and stats.chunks > 5
        assert {j.id for j in reader.corpus_jobs("books").jobs} >= {created.job.id, appended.job.id}
        answer = reader.retrieve("who met the painter", corpus="books", max_steps=2, beam_width=2)
        assert (
            isinstance(answer, RetrieveAnswer) and len(answer.steps) == 2 and answer.steps[0].doc_id.startswith("doc-")
        )
        inline = reader.retrieve("the castle", context=" ".join(d["text"] for d in docs_json(2)), return_chunks=True)
        assert inline.chunks and inline.corpus is None
        assert c.wait_for_job(c.reindex("books").job.id).state == "done"
        with pytest.raises(ApiError) as err:
            reader.delete_corpus("books")
        assert err.value.status == 403 and err.value.field == "authorization"
        assert c.delete_corpus("books") == Deleted(deleted="books")
        with pytest.raises(ApiError) as err:
            reader.stats("books")
        assert (err.value.status, err.value.field) == (404, "corpus")
        with pytest.raises(ApiError) as err:
            reader.retrieve("q", corpus="books", max_steps=99)
        assert (err.value.status, err.value.field) == (422, "max_steps")


def test_the_asyncio_client_in_process(model, tmp_path):
    transport = httpx.ASGITransport(app=keyed_app(model, tmp_path))

    async def go():
        async with AsyncClient("http://127.0.0.1", WRITE, transport=transport) as c:
            job = (await c.create_corpus("books", docs_json(2), wait=False)).job
            assert (await c.wait_for_job(job.id)).state == "done"
            [summary] = (await c.list_corpora()).corpora
            assert isinstance(summary, CorpusSummary) and summary.documents == 2
            answers = await asyncio.gather(
                *(c.retrieve(q, corpus="books") for q in ("the painter", "the ship", "a king"))
            )
            assert all(len(a.steps) == 2 for a in answers)
            assert (await c.job(job.id)).progress == 1.0
        async with AsyncClient("http://127.0.0.1", transport=transport) as stranger:
            with pytest.raises(ApiError) as err:
                await stranger.create_corpus("other")
            assert (err.value.status, err.value.field) == (401, "authorization")

    asyncio.run(go())


class Scripted:
    """A transport that answers from a script and records when each request came."""

    def __init__(self, *answers: httpx.Response):
        self.answers, self.times = list(answers), []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.times.append(time.monotonic())
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def busy(status: int, retry_after: str | None = None) -> httpx.Response:
    headers = {"retry-after": retry_after} if retry_after is not None else {}
    return httpx.Response(status, json={"error": {"status": status, "field": None, "message": "busy"}}, headers=headers)


def client_of(script: Scripted, **policy) -> Client:
    return Client("http://qrag.test", transport=httpx.MockTransport(script), retry=RetryPolicy(**policy))


def test_retries_honour_retry_after_within_a_bound():
    reads = Scripted(busy(429, "0"), busy(503, "0"), httpx.Response(200, json={"corpora": []}))
    assert client_of(reads).list_corpora().corpora == [] and len(reads.times) == 3
    # A write that got 503 may still go on (its job outlived the deadline): not sent again.
    writes = Scripted(busy(503, "0"), httpx.Response(201, json={"corpus": None, "job": None}))
    with pytest.raises(ApiError) as err:
        client_of(writes).create_corpus("books")
    assert err.value.status == 503 and len(writes.times) == 1
    # ... but 429 (nothing was admitted) is.
    admitted = Scripted(busy(429, "0"), httpx.Response(201, json={"corpus": None, "job": None}))
    assert client_of(admitted).create_corpus("books").job is None and len(admitted.times) == 2
    # Waits of Retry-After, stopped once they would pass max_wait_s in all.
    slow = Scripted(busy(503, "1"))
    t0 = time.monotonic()
    with pytest.raises(ApiError) as err:
        client_of(slow, max_wait_s=2.5, attempts=10).list_corpora()
    assert len(slow.times) == 3 and 1.9 < time.monotonic() - t0 < 4 and err.value.retry_after_s == 1
    assert all(b - a >= 0.99 for a, b in zip(slow.times, slow.times[1:]))
    # A Retry-After past the bound: the error at once, with the server's hint.
    never = Scripted(busy(429, "100"))
    with pytest.raises(ApiError) as err:
        client_of(never, max_wait_s=5).list_corpora()
    assert len(never.times) == 1 and err.value.retry_after_s == 100
    # An HTTP-date Retry-After in the past means now; a proxy's plain-text answer is an ApiError too.
    past = email.utils.formatdate(946684800, usegmt=True)  # 1 January 2000
    dated = Scripted(busy(503, past), httpx.Response(200, json={"corpora": []}))
    assert client_of(dated).list_corpora().corpora == [] and len(dated.times) == 2
    plain = Scripted(httpx.Response(502, text="Bad Gateway"))
    with pytest.raises(ApiError) as err:
        client_of(plain).list_corpora()
    assert (err.value.status, err.value.field, err.value.message) == (502, None, "Bad Gateway")


def test_the_client_sends_what_the_api_declares():
    seen: list[tuple[str, str, dict | None, str | None]] = []

    def record(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        seen.append((request.method, request.url.raw_path.decode(), body, request.headers.get("authorization")))
        return httpx.Response(200, json={"deleted": "a b"})

    c = Client("http://qrag.test", "k3y", transport=httpx.MockTransport(record))
    c.delete_corpus("a b")
    with pytest.raises(ValueError):  # the answer is no RetrieveAnswer
        c.retrieve("q", context="text", max_steps=3)
    assert seen == [
        ("DELETE", "/v1/corpora/a%20b", None, "Bearer k3y"),
        ("POST", "/v1/retrieve", {"question": "q", "context": "text", "max_steps": 3}, "Bearer k3y"),
    ]
