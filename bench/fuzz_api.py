"""Property-based fuzzing of the HTTP API, driven by its own OpenAPI schema, against a server
with API keys in this process (issue 32 item 5).

Hypothesis draws requests for every operation of ``/openapi.json``: bodies built from the
operation's schema (valid, nearly valid, or with unknown fields), raw and hostile bodies (not
JSON, not UTF-8, deep nesting, thousands of keys, escaped quotes), odd path parameters, and
headers without a key, with a read key, a write key, an unknown key, repeated keys, foreign
Hosts and Origins and other Content-Types; a third of them reach the app mounted under a path
prefix, as Serve's ``route_prefix`` mounts it. Every answer is checked: no 5xx; no write accepted
without a write key; errors in the ``{"error": {status, field, message}}`` shape; 2xx answers
that parse as the route's declared model. After the run, nothing acknowledged is lost: a
corpus created before the run answers as before, and every corpus the fuzzer's writes created
(and did not delete) still holds at least the documents acknowledged. A probe in the server's
event loop records how late it ran (the loop lag).

CPU check (what CI runs, through tests/test_fuzz_api.py, with a fixed seed):
    python bench/fuzz_api.py --examples 100
The long run whose counts are in bench/results/fuzz_api_cpu.json (``--hostile``: also the
slowest /healthz answer while each hostile or large body of issue 32 is handled):
    python bench/fuzz_api.py --examples 3000 --seed 32 --hostile --out bench/results/fuzz_api_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from qrag.serving import api_models

READ_KEY, WRITE_KEY = "fuzz-read-" + "r" * 20, "fuzz-write-" + "w" * 20
SENTINEL = "sentinel-corpus-7f3a"  # created before the run; no name the fuzzer draws
TARGETS = ("books", "fuzz")  # kept in existence, so that writes to them reach the routes
PREFIX = "/qrag"
NAMES = [
    "books",
    "fuzz",
    "a.b_c-d",
    "nope",
    "..",
    ".",
    "a b",
    "x" * 65,
    "books\n",
    "\u2028",
    "caf\u00e9",
    "%2e%2e",
    "-",
    "0",
]
WRITES = ("POST", "PUT", "PATCH", "DELETE")
READ_ONLY_POSTS = ("/v1/retrieve",)
# Answers the models of api_models declare, by route template, for the 2xx check.
ANSWERS = {
    "/healthz": "Health",
    "/v1/corpora": "CorpusList",
    "/v1/corpora/{name}": "CorpusStats",
    "/v1/corpora/{name}/jobs": "CorpusJobs",
    "/v1/jobs/{job_id}": "Job",
    "/v1/retrieve": "RetrieveAnswer",
}
WRITE_ANSWERS = {"/v1/corpora/{name}": "Deleted"}

# -- strategies from the schema --------------------------------------------------------------------

EDGE_INTS = [0, 1, -1, 2, 7, 8, 16, 17, 24, 510, 511, 512, 2**31, -(2**63), 10**30]
EDGE_STRINGS = [
    "",
    " ",
    "books",
    "q",
    "a" * 3000,
    "\x00",
    "\ud800",
    "\u2028",
    "caf\u00e9",
    "A sentence. Another one, with a comma.",
    '"quoted"',
    "\\",
    "<script>",
    "../../etc/passwd",
]


SENTENCES = st.lists(
    st.sampled_from(
        [
            "The painter met the queen.",
            "A ship left the harbour at dawn.",
            "Rivers, castles and kings.",
            "Nobody saw the lamp",
            "\u00c9t\u00e9 \u00e0 Paris.",
        ]
    ),
    min_size=1,
    max_size=4,
).map(" ".join)
# Values that get past the first checks, for the fields whose names say what they hold.
HINTS = {
    "name": st.one_of(st.sampled_from(NAMES[:3]), st.from_regex(r"[a-z][a-z0-9._-]{0,12}", fullmatch=True)),
    "corpus": st.sampled_from(NAMES[:2] + [SENTINEL]),
    "text": SENTENCES,
    "question": st.sampled_from(["who met the painter", "where did the ship go", "the lamp"]),
}


def from_schema(schema: dict[str, Any], components: dict[str, Any]) -> st.SearchStrategy:
    """Values of a JSON schema (the OpenAPI subset pydantic writes: $ref, anyOf, object, array,
    string, integer, number, boolean, null), kept small, with edge values mixed in."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return st.deferred(lambda: from_schema(components[name], components))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, components) for s in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "object":
        props = {k: _hinted(k, from_schema(v, components)) for k, v in schema.get("properties", {}).items()}
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: v for k, v in props.items() if k in required},
            optional={k: v for k, v in props.items() if k not in required},
        )
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), components), max_size=4)
    simple = {
        "string": st.one_of(st.sampled_from(EDGE_STRINGS), st.text(max_size=80)),
        "integer": st.one_of(st.sampled_from(EDGE_INTS), st.integers(-1000, 1000)),
        "number": st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(-10, 10)),
        "boolean": st.booleans(),
        "null": st.none(),
    }
    return simple.get(kind, st.none())


