"""Issue 32, the HTTP side, without Ray: keys decided by the route reached under a path prefix
(uvicorn's root_path and Serve's route_prefix), repeated headers, the Origin's scheme, what
/healthz tells strangers, a body guard linear in the body and an event loop that keeps
answering while hostile bodies are handled, and the typed OpenAPI (issue 35 item 6)."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st

from qrag.client import ApiError, AsyncClient
from qrag.retrieval.embedder import load_embedding_model, resolve_source
from qrag.serving.auth import digest
from qrag.serving.http_api import build_api
from qrag.serving.http_guards import json_shape
from qrag.serving.service import local_service

from conftest import ROOT, free_ports
from test_service_api import docs_json, serve_cfg

sys.path.insert(0, str(ROOT / "bench"))
from fuzz_api import HOSTILE_NAMES, hostile_lags, hostile_requests  # noqa: E402

READ, WRITE = "read-key-" + "r" * 16, "write-key-" + "w" * 16
KEYS = {digest(READ): "read", digest(WRITE): "write"}
PREFIX = "/prefix"


@pytest.fixture(scope="module")
def model(tiny_encoder):
    return load_embedding_model(resolve_source(None, tiny_encoder), "cpu", positions="relative")


def keyed_app(model, tmp_path, **cfg):
    return build_api(local_service(serve_cfg(tmp_path, **cfg), model), keys=KEYS)


@contextmanager
def uvicorn_server(app, root_path: str = ""):
    """``app`` behind a real uvicorn on 127.0.0.1 (``root_path`` as ``--root-path`` sets it)."""
    [port] = free_ports(1)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, root_path=root_path, lifespan="off", log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def status_of(call: Awaitable) -> Awaitable[int]:
    async def run() -> int:
        try:
            await call
        except ApiError as err:
            return err.status
        return 200

    return run()


async def keys_by_route(client: Callable[[str | None], AsyncClient]) -> None:
    """Every write route refuses a request without a key (401) and with a read key (403), the
    document count is checked before parsing, and only the public routes are open."""
    stranger, reader, writer = client(None), client(READ), client(WRITE)
    docs = docs_json(2)
    for c, want in ((stranger, 401), (reader, 403)):
        assert await status_of(c.create_corpus("books", docs)) == want
        assert await status_of(c.append("books", docs)) == want
        assert await status_of(c.reindex("books")) == want
        assert await status_of(c.delete_corpus("books")) == want
    assert (
        await status_of(stranger.list_corpora()) == 401
        and await status_of(stranger.retrieve("q", corpus="books")) == 401
    )
    assert (await writer.create_corpus("books", docs)).corpus.documents == 2
    with pytest.raises(ApiError) as err:  # 60 documents where 50 are allowed: refused from the raw body
        await writer.append("books", docs_json(60, seed=3))
    assert err.value.status == 413 and err.value.field == "documents" and "before parsing" in err.value.message
    assert await status_of(stranger.delete_corpus("books")) == 401
    assert (await reader.retrieve("the painter", corpus="books")).steps
    assert (await stranger.health()).model_dump(exclude_unset=True) == {"status": "ok"}
    for c in (stranger, reader, writer):
        await c.aclose()


def test_keys_follow_the_route_under_uvicorn_root_path(model, tmp_path):
    with uvicorn_server(keyed_app(model, tmp_path), root_path=PREFIX) as url:
        asyncio.run(keys_by_route(lambda key: AsyncClient(url, key)))  # the proxy in front strips the prefix


def test_keys_follow_the_route_under_a_serve_route_prefix(model, tmp_path):
    # What Serve's proxy hands an app under route_prefix: root_path set, the path still prefixed.
    transport = httpx.ASGITransport(app=keyed_app(model, tmp_path), root_path=PREFIX)
    asyncio.run(keys_by_route(lambda key: AsyncClient("http://127.0.0.1" + PREFIX, key, transport=transport)))


def raw(
    app, method: str, path: str, headers: list[tuple[str, str]], body: bytes = b"", root_path: str = ""
) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, root_path=root_path), base_url="http://127.0.0.1"
        ) as c:
            return await c.request(method, path, headers=headers, content=body or None)

    return asyncio.run(go())


JSON = ("content-type", "application/json")


def test_repeated_host_and_authorization_headers_are_refused(model, tmp_path):
    app = keyed_app(model, tmp_path)
    body = json.dumps({"name": "books"}).encode()
    # Read key first, write key last: the last one used to win.
    both = [("authorization", f"Bearer {READ}"), ("authorization", f"Bearer {WRITE}"), JSON]
    r = raw(app, "POST", "/v1/corpora", both, body)
    assert r.status_code == 400 and r.json()["error"]["field"] == "authorization", r.text
    hosts = [("host", "evil.example"), ("host", "127.0.0.1"), ("authorization", f"Bearer {WRITE}"), JSON]
    r = raw(app, "POST", "/v1/corpora", hosts, body)
    assert r.status_code == 400 and r.json()["error"]["field"] == "host", r.text
    assert raw(app, "POST", "/v1/corpora", [("authorization", f"Bearer {WRITE}"), JSON], body).status_code == 201


def test_origin_is_compared_by_scheme_host_and_port(model, tmp_path):
    app = build_api(local_service(serve_cfg(tmp_path), model))

    def create(name: str, origin: str, *extra: tuple[str, str]) -> int:
        return raw(
            app, "POST", "/v1/corpora", [("origin", origin), JSON, *extra], json.dumps({"name": name}).encode()
        ).status_code

    assert create("a", "https://127.0.0.1") == 403  # the host matched, the scheme did not
    assert create("b", "http://127.0.0.1:8000") == 403  # nor the port (80)
    assert create("c", "http://127.0.0.1") == 201 and create("d", "HTTP://127.0.0.1:80") == 201
    assert create("e", "https://127.0.0.1", ("x-forwarded-proto", "https")) == 201  # the page behind a TLS proxy
    assert create("f", "null") == 403


def test_healthz_tells_strangers_only_that_it_runs(model, tmp_path):
    app = keyed_app(model, tmp_path)
    public = raw(app, "GET", "/healthz", [])
    assert public.status_code == 200 and public.json() == {"status": "ok"}
    detailed = raw(app, "GET", "/healthz", [("authorization", f"Bearer {READ}")]).json()
    assert detailed["model"]["trained"] is False and "UNTRAINED" in detailed["message"]
    assert raw(app, "GET", "/healthz", [("authorization", "Bearer wrong")]).status_code == 401
    unkeyed = build_api(local_service(serve_cfg(tmp_path / "open"), model))  # no keys: nothing to hide
    assert "model" in raw(unkeyed, "GET", "/healthz", []).json()


# -- the body -------------------------------------------------------------------------------------


def reference_shape(text: str) -> tuple[int, int]:
    """Commas, and , : [ { together, outside strings, one character at a time."""
    commas = marks = 0
    inside = escaped = False
    for ch in text:
        if inside:
            inside, escaped = (inside, False) if escaped else (ch != '"', ch == "\\")
        elif ch == '"':
            inside = True
        elif ch in ",:[{":
            marks, commas = marks + 1, commas + (ch == ",")
    return commas, marks


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet=st.sampled_from('ab,:[{"\\ \u00e9'), max_size=12),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(alphabet='k,:"\\', max_size=4), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(JSON_VALUES, st.integers(1, 9))
def test_json_shape_counts_structure_outside_strings(value, block):
    import qrag.serving.http_guards as guards

    text = json.dumps(value, ensure_ascii=False)
    saved, guards._BLOCK = guards._BLOCK, block  # tiny blocks: escapes and strings cut between blocks
    try:
        shape = json_shape(text.encode())
    finally:
        guards._BLOCK = saved
    assert (shape.commas, shape.marks) == reference_shape(text)


def test_the_body_scan_is_linear(model, tmp_path):
    app = keyed_app(model, tmp_path, max_body_bytes=2_000_000)
    headers = [("authorization", f"Bearer {WRITE}"), JSON]
    for n in (20_000, 600_000):  # an unterminated string of escaped quotes and commas: was quadratic
        body = b'{"name": "x", "documents": ["' + b'\\",' * n + b"]}"
        t0 = time.perf_counter()
        r = raw(app, "POST", "/v1/corpora", headers, body)
        assert r.status_code == 400 and time.perf_counter() - t0 < 5, (n, r.text)
    many = json.dumps({"name": "x", "documents": [{"id": str(i), "text": "a, b"} for i in range(5000)]}).encode()
    r = raw(app, "POST", "/v1/corpora", headers, many)
    assert r.status_code == 413 and r.json()["error"]["field"] == "documents"
    keys = json.dumps({"question": "q", "corpus": "books", **{f"k{i}": i for i in range(50_000)}}).encode()
    r = raw(app, "POST", "/v1/retrieve", headers, keys)
    assert (
        r.status_code == 413
        and r.json()["error"]["field"] == "body"
        and "before parsing" in r.json()["error"]["message"]
    )


@pytest.mark.parametrize("case", HOSTILE_NAMES)
def test_the_event_loop_answers_while_a_hostile_body_is_handled(model, tmp_path, case):
    app = keyed_app(model, tmp_path, max_body_bytes=32 * 2**20, max_documents=10_000)
    [result] = hostile_lags(app, {case: hostile_requests()[case]}, WRITE).values()
    assert result["status"] < 500, result
    assert result["worst_healthz_ms"] < 100, (
        f"{case}: /healthz waited {result['worst_healthz_ms']} ms ({result['status']})"
    )


# -- OpenAPI --------------------------------------------------------------------------------------


def test_openapi_declares_the_keys_and_every_answer(model, tmp_path):
    schema = raw(keyed_app(model, tmp_path), "GET", "/openapi.json", []).json()
    assert schema["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "An API key: 'Authorization: Bearer <key>' (read or write scope).",
    }
    for path, operations in schema["paths"].items():
        for method, op in operations.items():
            assert op["security"] == ([{}, {"bearer": []}] if path == "/healthz" else [{"bearer": []}]), (method, path)
            ok = [s for s in op["responses"] if s.startswith("2")]
            assert ok and "$ref" in op["responses"][ok[0]]["content"]["application/json"]["schema"], (method, path)
            assert op["responses"]["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    unkeyed = raw(build_api(local_service(serve_cfg(tmp_path / "open"), model)), "GET", "/openapi.json", []).json()
    assert "securitySchemes" not in unkeyed.get("components", {})
    docs = raw(keyed_app(model, tmp_path / "docs"), "GET", "/docs", [])
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
