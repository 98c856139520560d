"""The HTTP face of the retrieval service: FastAPI routes under /v1, OpenAPI at /docs, the web
page at /, and JSON errors that name the field at fault (4xx for the client's mistakes).

Around the routes, from the outside in: :class:`Observed` counts every response (guards' and
crashes' too), :class:`Guard` checks the Host, the Origin, the API key and the Content-Type,
drops headers that would lift the server's timeouts and enforces the request deadline, and
:class:`BodyGuard` bounds the body (size, UTF-8, document count) before anything parses it.

Built around a :class:`qrag.serving.service.RetrievalService`; Ray Serve mounts it as its ingress
(``qrag.distributed.serving``), tests mount it in-process.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from qrag.serving.auth import allows, scope_of
from qrag.serving.http_headers import PAGE_HEADERS, strip_headers
from qrag.index.store import StoreError
from qrag.serving.errors import ServiceError, os_error, store_error
from qrag.serving.retrieval import RetrieveParams
from qrag.serving.service import RetrievalService

log = logging.getLogger("qrag.http")

STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DocumentIn(_Strict):
    id: StrictStr | StrictInt = Field(description="Document id, unique within the corpus.")
    text: StrictStr = Field(description="The document's text (UTF-8); split into sentence-aligned chunks.")


class CreateCorpus(_Strict):
    name: StrictStr = Field(description="1-64 letters, digits, '.', '_' or '-'.")
    documents: list[DocumentIn] = Field(default_factory=list, description="Documents to index now (more can be appended).")
    chunk_tokens: StrictInt | None = Field(None, description="Token budget per chunk (default: the server's chunk_tokens).")
    wait: StrictBool = Field(True, description="false: answer 202 at once with a job to poll at /v1/jobs/{id}.")


class AppendDocuments(_Strict):
    documents: list[DocumentIn]
    wait: StrictBool = Field(True, description="false: answer 202 at once with a job to poll at /v1/jobs/{id}.")


class Reindex(_Strict):
    wait: StrictBool = Field(False, description="true: answer when the re-index ends (or 202 after job_wait_s).")


class RetrieveRequest(_Strict):
    question: StrictStr
    corpus: StrictStr | None = Field(None, description="An indexed corpus ...")
    context: StrictStr | None = Field(None, description="... or one long inline document (not stored).")
    max_steps: StrictInt = Field(2, description="Retrieval steps T.")
    beam_width: StrictInt = Field(1, description="1 = greedy; >1 = beam search over Q.")
    stop_threshold: StrictFloat | StrictInt | None = Field(None, description="Stop when the best Q falls below it.")
    alternatives: StrictInt = Field(3, description="Runner-up chunks reported per step.")
    chunk_tokens: StrictInt | None = Field(None, description="Inline context only: token budget per chunk.")
    return_chunks: StrictBool = Field(False, description="Inline context only: return the chunk texts too.")


def _field(loc: tuple[Any, ...]) -> str | None:
    """("body", "documents", 3, "text") -> "documents[3].text"."""
    parts = [p for p in loc if p not in ("body", "query", "path")]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def _error(status: int, field: str | None, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(ServiceError(status, field, message).body(), status_code=status, headers=headers)


# Posts that create documents: their document count is taken from the raw body first.
DOCUMENT_POSTS = re.compile(r"^/v1/corpora(/[^/]+/documents)?/?$")
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


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


def needed_scope(method: str, path: str) -> str | None:
    """read, write, or None (public) for one request."""
    if not path.startswith("/v1/"):
        return None
    if method in ("GET", "HEAD", "OPTIONS") or path.rstrip("/") == "/v1/retrieve":
        return "read"
    return "write"


class Guard:
    """Host allow-list, cross-origin writes, API keys and scopes, JSON-only bodies, and the
    request deadline; strips client headers that would disable the server's timeout."""

    def __init__(self, app, *, keys: dict[str, str], allowed_hosts: list[str], cors_origins: list[str], timeout_s: float, retry_after_s: int):
        self.app, self.keys = app, keys
        self.any_host = "*" in allowed_hosts
        self.hosts = {_hostname(h) for h in allowed_hosts}
        self.origins = set(cors_origins)
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s

    def _refusal(self, scope) -> JSONResponse | None:
        headers = {k: v for k, v in scope.get("headers") or []}
        host = headers.get(b"host", b"").decode("latin-1")
        if not self.any_host and _hostname(host) not in self.hosts:
            return _error(421, "host", f"host {host[:100]!r} is not served here (allowed_hosts)")
        method, path = scope["method"], scope["path"]
        origin = headers.get(b"origin")
        if origin is not None and method not in ("GET", "HEAD", "OPTIONS"):
            o = origin.decode("latin-1")
            same = o.split("://", 1)[-1].lower() == host.lower()
            if not same and o not in self.origins:
                return _error(403, "origin", f"cross-origin request from {o[:100]!r} refused (cors_origins)")
        need = needed_scope(method, path)
        if self.keys and need is not None and method != "OPTIONS":
            auth = headers.get(b"authorization")
            scope_ = scope_of(self.keys, auth.decode("latin-1") if auth else None)
            if scope_ is None:
                return _error(401, "authorization", "send 'Authorization: Bearer <API key>'" if auth is None else "unknown API key",
                              {"WWW-Authenticate": "Bearer"})
            if not allows(scope_, need):
                return _error(403, "authorization", f"this API key may {scope_}; {method} {path} needs a {need} key")
        if method in ("POST", "PUT", "PATCH") and not _json_content_type(headers.get(b"content-type")):
            ctype = headers.get(b"content-type")
            what = "no Content-Type" if ctype is None else f"Content-Type {ctype.decode('latin-1')[:100]}"
            return _error(415, "content-type", f"send JSON with 'Content-Type: application/json' ({what})")
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
            await asyncio.wait_for(self.app(scope, receive, tracked), self.timeout_s)
        except asyncio.TimeoutError:
            if not started:
                await _error(503, None, f"the request took longer than {self.timeout_s:g} s (request_timeout_s); an indexing job it "
                                        f"started goes on (GET /v1/corpora/<name>/jobs)", {"Retry-After": str(self.retry_after_s)})(scope, receive, send)