def _hinted(name: str, drawn: st.SearchStrategy) -> st.SearchStrategy:
    hint = HINTS.get(name)
    return drawn if hint is None else st.one_of(hint, hint, drawn)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
HOSTILE_BODIES = [
    b"",
    b"{",
    b"null",
    b"[]",
    b'{"a": NaN}',
    b"\xff\xfe",
    b'{"question": "caf\xe9"}',
    b"[" * 5000 + b"]" * 5000,
    b'{"name": "x", "documents": ["' + b'\\",' * 20000 + b"]}",
    json.dumps({f"k{i}": i for i in range(20000)}).encode(),
    b'{"question": "q", "corpus": "books", "question": "again"}',
    b'{"name": "books", "documents": [{"id": 1e999, "text": "x"}]}',
]


def body_strategy(schema: dict[str, Any] | None, components: dict[str, Any]) -> st.SearchStrategy:
    """Bytes for an operation's body: from its schema (sometimes with an unknown field), any
    JSON, raw bytes, or one of the hostile bodies."""
    others = [
        JSON_VALUES.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
        st.sampled_from(HOSTILE_BODIES),
    ]
    if schema is None:
        return st.one_of(st.just(b""), *others)
    valid = from_schema(schema, components)
    extra = st.tuples(valid, st.text(min_size=1, max_size=8), JSON_VALUES).map(
        lambda t: {**t[0], t[1]: t[2]} if isinstance(t[0], dict) else t[0]
    )
    valid_bytes = valid.map(lambda v: json.dumps(v).encode())
    return st.one_of(
        [valid_bytes] * 5 + [extra.map(lambda v: json.dumps(v).encode()), *others]
    )  # mostly past the parser


AUTH = {
    "none": [],
    "read": [("authorization", f"Bearer {READ_KEY}")],
    "write": [("authorization", f"Bearer {WRITE_KEY}")],
    "unknown": [("authorization", "Bearer not-a-key")],
    "basic": [("authorization", f"Basic {WRITE_KEY}")],
    "read+write": [("authorization", f"Bearer {READ_KEY}"), ("authorization", f"Bearer {WRITE_KEY}")],
}


@dataclass
class Request:
    method: str
    route: str  # the operation's path template
    path: str
    auth: str
    headers: list[tuple[str, str]]
    body: bytes
    prefix: str = ""  # the app mounted under this root_path (as Serve's route_prefix mounts it)

    def has_write_key(self) -> bool:
        return self.auth == "write"

    def is_write(self) -> bool:
        return self.method in WRITES and self.route not in READ_ONLY_POSTS


def operations(openapi: dict[str, Any]) -> list[tuple[str, str, dict[str, Any] | None]]:
    """(method, path template, body schema) of every operation."""
    out = []
    for path, ops in openapi["paths"].items():
        for method, op in ops.items():
            out.append(
                (
                    method.upper(),
                    path,
                    op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema"),
                )
            )
    return out


