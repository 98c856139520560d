"""Issue 13 without Ray: keys and scopes, Host/Origin/Content-Type, inputs that used to end in a
500, job admission and job records that outlive replicas, atomic create, the shards' memory
budget, and metrics for every response."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import replace

import httpx
import pytest
import torch

from qrag.serving.auth import digest, key_table, parse_keys, startup_problem
from qrag.retrieval.embedder import load_embedding_model, resolve_source
from qrag.index.holder import ShardHolder, ShardOverBudget
from qrag.index.jobs import Job, JobBoard
from qrag.index.store import CorpusStore
from qrag.serving.errors import ServiceError
from qrag.serving.service import local_service

from test_index import make_documents
from test_service_api import LoopThread, docs_json, make_client, serve_cfg

READ, WRITE = "r" * 24, "w" * 24
KEYS = {digest(READ): "read", digest(WRITE): "write"}


@pytest.fixture(scope="module")
def model(tiny_encoder):
    return load_embedding_model(resolve_source(None, tiny_encoder), "cpu", positions="relative")


@pytest.fixture
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def wait_job(client, job_id: str, headers=None, timeout: float = 60) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = client("GET", f"/v1/jobs/{job_id}", headers=headers or {}).json()
        if job.get("state") in ("done", "failed"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} still {job}")


# -- who may do what ----------------------------------------------------------------------------


def test_keys_scopes_and_public_routes(model, tmp_path, loop):
    client = make_client(
        local_service(serve_cfg(tmp_path), model), loop, keys=KEYS, static={"index.html": b"<html></html>"}
    )
    create = {"name": "books", "documents": docs_json(2)}
    ask = {"corpus": "books", "question": "the painter"}
    r = client("POST", "/v1/corpora", json=create)
    assert (
        r.status_code == 401
        and r.headers["www-authenticate"] == "Bearer"
        and r.json()["error"]["field"] == "authorization"
    )
    assert client("POST", "/v1/corpora", json=create, headers=bearer("nope")).status_code == 401
    assert client("POST", "/v1/corpora", json=create, headers=bearer(READ)).status_code == 403
    assert client("POST", "/v1/corpora", json=create, headers={"authorization": WRITE}).status_code == 401  # not Bearer
    assert client("GET", "/v1/corpora").status_code == 401
    assert client("POST", "/v1/retrieve", json=ask).status_code == 401
    assert client("POST", "/v1/corpora", json=create, headers=bearer(WRITE)).status_code == 201
    assert client("POST", "/v1/retrieve", json=ask, headers=bearer(READ)).status_code == 200
    assert client("GET", "/v1/corpora", headers=bearer(READ)).status_code == 200
    for method, path in (
        ("DELETE", "/v1/corpora/books"),
        ("POST", "/v1/corpora/books/reindex"),
        ("POST", "/v1/corpora/books/documents"),
    ):
        r = client(method, path, headers=bearer(READ), **({"json": {}} if method == "POST" else {}))
        assert r.status_code == 403, (path, r.text)
    assert client("GET", "/healthz").status_code == 200 and client("GET", "/").status_code == 200
    assert client("GET", "/openapi.json").status_code == 200
    assert client("DELETE", "/v1/corpora/books", headers=bearer(WRITE)).status_code == 200


def test_key_lists_and_the_refusal_to_serve_publicly_without_keys(tmp_path):
    assert parse_keys(f"{READ}:read, {WRITE}:write", "x") == KEYS
    assert key_table(None, {"QRAG_API_KEYS": f"{WRITE}:write"}) == {digest(WRITE): "write"}
    for bad in ("Sekrit1", "Sekrit2:admin", ":read", "Sek rit3:read"):
        with pytest.raises(ValueError) as err:
            parse_keys(bad, "$QRAG_API_KEYS")
        assert "Sek" not in str(err.value)  # never echoes a key
    assert startup_problem("0.0.0.0", {}, False) and "QRAG_API_KEYS" in startup_problem("0.0.0.0", {}, False)
    assert startup_problem("0.0.0.0", KEYS, False) is None and startup_problem("0.0.0.0", {}, True) is None
    assert startup_problem("127.0.0.1", {}, False) is None and startup_problem("::1", {}, False) is None
    from qrag.cli import main

    with pytest.raises(SystemExit, match="without API keys"):  # before Ray starts
        main(["serve", "--host", "0.0.0.0", "--storage", str(tmp_path / "s")])


def test_content_type_host_origin_cors_and_page_headers(model, tmp_path, loop):
    client = make_client(local_service(serve_cfg(tmp_path), model), loop, static={"index.html": b"<html></html>"})
    body = json.dumps({"name": "books"}).encode()
    r = client("POST", "/v1/corpora", content=body)  # no Content-Type: a form or fetch() from any page
    assert r.status_code == 415 and r.json()["error"]["field"] == "content-type"
    for ctype in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
    ):
        assert client("POST", "/v1/corpora", content=body, headers={"content-type": ctype}).status_code == 415, ctype
    assert client("POST", "/v1/corpora/books/reindex").status_code == 415  # a bodiless POST too
    assert client("GET", "/v1/corpora", headers={"host": "evil.example:8000"}).status_code == 421
    assert client("GET", "/v1/corpora", headers={"host": "localhost:8000"}).status_code == 200
    r = client("POST", "/v1/corpora", json={"name": "x"}, headers={"origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["field"] == "origin"
    assert (
        client("POST", "/v1/corpora", json={"name": "x"}, headers={"origin": "http://127.0.0.1"}).status_code == 201
    )  # the page itself
    pre = client(
        "OPTIONS", "/v1/corpora", headers={"origin": "http://evil.example", "access-control-request-method": "POST"}
    )
    assert "access-control-allow-origin" not in pre.headers
    page = client("GET", "/")
    assert (
        "frame-ancestors 'none'" in page.headers["content-security-policy"]
        and page.headers["x-frame-options"] == "DENY"
    )
    assert page.headers["x-content-type-options"] == "nosniff"
    # Every answer says nosniff: the API's own, and the guards' refusals (HTML headers only on HTML).
    for r in (
        client("GET", "/v1/corpora"),
        client("GET", "/v1/corpora", headers={"host": "evil.example"}),
        client("GET", "/nowhere"),
    ):
        assert r.headers["x-content-type-options"] == "nosniff" and "content-security-policy" not in r.headers, (
            r.status_code
        )


def test_cors_only_for_configured_origins(model, tmp_path, loop):
    client = make_client(local_service(serve_cfg(tmp_path, cors_origins=["https://app.example"]), model), loop)
    pre = client(
        "OPTIONS", "/v1/corpora", headers={"origin": "https://app.example", "access-control-request-method": "POST"}
    )
    assert pre.headers.get("access-control-allow-origin") == "https://app.example"
    assert (
        client("POST", "/v1/corpora", json={"name": "x"}, headers={"origin": "https://app.example"}).status_code == 201
    )
    assert (
        client("POST", "/v1/corpora", json={"name": "y"}, headers={"origin": "https://other.example"}).status_code
        == 403
    )


def test_timeout_headers_are_stripped_and_the_deadline_holds(model, tmp_path, loop):
    from qrag.serving.http_api import Guard

    seen = {}

    async def slow(scope, receive, send):
        seen["headers"] = dict(scope["headers"])
        await asyncio.sleep(5)

    guard = Guard(slow, keys={}, allowed_hosts=["127.0.0.1"], cors_origins=[], timeout_s=0.2, retry_after_s=1)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://127.0.0.1") as c:
            return await c.get(
                "/v1/corpora", headers={"x-request-timeout-seconds": "0", "x-request-disconnect-disabled": "?1"}
            )

    t0 = time.perf_counter()
    r = loop.run(go())
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and time.perf_counter() - t0 < 3
    assert (
        b"x-request-timeout-seconds" not in seen["headers"] and b"x-request-disconnect-disabled" not in seen["headers"]
    )


# -- inputs that ended in a 500 -------------------------------------------------------------------


def test_inputs_that_were_500s_answer_4xx_naming_the_field(model, tmp_path, loop):
    client = make_client(local_service(serve_cfg(tmp_path), model), loop)
    assert client("POST", "/v1/corpora", json={"name": "books", "documents": docs_json(2)}).status_code == 201
    j = {"content-type": "application/json"}
    cases = [
        (
            "/v1/retrieve",
            f'{{"corpus": "books", "question": "q", "stop_threshold": 1{"0" * 400}}}',
            422,
            "stop_threshold",
        ),
        (
            "/v1/corpora/books/documents",
            r'{"documents": [{"id": "bad\ud800", "text": "A text."}]}',
            422,
            "documents[0].id",
        ),
        (
            "/v1/corpora/books/documents",
            r'{"documents": [{"id": "nul\u0000", "text": "A text."}]}',
            422,
            "documents[0].id",
        ),
        ("/v1/corpora", '{"name": "c1", "chunk_tokens": 511}', 422, "chunk_tokens"),
        ("/v1/corpora", '{"name": "c2", "chunk_tokens": 512}', 422, "chunk_tokens"),
        ("/v1/retrieve", '{"context": "Some text.", "question": "q", "chunk_tokens": 512}', 422, "chunk_tokens"),
        ("/v1/corpora", '{"name": "books\\n"}', 422, "name"),
        ("/v1/retrieve", '{"corpus": "books\\n", "question": "q"}', 422, "corpus"),
        (
            "/v1/corpora/books/documents",
            json.dumps({"documents": [{"id": "w", "text": "x" * 150_000}]}),
            422,
            "documents[0].text",
        ),
        ("/v1/retrieve", json.dumps({"context": "y" * 150_000, "question": "q"}), 422, "context"),
    ]
    for path, body, status, field in cases:
        r = client("POST", path, content=body.encode(), headers=j)
        assert r.status_code == status and r.json()["error"]["field"] == field, (body[:80], r.text)
    r = client("POST", "/v1/corpora", json={"name": "c3", "chunk_tokens": 511})
    assert "between 8 and 510" in r.json()["error"]["message"]  # MiniLM's 512 positions minus [CLS] and [SEP]
    assert (
        client("POST", "/v1/corpora", json={"name": "wide", "chunk_tokens": 510, "documents": docs_json(1)}).status_code
        == 201
    )


def test_too_many_documents_are_counted_before_parsing(model, tmp_path, loop, monkeypatch):
    import qrag.serving.http_api

    client = make_client(local_service(serve_cfg(tmp_path, max_body_bytes=2_000_000), model), loop)
    parsed = []
    monkeypatch.setattr(
        qrag.serving.http_api.CreateCorpus, "model_validate", classmethod(lambda cls, *a, **k: parsed.append(1))
    )
    tiny = {"name": "many", "documents": [{"id": str(i), "text": "a"} for i in range(3000)]}
    r = client("POST", "/v1/corpora", json=tiny)
    assert (
        r.status_code == 413
        and r.json()["error"]["field"] == "documents"
        and "before parsing" in r.json()["error"]["message"]
    )
    # commas inside strings are not documents
    monkeypatch.undo()
    r = client(
        "POST", "/v1/corpora", json={"name": "commas", "documents": [{"id": "d", "text": "a, " * 5000 + "end."}]}
    )
    assert r.status_code == 201, r.text


def test_corrupt_manifest_is_503_without_paths_and_can_be_deleted(model, tmp_path, loop):
    client = make_client(local_service(serve_cfg(tmp_path), model), loop)
    assert client("POST", "/v1/corpora", json={"name": "books", "documents": docs_json(2)}).status_code == 201
    assert client("POST", "/v1/corpora", json={"name": "other", "documents": docs_json(1)}).status_code == 201
    (tmp_path / "store" / "books" / "corpus.json").write_bytes(b'{"name": "books", "uid": ')
    for method, path, body in (
        ("GET", "/v1/corpora/books", None),
        ("POST", "/v1/retrieve", {"corpus": "books", "question": "q"}),
        ("POST", "/v1/corpora/books/documents", {"documents": docs_json(3)[2:]}),
    ):
        r = client(method, path, json=body) if body else client(method, path)
        assert r.status_code == 503 and r.json()["error"]["field"] == "corpus", r.text
        assert str(tmp_path) not in r.text
    assert [c["name"] for c in client("GET", "/v1/corpora").json()["corpora"]] == ["other"]
    assert client("DELETE", "/v1/corpora/books").status_code == 200
    health = client("GET", "/healthz").text
    assert str(tmp_path) not in health


def test_model_source_in_health_hides_server_paths():
    from qrag.serving.identity import public_source

    assert public_source("/srv/secret/runs/hotpot/best") == ".../hotpot/best"
    assert public_source("runs:/abc/checkpoint") == "runs:/abc/checkpoint" and public_source("minilm") == "minilm"


# -- jobs ------------------------------------------------------------------------------------------


class GatedEncoder:
    """The local encoder, held at a gate: jobs stay running until the test opens it."""

    def __init__(self, inner):
        self.inner, self.gate = inner, asyncio.Event()

    async def embed_states(self, seqs):
        return await self.inner.embed_states(seqs)

    async def embed_chunks(self, seqs):
        await self.gate.wait()
        return await self.inner.embed_chunks(seqs)


def test_admission_bounds_and_one_reindex_per_corpus(model, tmp_path, loop):
    service = local_service(serve_cfg(tmp_path, max_jobs_per_corpus=2, max_jobs=3, retry_after_s=2), model)
    client = make_client(service, loop)
    assert client("POST", "/v1/corpora", json={"name": "a", "documents": docs_json(1)}).status_code == 201
    assert client("POST", "/v1/corpora", json={"name": "b", "documents": docs_json(1)}).status_code == 201
    gated = service.encoder = GatedEncoder(service.encoder)
    more = docs_json(12, seed=4)
    r1 = client("POST", "/v1/corpora/a/documents", json={"documents": more[1:2], "wait": False})
    r2 = client("POST", "/v1/corpora/a/reindex", json={})
    assert r1.status_code == 202 and r2.status_code == 202
    r = client("POST", "/v1/corpora/a/documents", json={"documents": more[2:3], "wait": False})
    assert r.status_code == 429 and r.headers["retry-after"] == "2" and r.json()["error"]["field"] == "corpus"
    r = client("POST", "/v1/corpora/b/reindex", json={})
    assert r.status_code == 202
    r = client("POST", "/v1/corpora/b/reindex", json={})
    assert r.status_code == 409 and "re-indexed already" in r.json()["error"]["message"]  # one re-index per corpus
    r = client("POST", "/v1/corpora/b/documents", json={"documents": more[3:4], "wait": False})
    assert r.status_code == 429 and r.json()["error"]["field"] is None  # 3 jobs over all corpora
    loop.loop.call_soon_threadsafe(gated.gate.set)
    jobs = [r1.json()["job"]["id"], r2.json()["job"]["id"]]
    assert [wait_job(client, j)["state"] for j in jobs] == ["done", "done"]
    listed = client("GET", "/v1/corpora/a/jobs").json()["jobs"]
    assert {j["id"] for j in listed} >= set(jobs) and all(j["state"] == "done" for j in listed)
    assert client("POST", "/v1/corpora/a/documents", json={"documents": more[2:3], "wait": False}).status_code == 202


def test_jobs_are_answered_by_any_replica_and_after_a_restart(model, tmp_path, loop):
    cfg = serve_cfg(tmp_path)
    a = make_client(local_service(cfg, model), loop)
    assert a("POST", "/v1/corpora", json={"name": "books", "documents": docs_json(2)}).status_code == 201
    job = a("POST", "/v1/corpora/books/documents", json={"documents": docs_json(3)[2:], "wait": False}).json()["job"][
        "id"
    ]
    assert wait_job(a, job)["state"] == "done"
    b = make_client(local_service(cfg, model), loop)  # another replica, or the same after a restart
    assert b("GET", f"/v1/jobs/{job}").json()["state"] == "done"
    # A server killed mid-job left "running" records: one whose batch made it, one whose did not.
    board = JobBoard(tmp_path / "store")
    old = time.time() - 3600
    landed = Job("a" * 16, "books", "append", state="running", heartbeat=old, owner="gone")
    lost = Job("b" * 16, "books", "append", state="running", heartbeat=old, owner="gone")
    for j in (landed, lost):
        board.save(j)
        (board.root / "active" / f"{j.id}.json").write_text(json.dumps({**j.__dict__, "heartbeat": old}))
    store = CorpusStore(tmp_path / "store")
    m = store.read("books")
    m.batches[-1] = replace(m.batches[-1], job=landed.id)
    store._write_manifest(m)
    c = make_client(local_service(cfg, model), loop)
    assert c("GET", f"/v1/jobs/{landed.id}").json()["state"] == "done"
    lost_now = c("GET", f"/v1/jobs/{lost.id}").json()
    assert lost_now["state"] == "failed" and "interrupted" in lost_now["error"]["message"]
    assert b("GET", f"/v1/jobs/{lost.id}").json()["state"] == "failed"  # settled on disk, for everyone
    assert c("GET", "/v1/jobs/../../etc").status_code == 404 and c("GET", "/v1/jobs/" + "z" * 16).status_code == 404


class FailingEncoder:
    def __init__(self, inner, exc: BaseException):
        self.inner, self.exc = inner, exc

    async def embed_states(self, seqs):
        return await self.inner.embed_states(seqs)

    async def embed_chunks(self, seqs):
        raise self.exc


def test_every_job_ends_with_a_reason_and_create_is_atomic(model, tmp_path, loop):
    service = local_service(serve_cfg(tmp_path), model)
    client = make_client(service, loop)
    good = service.encoder
    # The encoder fails the way a GPU does (the local encoder maps it to 503, as Serve's does).
    service.encoder = FailingEncoder(
        good, ServiceError(503, None, "the encoder failed (OutOfMemoryError); retry", {"Retry-After": "1"})
    )
    r = client("POST", "/v1/corpora", json={"name": "books", "documents": docs_json(3)})
    assert r.status_code == 503 and "OutOfMemoryError" in r.text
    assert client("GET", "/v1/corpora/books").status_code == 404  # nothing visible, no empty corpus
    service.encoder = FailingEncoder(good, ValueError("a bug"))
    r = client("POST", "/v1/corpora", json={"name": "books", "documents": docs_json(3), "wait": False})
    assert r.status_code == 202 and r.json()["corpus"] is None
    failed = wait_job(client, r.json()["job"]["id"])
    assert (
        failed["state"] == "failed"
        and failed["error"]["message"] == "internal error: ValueError"
        and failed["finished"]
    )
    service.encoder = good
    assert (
        client("POST", "/v1/corpora", json={"name": "books", "documents": docs_json(3)}).status_code == 201
    )  # the retry is no 409
    assert client("GET", "/v1/corpora/books").json()["documents"] == 3
    # A wait:true request whose client goes away: the job goes on and ends done, the corpus whole.
    gated = service.encoder = GatedEncoder(good)

    async def cancelled_append():
        task = asyncio.ensure_future(service.append("books", docs_json(5)[3:], wait=True))
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        gated.gate.set()

    loop.run(cancelled_append())
    jobs = client("GET", "/v1/corpora/books/jobs").json()["jobs"]
    assert wait_job(client, jobs[0]["id"])["state"] == "done"
    assert client("GET", "/v1/corpora/books").json()["documents"] == 5


def test_local_encoder_failures_are_503(model, tmp_path, loop):
    from qrag.serving.backends import LocalEncoder

    class Boom:
        def embed_chunks(self, seqs):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(ServiceError) as err:
        loop.run(LocalEncoder(Boom()).embed_chunks([]))
    assert err.value.status == 503 and "OutOfMemoryError" in err.value.message


# -- memory ----------------------------------------------------------------------------------------


def test_shard_budget_evicts_least_recently_used_and_frees_on_delete(model, tmp_path, loop):
    from qrag.index.local import LocalIndex

    store = CorpusStore(tmp_path)
    index = LocalIndex(store, model)
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        index.create(name, chunk_tokens=24, shards=1)
        index.add_documents(name, make_documents(4, seed))
    one = ShardHolder(store, 0, 1, torch.device("cpu")).ensure("a", store.read("a").uid, 1).nbytes()
    holder = ShardHolder(store, 0, 1, torch.device("cpu"), memory_bytes=int(2.5 * one), sweep_s=0.0)
    for name in ("a", "b", "a", "c"):  # c pushes out b, the least recently used
        holder.ensure(name, store.read(name).uid, 1)
    assert list(holder.corpora) == ["a", "c"] and holder.evictions == 1 and holder.nbytes() <= 2.5 * one
    store.delete("c")
    holder.ensure("a", store.read("a").uid, 1)  # the sweep notices the deletion
    assert list(holder.corpora) == ["a"]
    small = ShardHolder(store, 0, 1, torch.device("cpu"), memory_bytes=one // 4)
    with pytest.raises(ShardOverBudget, match="shard_memory_bytes"):
        small.ensure("a", store.read("a").uid, 1)
    assert small.corpora == {}


def test_over_budget_is_507_and_delete_frees_the_shards(model, tmp_path, loop):
    service = local_service(serve_cfg(tmp_path, shard_memory_bytes=40_000), model)
    client = make_client(service, loop)
    assert client("POST", "/v1/corpora", json={"name": "small", "documents": docs_json(1)}).status_code == 201
    assert client("POST", "/v1/retrieve", json={"corpus": "small", "question": "q"}).status_code == 200
    assert sum(s.holder.stats()["corpora"] for s in service.holders) == len(service.holders)
    r = client("POST", "/v1/corpora", json={"name": "big", "documents": docs_json(40, seed=2)})
    assert r.status_code == 507 and "shard_memory_bytes" in r.json()["error"]["message"]
    assert client("GET", "/v1/corpora/big").status_code == 404
    assert client("DELETE", "/v1/corpora/small").status_code == 200
    assert all(s.holder.stats()["corpora"] == 0 and s.holder.stats()["bytes"] == 0 for s in service.holders)


def test_loading_a_corpus_does_not_block_queries_of_another(model, tmp_path):
    from qrag.index.local import LocalIndex

    store = CorpusStore(tmp_path)
    index = LocalIndex(store, model)
    for name in ("slow", "fast"):
        index.create(name, chunk_tokens=24, shards=1)
        index.add_documents(name, make_documents(3))
    holder = ShardHolder(store, 0, 1, torch.device("cpu"))
    holder.ensure("fast", store.read("fast").uid, 1)
    release, entered = threading.Event(), threading.Event()
    real = store.read_segment

    def stalled(m, shard, batch):
        if m.name == "slow":
            entered.set()
            release.wait(30)
        return real(m, shard, batch)

    store.read_segment = stalled
    loader = threading.Thread(target=holder.ensure, args=("slow", store.read("slow").uid, 1))
    loader.start()
    assert entered.wait(10)
    states = model.embed_states([model.tokenize_question("the king")])
    t0 = time.perf_counter()
    hits = holder.best_chunks("fast", store.read("fast").uid, 1, states, [[]], store.read("fast").chunks, 2)
    assert (
        hits.ids.shape == (1, 2) and time.perf_counter() - t0 < 5 and loader.is_alive()
    )  # answered while "slow" loads
    assert (
        holder.loaded("fast", store.read("fast").uid, 1) is not None
        and holder.loaded("slow", store.read("slow").uid, 1) is None
    )
    release.set()
    loader.join(30)
    assert set(holder.corpora) == {"slow", "fast"}


# -- metrics ---------------------------------------------------------------------------------------


def test_every_response_is_counted_with_its_route(model, tmp_path, loop):
    seen: list[tuple[str, int]] = []
    service = local_service(serve_cfg(tmp_path, max_body_bytes=1000), model)
    client = make_client(service, loop, keys=KEYS, on_request=lambda path, status, s: seen.append((path, status)))
    client("POST", "/v1/corpora", json={"name": "x"})  # 401 from the guard
    client("POST", "/v1/corpora", content=b"{}", headers=bearer(WRITE))  # 415
    client("POST", "/v1/corpora", json={"name": "y" * 2000}, headers=bearer(WRITE))  # 413 from BodyGuard
    client("GET", "/v1/corpora/nope", headers=bearer(READ))  # 404
    client("GET", "/nowhere", headers=bearer(READ))  # a path no route serves needs a key too: 404 with one

    service.list_corpora = lambda: (_ for _ in ()).throw(RuntimeError("bug"))
    r = client("GET", "/v1/corpora", headers=bearer(READ))
    assert r.status_code == 500 and "bug" not in r.text
    assert seen == [
        ("/v1/corpora", 401),
        ("/v1/corpora", 415),
        ("/v1/corpora", 413),
        ("/v1/corpora/{name}", 404),
        ("unmatched", 404),
        ("/v1/corpora", 500),
    ]


# -- failures of the storage and of the backends ---------------------------------------------------


def test_disk_full_and_delete_during_repair_are_not_500s(model, tmp_path, loop, monkeypatch):
    import errno

    import qrag.index.store

    service = local_service(serve_cfg(tmp_path), model)
    client = make_client(service, loop)
    assert client("POST", "/v1/corpora", json={"name": "books", "documents": docs_json(3)}).status_code == 201
    real = qrag.index.store.write_atomic

    def full(path, data, durable=True):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(qrag.index.store, "write_atomic", full)
    r = client("POST", "/v1/corpora/books/documents", json={"documents": docs_json(5)[3:]})
    assert r.status_code == 507 and "full" in r.json()["error"]["message"] and str(tmp_path) not in r.text
    job = client("GET", "/v1/corpora/books/jobs").json()["jobs"][0]
    assert job["state"] == "failed" and job["error"]["status"] == 507
    assert client("POST", "/v1/corpora", json={"name": "empty"}).status_code == 507
    monkeypatch.setattr(qrag.index.store, "write_atomic", real)
    assert client("GET", "/v1/corpora/books").json()["documents"] == 3

    # A shard file is corrupt; while the request repairs it, the corpus is deleted.
    store = service.store
    m = store.read("books")
    vec = store.path("books") / m.batches[0].shards[0].vectors.file
    vec.write_bytes(vec.read_bytes()[:-10])
    repair = service.corpora._reembed_segment

    async def deleted_meanwhile(m, shard, batch):
        await asyncio.to_thread(store.delete, "books")
        return await repair(m, shard, batch)

    service.corpora._reembed_segment = deleted_meanwhile
    r = client("POST", "/v1/retrieve", json={"corpus": "books", "question": "the painter"})
    assert r.status_code == 404 and r.json()["error"]["field"] == "corpus", r.text


def test_backend_failures_and_silence_are_503(loop):
    pytest.importorskip("ray")
    from ray.exceptions import RayActorError

    from qrag.distributed.serving import call_backend

    class Response:
        def __init__(self, outcome):
            self.outcome, self.cancelled = outcome, False

        def __await__(self):
            return self._run().__await__()

        async def _run(self):
            if self.outcome == "hang":
                await asyncio.sleep(30)
            raise self.outcome

        def cancel(self):
            self.cancelled = True

    class Method:
        def __init__(self, outcome):
            self.outcome, self.last = outcome, None

        def remote(self, *args):
            self.last = Response(self.outcome)
            return self.last

    for outcome, words in ((RayActorError(), "failed (RayActorError)"), ("hang", "did not answer within 0.2 s")):
        method = Method(outcome)
        with pytest.raises(ServiceError) as err:
            loop.run(call_backend(method, (), "the encoder", 0.2, 3))
        assert err.value.status == 503 and words in err.value.message and err.value.headers == {"Retry-After": "3"}
    assert method.last.cancelled  # a call that timed out is cancelled, not left running


def test_the_proxy_middleware_drops_timeout_headers(loop):
    pytest.importorskip("ray.serve")
    from starlette.middleware import Middleware

    from qrag.distributed.proxy_guard import middlewares

    [mw] = middlewares()  # Serve's proxy takes a list of starlette Middleware from the callback
    assert isinstance(mw, Middleware)
    seen = {}

    async def app(scope, receive, send):
        seen.update(dict(scope["headers"]))

    wrapped = mw.cls(app, *mw.args, **mw.kwargs)
    headers = [(b"x-request-timeout-seconds", b"0"), (b"X-Request-Disconnect-Disabled", b"?1"), (b"host", b"127.0.0.1")]
    loop.run(wrapped({"type": "http", "headers": headers}, None, None))
    assert seen == {b"host": b"127.0.0.1"}
    # The proxy loads it at start: without torch (seconds under load, and Serve kills a slow proxy).
    import subprocess
    import sys

    probe = "import sys, qrag.distributed.proxy_guard; sys.exit('torch' in sys.modules or 'ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 0


def test_a_late_heartbeat_never_revives_an_ended_job(tmp_path):
    board = JobBoard(tmp_path)
    job = Job("c" * 16, "books", "reindex", state="running")
    board.save(job)
    running = Job(**{**job.__dict__})
    job.state = "done"
    board.save(job)
    board.save(running)  # the heartbeat thread wrote its snapshot after the ending
    (board.root / "active" / f"{job.id}.json").write_text(json.dumps(running.__dict__))  # or just before it
    assert board.active() == [] and board.get(job.id).state == "done"
    assert not (board.root / "active" / f"{job.id}.json").exists()


def test_a_slow_wait_true_job_answers_202_before_the_deadline(model, tmp_path, loop):
    service = local_service(serve_cfg(tmp_path, job_wait_s=30.0, request_timeout_s=1.0), model)
    client = make_client(service, loop)
    assert client("POST", "/v1/corpora", json={"name": "books", "documents": docs_json(1)}).status_code == 201
    gated = service.encoder = GatedEncoder(service.encoder)
    r = client("POST", "/v1/corpora/books/documents", json={"documents": docs_json(3)[1:]})  # wait: true
    assert r.status_code == 202 and r.json()["job"]["state"] in ("queued", "running")  # not the deadline's 503
    loop.loop.call_soon_threadsafe(gated.gate.set)
    assert wait_job(client, r.json()["job"]["id"])["state"] == "done"
