"""The ASGI layers around the HTTP routes, from the outside in: :class:`Observed` counts every
response (guards' and crashes' too), :class:`Guard` checks the headers, the Host, the Origin,
the API key and the Content-Type, drops headers that would lift the server's timeouts and
enforces the request deadline, and :class:`BodyGuard` bounds the body (size, UTF-8, JSON shape)
before anything parses it.

A request's key scope follows the route it reaches, matched as the router matches it (under a
``root_path``, as Ray Serve's ``route_prefix`` and uvicorn's ``--root-path`` set it), never the
raw path: only the routes listed as public are open, everything else needs a key. Work that
grows with the body runs in a small pool of worker threads, so no request stalls the event loop.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from fastapi.responses import JSONResponse
from starlette.routing import BaseRoute, Match

from qrag.serving.auth import allows, scope_of
from qrag.serving.errors import ServiceError
from qrag.serving.http_headers import PAGE_HEADERS, strip_headers

log = logging.getLogger("qrag.http")

# Entries the guards add to the ASGI scope for the layers inside them.
KEY_SCOPE = "qrag.key_scope"  # the scope (read | write) of the request's valid API key

# Routes anyone may call; every other route, and any path that matches none, needs a key.
PUBLIC_ROUTES = frozenset(
    {"/", "/static/{name}", "/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
)
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
READ_POSTS = frozenset({"/v1/retrieve"})  # posts that only read
# Posts that create documents: their document count is taken from the raw body first.
DOCUMENT_POSTS = frozenset({"/v1/corpora", "/v1/corpora/{name}/documents"})
# Headers a request may carry once: with two, the guard and the app could each read another.
SINGLE_HEADERS = (b"host", b"authorization", b"origin", b"content-type", b"content-length")
DEFAULT_PORTS = {"http": 80, "https": 443}

# Bodies from this size on are checked, parsed and validated in the worker threads.
OFF_LOOP_BYTES = 64 * 1024
# JSON structure (',' ':' '[' '{' outside strings) a body of any other post may hold: a few
# fields, never thousands of keys or values.
OTHER_POST_SHAPE = 256
_BLOCK = 1 << 20  # bytes scanned per step: the GIL is free between steps, and memory stays small


def error_response(status: int, field: str | None, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(ServiceError(status, field, message).body(), status_code=status, headers=headers)


# -- work off the event loop --------------------------------------------------------------------

T = TypeVar("T")
_workers: ThreadPoolExecutor | None = None


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in the body workers: two threads per process, so large bodies queue there
    instead of taking every thread of the loop's default pool."""
    global _workers
    if _workers is None:
        _workers = ThreadPoolExecutor(2, thread_name_prefix="qrag-body")
    return await asyncio.get_running_loop().run_in_executor(_workers, fn, *args)


# -- which route, which key -------------------------------------------------------------------


def needed_scope(method: str, route: str | None, public: Iterable[str] = PUBLIC_ROUTES) -> str | None:
    """read, write, or None (public) for ``method`` on the route template ``route`` (None: the
    path matches no route, which needs a key too)."""
    if route is not None and route in public:
        return None
    return "read" if method in READ_METHODS or route in READ_POSTS else "write"


ROUTE_KEY = "qrag.route"  # the matched route template, kept in the ASGI scope


class RouteTable:
    """The route template a request reaches, matched by the routes themselves (they strip the
    scope's ``root_path`` as the router does). ``routes`` is read at each request, so routes
    added after the app was built are matched too."""

    def __init__(
        self,
        routes: Callable[[], Sequence[BaseRoute]] | Sequence[BaseRoute] | None = None,
        public: Iterable[str] = PUBLIC_ROUTES,
    ):
        self._routes = routes if callable(routes) else (lambda: routes or ())
        self.public = frozenset(public)

    def match(self, scope: dict[str, Any]) -> str | None:
        """Matched once per request (the guards, the body guard and the counter all ask; routing
        is a walk over every route): the answer is kept in the scope."""
        if ROUTE_KEY in scope:
            return scope[ROUTE_KEY]
        scope[ROUTE_KEY] = found = self._match(scope)
        return found

    def _match(self, scope: dict[str, Any]) -> str | None:
        partial = None
        for route in self._routes():
            found, _ = route.matches(scope)
            if found == Match.FULL:
                return getattr(route, "path", None)
            if found == Match.PARTIAL and partial is None:  # the path, not the method: 405, still this route's scope
                partial = getattr(route, "path", None)
        return partial

    def needed(self, method: str, route: str | None) -> str | None:
        return needed_scope(method, route, self.public)