def request_strategy(openapi: dict[str, Any]) -> st.SearchStrategy:
    components = openapi.get("components", {}).get("schemas", {})
    targets = st.sampled_from(TARGETS)
    name = st.one_of(
        targets, targets, st.sampled_from(NAMES), st.text(max_size=12).filter(lambda s: "/" not in s and s != SENTINEL)
    )
    headers = st.tuples(
        st.sampled_from(
            ["application/json"] * 6 + ["text/plain", "application/x+json", "application/json; charset=latin-1", None]
        ),
        st.sampled_from(["127.0.0.1"] * 16 + ["evil.example", "127.0.0.1:8000", "dup"]),
        st.sampled_from([None] * 12 + ["http://127.0.0.1", "https://127.0.0.1", "http://evil.example", "null"]),
    )

    @st.composite
    def one(draw) -> Request:
        method, route, schema = draw(st.sampled_from(operations(openapi)))
        path = route
        for param in ("{name}", "{job_id}"):
            if param in path:
                path = path.replace(param, quote(draw(name), safe=".~-_") or "x")
        auth = draw(st.sampled_from(["write"] * 6 + ["read"] * 3 + list(AUTH)))
        ctype, host, origin = draw(headers)
        hs = [*AUTH[auth], *([("content-type", ctype)] if ctype else [])]
        hs += [("host", "127.0.0.1"), ("host", "evil.example")] if host == "dup" else [("host", host)]
        hs += [("origin", origin)] if origin else []
        body = draw(body_strategy(schema, components)) if method in ("POST", "PUT", "PATCH") else b""
        return Request(method, route, path, auth, hs, body, draw(st.sampled_from(["", "", PREFIX])))

    return one()


# -- running and checking ------------------------------------------------------------------------


@dataclass
class Tally:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)
    unauthenticated_writes_accepted: list[str] = field(default_factory=list)
    malformed_errors: list[str] = field(default_factory=list)
    nonconforming_answers: list[str] = field(default_factory=list)
    worst_loop_lag_ms: float = 0.0
    worst_lag_request: str = ""

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "statuses": dict(sorted(self.statuses.items())),
            "server_errors_5xx": len(self.server_errors),
            "unauthenticated_writes_accepted": len(self.unauthenticated_writes_accepted),
            "malformed_error_bodies": len(self.malformed_errors),
            "nonconforming_answers": len(self.nonconforming_answers),
            "worst_loop_lag_ms": round(self.worst_loop_lag_ms, 1),
            "worst_lag_request": self.worst_lag_request,
            "examples": {
                "5xx": self.server_errors[:5],
                "unauthenticated_writes": self.unauthenticated_writes_accepted[:5],
                "malformed_errors": self.malformed_errors[:5],
                "nonconforming": self.nonconforming_answers[:5],
            },
        }