class Observed:
    """Counts every response by route and status, also those of the guards and of crashes."""

    def __init__(self, app, routes, on_request: Callable[[str, int, float], None]):
        self.app, self.routes, self.on_request = app, routes, on_request

    def _route(self, scope) -> str:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match != Match.NONE:
                return route.path
        return "unmatched"

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
                await _error(500, None, "internal error")(scope, receive, send)
        finally:
            self.on_request(self._route(scope), status or 499, time.perf_counter() - t0)


class BodyGuard:
    """Reads the body before the app does: refuses oversized (413), non-UTF-8 (400) bodies and
    document uploads that hold more documents than allowed (413, counted before parsing)."""

    def __init__(self, app, limit: int, max_documents: int | None = None):
        self.app, self.limit, self.max_documents = app, limit, max_documents

    def _too_many_documents(self, path: str, body: bytes) -> bool:
        """Each document adds at least two commas outside strings ({"id":..,"text":..},): far more
        commas than max_documents allows means far too many documents, known without parsing."""
        if self.max_documents is None or not DOCUMENT_POSTS.match(path) or body.count(b",") <= 2 * self.max_documents + 8:
            return False
        return _JSON_STRING.sub(b'""', body).count(b",") > 2 * self.max_documents + 8

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                return await _error(400, "body", "bad Content-Length header")(scope, receive, send)
            if size > self.limit:
                return await _error(413, "body", f"request body of {size} bytes; at most {self.limit}")(scope, receive, send)
        chunks, total, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.limit:
                return await _error(413, "body", f"request body over {self.limit} bytes")(scope, receive, send)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            return await _error(400, "body", f"request body is not valid UTF-8 (byte {exc.start})")(scope, receive, send)
        if self._too_many_documents(scope["path"], body):
            return await _error(413, "documents", f"more than {self.max_documents} documents in one request (counted before parsing); "
                                                  f"send at most {self.max_documents} per request")(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


def build_api(
    service: RetrievalService,
    static: dict[str, bytes] | None = None,
    on_request: Callable[[str, int, float], None] | None = None,
    keys: dict[str, str] | None = None,
):
    """The ASGI app for ``service``: FastAPI routes inside the guards. ``static`` holds the web
    page's files by name; ``keys`` maps API-key digests to scopes (see :mod:`qrag.serving.auth`)."""
    api = FastAPI(title="qrag retriever", version="1", description="Q-RAG multi-step retrieval over sharded chunk indexes.")
    static = static or {}
    cfg = service.cfg

    @api.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError):
        return _error(exc.status, exc.field, exc.message, exc.headers)

    @api.exception_handler(StoreError)
    async def store_failure(request: Request, exc: StoreError):
        err = store_error(exc)
        return _error(err.status, err.field, err.message, err.headers)

    @api.exception_handler(OSError)
    async def storage_failure(request: Request, exc: OSError):
        log.warning("storage error on %s %s: %s", request.method, request.url.path, exc)
        err = os_error(exc)
        return _error(err.status, err.field, err.message, err.headers)

    @api.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        err = exc.errors()[0]
        if err.get("type") == "json_invalid":
            return _error(400, "body", f"invalid JSON: {err.get('ctx', {}).get('error', err.get('msg'))} (at character {err['loc'][-1] if len(err['loc']) > 1 else '?'})")
        field = _field(tuple(err.get("loc", ()))) or "body"
        if err.get("type") == "missing":
            return _error(422, field, f"{field}: required field missing")
        if err.get("type") == "extra_forbidden":
            return _error(422, field, f"{field}: unknown field")
        return _error(422, field, f"{field}: {err.get('msg')}")

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, "body" if exc.status_code == 400 else None, str(exc.detail))

    @api.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return _error(500, None, f"internal error: {type(exc).__name__}")

    @api.middleware("http")
    async def security_headers(request: Request, call_next):
        response = await call_next(request)
        response.headers.setdefault("x-content-type-options", "nosniff")
        if response.media_type and response.media_type.startswith("text/html"):
            for k, v in PAGE_HEADERS.items():
                response.headers.setdefault(k, v)
        return response

    # -- page --------------------------------------------------------------------------------

    @api.get("/", include_in_schema=False)
    async def page():
        if "index.html" not in static:
            return _error(404, None, "no web page bundled with this server")
        return Response(static["index.html"], media_type=STATIC_TYPES[".html"], headers=PAGE_HEADERS)

    @api.get("/static/{name}", include_in_schema=False)
    async def static_file(name: str):
        if name not in static:
            return _error(404, "name", f"no static file {name!r}")
        suffix = name[name.rfind("."):]
        return Response(static[name], media_type=STATIC_TYPES.get(suffix, "application/octet-stream"))

    # -- API ---------------------------------------------------------------------------------

    @api.get("/healthz", summary="Health, and which model is served (trained or not)")
    async def healthz():
        return await service.health()

    @api.get("/v1/corpora", summary="List corpora")
    async def list_corpora():
        return {"corpora": service.list_corpora()}

    def accepted(out: dict[str, Any], status: int = 200):
        """202 while the job goes on (wait:false, or it outlasted job_wait_s)."""
        job = out.get("job")
        return JSONResponse(out, status_code=202 if job and job["state"] in ("queued", "running") else status)

    @api.post("/v1/corpora", status_code=201, summary="Create a corpus (optionally with documents); visible once indexed")
    async def create_corpus(body: CreateCorpus):
        out = await service.create(body.name, [d.model_dump() for d in body.documents] if body.documents else None, body.chunk_tokens, body.wait)
        return accepted(out, 201)

    @api.get("/v1/corpora/{name}", summary="Corpus stats: documents, chunks, tokens, shards, bytes")
    async def corpus_stats(name: str):
        return await service.corpus_stats(name)

    @api.delete("/v1/corpora/{name}", summary="Delete a corpus")
    async def delete_corpus(name: str):
        return await service.delete(name)

    @api.post("/v1/corpora/{name}/documents", summary="Append documents (send large uploads in several requests)")
    async def append(name: str, body: AppendDocuments):
        out = await service.append(name, [d.model_dump() for d in body.documents], body.wait)
        return accepted(out)

    @api.post("/v1/corpora/{name}/reindex", status_code=202, summary="Re-embed a corpus with the served model (one at a time per corpus)")
    async def reindex(name: str, body: Reindex | None = None):
        return accepted(await service.reindex(name, wait=body.wait if body else False), 200)

    @api.get("/v1/corpora/{name}/jobs", summary="The corpus's recent indexing jobs, newest first")
    async def corpus_jobs(name: str):
        return await asyncio.to_thread(service.corpus_jobs, name)

    @api.get("/v1/jobs/{job_id}", summary="Progress of an indexing job (any replica answers; outcomes survive restarts)")
    async def job(job_id: str):
        return await asyncio.to_thread(service.job, job_id)

    @api.post("/v1/retrieve", summary="Multi-step retrieval over a corpus or an inline context")
    async def retrieve(body: RetrieveRequest):
        return await service.retrieve(RetrieveParams(**body.model_dump()))

    if cfg.cors_origins:
        api.add_middleware(CORSMiddleware, allow_origins=list(cfg.cors_origins), allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["authorization", "content-type"])
    app = BodyGuard(api, limit=cfg.max_body_bytes, max_documents=cfg.max_documents)
    app = Guard(app, keys=keys or {}, allowed_hosts=list(cfg.allowed_hosts), cors_origins=list(cfg.cors_origins),
                timeout_s=cfg.request_timeout_s, retry_after_s=cfg.retry_after_s)
    if on_request is not None:
        app = Observed(app, api.router.routes, on_request)
    app.api = api  # the FastAPI object (routes, OpenAPI), for callers that add routes
    app.add_exception_handler = api.add_exception_handler  # Serve maps its overload errors through it
    return app


def static_files(folder) -> dict[str, bytes]:
    """The web page's files (read once, so replicas on other nodes need no shared disk)."""
    root = Path(folder)
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.suffix in STATIC_TYPES} if root.is_dir() else {}


__all__ = ["build_api", "static_files", "BodyGuard"]