# -- headers -------------------------------------------------------------------------------------


def _json_content_type(ctype: bytes | None) -> bool:
    if ctype is None:
        return False
    main = ctype.split(b";")[0].strip().lower()
    return main == b"application/json" or (main.startswith(b"application/") and main.endswith(b"+json"))


def _hostname(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _host_port(netloc: str, scheme: str) -> tuple[str, int] | None:
    """'Example.com:8000' -> ('example.com', 8000); the scheme's port when none is given."""
    netloc = netloc.strip().lower()
    host, port = netloc, ""
    if netloc.startswith("["):
        end = netloc.find("]")
        if end < 0:
            return None
        host, rest = netloc[: end + 1], netloc[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port = rest[1:]
    elif netloc.count(":") == 1:
        host, port = netloc.split(":")
    if not host or (port and not port.isdigit()):
        return None
    return host, int(port) if port else DEFAULT_PORTS.get(scheme, 0)


def origin_key(origin: str) -> tuple[str, str, int] | None:
    """An Origin header as (scheme, host, port); None for 'null' and anything not http(s)."""
    scheme, sep, rest = origin.strip().partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in DEFAULT_PORTS or "/" in rest or "@" in rest:
        return None
    hp = _host_port(rest, scheme)
    return None if hp is None else (scheme, *hp)


def request_origin(scope: dict[str, Any], host: str, forwarded_proto: bytes | None) -> tuple[str, str, int] | None:
    """The origin the request was sent to: its scheme (a TLS proxy's X-Forwarded-Proto, else the
    connection's), the Host header's name and port."""
    scheme = str(scope.get("scheme") or "http").lower()
    if forwarded_proto:
        first = forwarded_proto.decode("latin-1").split(",")[0].strip().lower()
        scheme = first if first in DEFAULT_PORTS else scheme
    hp = _host_port(host, scheme)
    return None if hp is None else (scheme, *hp)


def repeated_header(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """The first of :data:`SINGLE_HEADERS` that the request carries more than once."""
    seen: set[bytes] = set()
    for name, _ in headers:
        name = name.lower()
        if name in SINGLE_HEADERS:
            if name in seen:
                return name.decode()
            seen.add(name)
    return None


# -- the guards ----------------------------------------------------------------------------------


class Guard:
    """Repeated headers, Host allow-list, cross-origin writes, API keys and scopes (by the route
    reached), JSON-only bodies, and the request deadline; strips client headers that would
    disable the server's timeout. Records the valid key's scope in ``scope[KEY_SCOPE]``."""

    def __init__(
        self,
        app,
        *,
        keys: dict[str, str],
        allowed_hosts: list[str],
        cors_origins: list[str],
        timeout_s: float,
        retry_after_s: int,
        routes: RouteTable | None = None,
    ):
        self.app, self.keys = app, keys
        self.any_host = "*" in allowed_hosts
        self.hosts = {_hostname(h) for h in allowed_hosts}
        self.origins = set(cors_origins)
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self.routes = routes or RouteTable()

    def _origin_refusal(self, scope, headers: dict[bytes, bytes], host: str) -> JSONResponse | None:
        origin = headers.get(b"origin")
        if origin is None or scope["method"] in READ_METHODS:
            return None
        o = origin.decode("latin-1")
        own = request_origin(scope, host, headers.get(b"x-forwarded-proto"))
        if o in self.origins or (own is not None and origin_key(o) == own):
            return None
        return error_response(403, "origin", f"cross-origin request from {o[:100]!r} refused (cors_origins)")

    def _key_refusal(self, scope, headers: dict[bytes, bytes]) -> JSONResponse | None:
        if not self.keys:
            return None
        method = scope["method"]
        auth = headers.get(b"authorization")
        key_scope = scope_of(self.keys, auth.decode("latin-1")) if auth is not None else None
        if auth is not None and key_scope is None:
            return error_response(401, "authorization", "unknown API key", {"WWW-Authenticate": "Bearer"})
        if key_scope is not None:
            scope[KEY_SCOPE] = key_scope
        need = self.routes.needed(method, self.routes.match(scope))
        if need is None or method == "OPTIONS":  # (a CORS preflight carries no credentials)
            return None
        if key_scope is None:
            return error_response(
                401, "authorization", "send 'Authorization: Bearer <API key>'", {"WWW-Authenticate": "Bearer"}
            )
        if not allows(key_scope, need):
            return error_response(
                403, "authorization", f"this API key may {key_scope}; {method} {scope['path'][:200]} needs a {need} key"
            )
        return None

    def _refusal(self, scope) -> JSONResponse | None:
        raw = scope.get("headers") or []
        repeated = repeated_header(raw)
        if repeated:
            return error_response(400, repeated, f"the {repeated} header was sent more than once")
        headers = {k.lower(): v for k, v in raw}
        host = headers.get(b"host", b"").decode("latin-1")
        if not self.any_host and _hostname(host) not in self.hosts:
            return error_response(421, "host", f"host {host[:100]!r} is not served here (allowed_hosts)")
        refusal = self._origin_refusal(scope, headers, host) or self._key_refusal(scope, headers)
        if refusal is not None:
            return refusal
        if scope["method"] in ("POST", "PUT", "PATCH") and not _json_content_type(headers.get(b"content-type")):
            ctype = headers.get(b"content-type")
            what = "no Content-Type" if ctype is None else f"Content-Type {ctype.decode('latin-1')[:100]}"
            return error_response(415, "content-type", f"send JSON with 'Content-Type: application/json' ({what})")
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope["headers"] = strip_headers(scope.get("headers"))
        refusal = self._refusal(scope)
        if refusal is not None:
            return await refusal(scope, receive, send)
        started = False

        async def tracked(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            async with asyncio.timeout(self.timeout_s):  # (wait_for would run the request in a task of its own)
                await self.app(scope, receive, tracked)
        except TimeoutError:
            if not started:
                await error_response(
                    503,
                    None,
                    f"the request took longer than {self.timeout_s:g} s (request_timeout_s); an indexing job "
                    f"it started goes on (GET /v1/corpora/<name>/jobs)",
                    {"Retry-After": str(self.retry_after_s)},
                )(scope, receive, send)


class SecurityHeaders:
    """``X-Content-Type-Options: nosniff`` on every answer, the page's headers on HTML answers
    that lack them (a plain ASGI layer: Starlette's BaseHTTPMiddleware runs every request in a
    task group of its own)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_headers(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {k.lower() for k, _ in headers}
                if b"x-content-type-options" not in names:
                    headers.append((b"x-content-type-options", b"nosniff"))
                ctype = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                if ctype.startswith(b"text/html"):
                    headers += [(k.encode(), v.encode()) for k, v in PAGE_HEADERS.items() if k.encode() not in names]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


class Observed:
    """Counts every response by route and status, also those of the guards and of crashes."""

    def __init__(self, app, routes: RouteTable, on_request: Callable[[str, int, float], None]):
        self.app, self.routes, self.on_request = app, routes, on_request

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), 0

        async def observed(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed)
        except asyncio.CancelledError:  # the client went away (or Serve gave up): 499 in the log's sense
            status = status or 499
            raise
        except Exception:
            # FastAPI has already answered 500 (its handler re-raises afterwards); answer only if not.
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if status == 0:
                status = 500
                await error_response(500, None, "internal error")(scope, receive, send)
        finally:
            self.on_request(self.routes.match(scope) or "unmatched", status or 499, time.perf_counter() - t0)


# -- the body ------------------------------------------------------------------------------------


@dataclass
class JsonShape:
    commas: int  # ',' outside strings
    marks: int  # ',' ':' '[' '{' outside strings
    open_string: bool = False  # the body ends inside a string: not JSON


def _backslash_runs(a: np.ndarray, carry: int) -> np.ndarray:
    """For each byte, how many backslashes come right before it (``carry`` of them ended the
    previous block)."""
    n = len(a)
    idx = np.arange(n, dtype=np.int32)
    last_other = np.maximum.accumulate(np.where(a == 0x5C, np.int32(-1), idx))  # the last non-backslash at or before i
    before = np.empty(n, np.int32)
    before[0] = carry
    before[1:] = idx[:-1] - last_other[:-1]
    before[1:] += np.where(last_other[:-1] < 0, carry, 0)  # the block so far is all backslashes
    return before


def json_shape(body: bytes | memoryview) -> JsonShape:
    """Count JSON structure outside strings in one linear pass, block by block (numpy: the GIL
    is released on each step). A quote ends a string unless an odd run of backslashes precedes
    it; exact for valid JSON, and a body that is not gets 400 from the parser anyway."""
    commas = marks = 0
    inside, carry = 0, 0
    view = memoryview(body)
    for start in range(0, len(view), _BLOCK):
        a = np.frombuffer(view[start : start + _BLOCK], np.uint8)
        quotes = a == 0x22
        if carry or 0x5C in a:
            runs = _backslash_runs(a, carry)
            quotes &= (runs & 1) == 0
            last = runs[-1] + 1 if a[-1] == 0x5C else 0
        else:
            last = 0
        outside = ((np.cumsum(quotes, dtype=np.int32) - quotes + inside) & 1) == 0
        is_comma = a == 0x2C
        commas += int(np.count_nonzero(is_comma & outside))
        marks += int(np.count_nonzero((is_comma | (a == 0x3A) | (a == 0x5B) | (a == 0x7B)) & outside))
        inside = (inside + int(np.count_nonzero(quotes))) & 1
        carry = int(last)
    return JsonShape(commas, marks, open_string=bool(inside))


def most_marks(body: bytes) -> int:
    """An upper bound of :func:`json_shape`'s marks, from four byte counts (no scan)."""
    return sum(body.count(c) for c in (b",", b":", b"[", b"{"))


def utf8_error(body: bytes) -> int | None:
    """The offset of the first byte that is not UTF-8, or None; decoded block by block."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(body)
    for start in range(0, len(view), _BLOCK):
        pending = len(decoder.getstate()[0])  # the bytes of a character cut by the previous block
        try:
            decoder.decode(view[start : start + _BLOCK], final=start + _BLOCK >= len(view))
        except UnicodeDecodeError as exc:
            return start - pending + exc.start
    return None


@dataclass
class BodyLimits:
    """What one post's body may hold."""

    max_documents: int | None  # documents per create/append (None: no count)

    def documents_over(self, route: str | None, shape: JsonShape) -> bool:
        """Each document adds at least two commas outside strings ({"id":..,"text":..},): far more
        commas than max_documents allows means far too many documents, known without parsing."""
        return self.max_documents is not None and route in DOCUMENT_POSTS and shape.commas > 2 * self.max_documents + 8

    def marks_allowed(self, route: str | None) -> int:
        if route in DOCUMENT_POSTS and self.max_documents is not None:
            return 5 * self.max_documents + 32  # '{', two ':' and two ',' a document, and a few fields
        return OTHER_POST_SHAPE


def body_problem(body: bytes, route: str | None, limits: BodyLimits) -> ServiceError | None:
    """Why a body is refused before parsing (not UTF-8, too many documents, too much JSON
    structure for its route), or None. Linear in the body."""
    bad = utf8_error(body)
    if bad is not None:
        return ServiceError(400, "body", f"request body is not valid UTF-8 (byte {bad})")
    allowed = limits.marks_allowed(route)
    if most_marks(body) <= allowed:
        return None
    shape = json_shape(body)
    if shape.open_string:  # known from the scan: the parser need not read it all again
        return ServiceError(400, "body", "invalid JSON: a string is not terminated before the end of the body")
    if limits.documents_over(route, shape):
        n = limits.max_documents
        return ServiceError(
            413,
            "documents",
            f"more than {n} documents in one request (counted before parsing); send at most {n} per request",
        )
    if shape.marks > allowed:
        return ServiceError(
            413,
            "body",
            f"the JSON body holds more than {allowed} keys and values (counted before parsing): "
            f"unknown fields, or values this request does not take",
        )
    return None


class BodyGuard:
    """Reads the body before the app does: refuses oversized (413), non-UTF-8 (400) bodies,
    document uploads that hold more documents than allowed and bodies with more JSON structure
    than their route takes (413, counted before parsing). Large bodies are checked in the body
    worker threads."""

    def __init__(self, app, limit: int, max_documents: int | None = None, routes: RouteTable | None = None):
        self.app, self.limit = app, limit
        self.limits = BodyLimits(max_documents)
        self.routes = routes or RouteTable()

    async def _read(self, receive) -> bytes | ServiceError | None:
        """The whole body, a refusal past the limit, or None when the client went away."""
        chunks, total, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.limit:
                return ServiceError(413, "body", f"request body over {self.limit} bytes")
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                return await error_response(400, "body", "bad Content-Length header")(scope, receive, send)
            if int(declared) > self.limit:
                return await error_response(
                    413, "body", f"request body of {int(declared)} bytes; at most {self.limit}"
                )(scope, receive, send)
        body = await self._read(receive)
        if body is None:
            return
        if isinstance(body, ServiceError):
            return await error_response(body.status, body.field, body.message)(scope, receive, send)
        route = self.routes.match(scope)
        check = (body, route, self.limits)
        problem = await off_loop(body_problem, *check) if len(body) >= OFF_LOOP_BYTES else body_problem(*check)
        if problem is not None:
            return await error_response(problem.status, problem.field, problem.message)(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


__all__ = [
    "BodyGuard",
    "Guard",
    "KEY_SCOPE",
    "Observed",
    "RouteTable",
    "error_response",
    "json_shape",
    "needed_scope",
    "off_loop",
]