class Fuzzer:
    """Sends requests to ``app`` on ``loop`` (run by another thread, so that background jobs go
    on between requests), checks each answer, and keeps a model of the documents the server
    acknowledged."""

    def __init__(self, app, loop: asyncio.AbstractEventLoop):
        from qrag.serving.http_guards import RouteTable

        self.app, self.loop, self.tally = app, loop, Tally()
        self.routes = RouteTable(app.api.router.routes)
        self.acknowledged: dict[str, int] = {}  # corpus -> documents its 2xx writes acknowledged
        self._probing = False
        self._lag_ms = 0.0  # the worst lag since the current request was sent

    async def _probe(self) -> None:
        while self._probing:
            t0 = time.perf_counter()
            await asyncio.sleep(0.005)
            self._lag_ms = max(self._lag_ms, (time.perf_counter() - t0 - 0.005) * 1000)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(300)

    def start(self) -> None:
        self._probing = True
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._probe()))

    def stop(self) -> None:
        self._probing = False

    async def _send(
        self, method: str, path: str, headers: list[tuple[str, str]], body: bytes, prefix: str = ""
    ) -> httpx.Response:
        transport = httpx.ASGITransport(app=self.app, root_path=prefix)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1" + prefix, timeout=300) as c:
            return await c.request(method, path, headers=headers, content=body or None)

    def call(self, method: str, path: str, key: str | None = WRITE_KEY, json_body: Any = None) -> httpx.Response:
        """A well-formed request (setup and final checks)."""
        hs = [("authorization", f"Bearer {key}")] if key else []
        body = b"" if json_body is None else json.dumps(json_body).encode()
        return self._run(self._send(method, path, [*hs, ("content-type", "application/json")], body))

    def run(self, req: Request) -> httpx.Response:
        self._lag_ms = 0.0
        r = self._run(self._send(req.method, req.path, req.headers, req.body, req.prefix))
        self.check(req, r)
        self.keep_targets()
        if self._lag_ms > self.tally.worst_loop_lag_ms:
            self.tally.worst_loop_lag_ms, self.tally.worst_lag_request = (
                self._lag_ms,
                f"{req.method} {req.path} {len(req.body)} B -> {r.status_code}",
            )
        return r

    def check(self, req: Request, r: httpx.Response) -> None:
        t = self.tally
        t.requests += 1
        t.statuses[r.status_code] += 1
        what = f"{req.method} {req.path} auth={req.auth} body={req.body[:80]!r} -> {r.status_code} {r.text[:160]}"
        if r.status_code >= 500:
            t.server_errors.append(what)
        if req.is_write() and not req.has_write_key() and r.status_code < 300:
            t.unauthenticated_writes_accepted.append(what)
        if r.status_code >= 400 and not self._error_shape(r):
            t.malformed_errors.append(what)
        if r.status_code < 300 and not self._conforms(req, self.routes.match(self._scope(req, r)), r):
            t.nonconforming_answers.append(what)
        if r.status_code < 300 and req.is_write():
            self._acknowledge(req, r.json())

    def keep_targets(self) -> None:
        """Create the target corpora that are missing (at the start, or deleted by a request)."""
        for name in TARGETS:
            if name not in self.acknowledged:
                r = self.call("POST", "/v1/corpora", json_body={"name": name, "documents": SENTINEL_DOCS[:2]})
                if r.status_code == 201:
                    self.acknowledged[name] = 2

    @staticmethod
    def _error_shape(r: httpx.Response) -> bool:
        try:
            err = api_models.ErrorBody.model_validate(r.json()).error
        except ValueError:
            return False
        return err.status == r.status_code

    @staticmethod
    def _scope(req: Request, r: httpx.Response) -> dict[str, Any]:
        """The request as the router saw it (the client normalises dot segments)."""
        return {"type": "http", "method": r.request.method, "path": r.request.url.path, "root_path": req.prefix}

    @staticmethod
    def _conforms(req: Request, route: str | None, r: httpx.Response) -> bool:
        name = (WRITE_ANSWERS if req.is_write() else ANSWERS).get(route, "JobAnswer" if req.is_write() else None)
        if name is None:
            return True
        try:
            getattr(api_models, name).model_validate(r.json())
        except ValueError:
            return False
        return True

    def _acknowledge(self, req: Request, answer: dict[str, Any]) -> None:
        corpus = (answer.get("corpus") or {}).get("name")
        if req.method == "DELETE" and "deleted" in answer:
            self.acknowledged.pop(answer["deleted"], None)
        elif corpus is not None and (answer.get("job") or {}).get("state") in ("done", None):
            self.acknowledged[corpus] = answer["corpus"]["documents"]

    def data_lost(self, sentinel_before: dict[str, Any]) -> list[str]:
        """What the server acknowledged and no longer holds (jobs still running are waited for)."""
        self._settle_jobs()
        lost = []
        after = self.call("GET", f"/v1/corpora/{SENTINEL}", READ_KEY)
        if (
            after.status_code != 200
            or {k: after.json()[k] for k in ("documents", "chunks", "version")} != sentinel_before
        ):
            lost.append(f"{SENTINEL}: {after.status_code} {after.text[:200]}")
        if (
            self.call("POST", "/v1/retrieve", READ_KEY, {"corpus": SENTINEL, "question": "the painter"}).status_code
            != 200
        ):
            lost.append(f"{SENTINEL}: no longer answers")
        for name, documents in self.acknowledged.items():
            r = self.call("GET", f"/v1/corpora/{name}", READ_KEY)
            if r.status_code != 200 or r.json()["documents"] < documents:
                lost.append(f"{name}: {documents} documents acknowledged, now {r.status_code} {r.text[:200]}")
        return lost

    def _settle_jobs(self, timeout_s: float = 120) -> None:
        deadline = time.time() + timeout_s
        for name in [*TARGETS, *self.acknowledged]:
            while time.time() < deadline:
                jobs = self.call("GET", f"/v1/corpora/{name}/jobs", READ_KEY)
                if jobs.status_code != 200 or all(j["state"] in ("done", "failed") for j in jobs.json()["jobs"]):
                    break
                time.sleep(0.1)


# -- the event loop under hostile bodies ------------------------------------------------------------


@functools.cache
def hostile_requests() -> dict[str, tuple[str, bytes]]:
    """Requests that each kept the event loop busy for seconds in the HTTP layer (route, body)."""
    return {
        "escaped quotes": ("/v1/corpora", b'{"name": "x", "documents": ["' + b'\\",' * 2_000_000 + b"]}"),
        "a million unknown keys": ("/v1/retrieve", json.dumps({f"k{i}": 1 for i in range(10**6)}).encode()),
        "deep nesting": ("/v1/retrieve", b'{"question": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        "4 MB document, unknown corpus": (
            "/v1/corpora/nope/documents",
            json.dumps({"documents": [{"id": "d", "text": "word " * 800_000}]}).encode(),
        ),
        "20000 documents": (
            "/v1/corpora",
            json.dumps({"name": "x", "documents": [{"id": str(i), "text": "t"} for i in range(20000)]}).encode(),
        ),
    }


def accepted_large() -> dict[str, tuple[str, bytes]]:
    """Large bodies the service accepts: they go on to chunking, tokenising and embedding."""
    return {
        "4 MB document, indexed": (
            "/v1/corpora",
            json.dumps({"name": "big", "documents": [{"id": "d", "text": "word " * 800_000}]}).encode(),
        ),
        "1M-character context": ("/v1/retrieve", json.dumps({"question": "q", "context": "word " * 200_000}).encode()),
    }


HOSTILE_NAMES = [
    "escaped quotes",
    "a million unknown keys",
    "deep nesting",
    "4 MB document, unknown corpus",
    "20000 documents",
]


async def probe_while(client: httpx.AsyncClient, request) -> tuple[float, httpx.Response]:
    """The slowest /healthz answer, counted from when it was due, while ``request`` is handled."""
    lags: list[float] = []
    done = asyncio.Event()

    async def probe():
        while not done.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.01)
            await client.get("/healthz")
            lags.append(time.perf_counter() - t0 - 0.01)

    task = asyncio.create_task(probe())
    await asyncio.sleep(0.05)
    try:
        response = await request
    finally:
        done.set()
        await task
    return max(lags) * 1000, response


def hostile_lags(app, cases: dict[str, tuple[str, bytes]], key: str = WRITE_KEY) -> dict[str, dict[str, Any]]:
    """For each case: its status, its time, and the slowest /healthz answer meanwhile."""

    async def go():
        out = {}
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=600
        ) as c:
            await c.get("/healthz")
            for name, (path, body) in cases.items():
                t0 = time.perf_counter()
                request = c.post(
                    path, content=body, headers={"authorization": f"Bearer {key}", "content-type": "application/json"}
                )
                worst, r = await probe_while(c, request)
                out[name] = {
                    "bytes": len(body),
                    "status": r.status_code,
                    "seconds": round(time.perf_counter() - t0, 2),
                    "worst_healthz_ms": round(worst, 1),
                }
        return out

    return asyncio.run(go())


def make_app(encoder: str, storage: Path, **limits: Any):
    """The service over ``encoder`` (untrained) with read and write keys, as the fuzzer's target."""
    from qrag.retrieval.embedder import load_embedding_model, resolve_source
    from qrag.serving.auth import digest
    from qrag.serving.http_api import build_api
    from qrag.serving.service import local_service
    from qrag.serving.service_config import ServeConfig

    model = load_embedding_model(resolve_source(None, encoder), "cpu", positions="relative")
    cfg = ServeConfig(
        **{
            "storage": str(storage),
            "shards": 2,
            "chunk_tokens": 24,
            "max_body_bytes": 256 * 1024,
            "max_documents": 50,
            "request_timeout_s": 120.0,
            **limits,
        }
    )
    return build_api(local_service(cfg, model), keys={digest(READ_KEY): "read", digest(WRITE_KEY): "write"})


SENTINEL_DOCS = [
    {"id": f"s{i}", "text": f"The painter {i} met the queen near the harbour. The ship left at dawn."} for i in range(4)
]


def fuzz(app, examples: int, seed_value: int, derandomize: bool = False) -> dict[str, Any]:
    """Run ``examples`` drawn requests against ``app``; the tally and what was lost."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    fuzzer = Fuzzer(app, loop)
    try:
        assert (
            fuzzer.call("POST", "/v1/corpora", json_body={"name": SENTINEL, "documents": SENTINEL_DOCS}).status_code
            == 201
        )
        before = {
            k: fuzzer.call("GET", f"/v1/corpora/{SENTINEL}", READ_KEY).json()[k]
            for k in ("documents", "chunks", "version")
        }
        openapi = fuzzer.call("GET", "/openapi.json", None).json()
        fuzzer.keep_targets()
        fuzzer.start()

        @seed(seed_value)
        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=derandomize,
            print_blob=False,
            suppress_health_check=list(HealthCheck),
        )
        @given(request_strategy(openapi))
        def one(req: Request) -> None:
            fuzzer.run(req)

        t0 = time.perf_counter()
        one()
        seconds = time.perf_counter() - t0
        fuzzer.stop()
        lost = fuzzer.data_lost(before)
    finally:
        fuzzer.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    return {**fuzzer.tally.summary(), "data_lost": len(lost), "lost": lost[:5], "seconds": round(seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--examples", type=int, default=100, help="requests drawn")
    parser.add_argument("--seed", type=int, default=32)
    parser.add_argument(
        "--encoder",
        default="tiny",
        help="encoder served (untrained): tiny (a random-init 2-layer BERT built here), "
        "minilm (bundled) or a local directory",
    )
    parser.add_argument("--storage", default=None, help="corpora folder (default: a temporary one)")
    parser.add_argument("--out", default=None, help="write the JSON result here too")
    parser.add_argument(
        "--hostile", action="store_true", help="also time /healthz while each hostile or large body is handled"
    )
    args = parser.parse_args(argv)
    encoder = args.encoder
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.storage or tmp)
        if args.encoder == "tiny":  # the tests' encoder: the fuzzing is about the HTTP layer, not the model
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from conftest import build_tiny_encoder

            args.encoder = str(build_tiny_encoder(Path(tmp) / "tiny_encoder"))
        result = {
            "settings": {
                "examples": args.examples,
                "seed": args.seed,
                "encoder": encoder,
                "keys": "read + write",
                "max_body_bytes": 256 * 1024,
                "max_documents": 50,
            },
            **fuzz(make_app(args.encoder, root / "fuzz"), args.examples, args.seed),
        }
        if args.hostile:
            big = make_app(args.encoder, root / "hostile", max_body_bytes=32 * 2**20, max_documents=10_000)
            result["hostile_bodies"] = {
                "max_body_bytes": 32 * 2**20,
                **hostile_lags(big, {**hostile_requests(), **accepted_large()}),
            }
    if args.out:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_common import machine_info, write_result

        write_result(args.out, {**result, "machine": machine_info()})
    print(json.dumps(result, indent=1))
    bad = result["server_errors_5xx"] + result["unauthenticated_writes_accepted"] + result["data_lost"]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
