"""The HTTP face of the retrieval service: FastAPI routes under /v1, OpenAPI at /docs, the web
page at /, and JSON errors that name the field at fault (4xx for the client's mistakes).

Built around a :class:`qrag.service.RetrievalService`; Ray Serve mounts it as its ingress
(``qrag.distributed.serving``), tests mount it in-process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from starlette.exceptions import HTTPException as StarletteHTTPException

from .service import RetrievalService, RetrieveParams, ServiceError

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
    wait: StrictBool = True


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


class BodyGuard:
    """Reads the body before the app does: refuses oversized (413) and non-UTF-8 (400) bodies."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        ctype = headers.get(b"content-type")
        if ctype is None:  # curl -d and many clients omit it: the API only speaks JSON
            scope = {**scope, "headers": [*scope.get("headers", []), (b"content-type", b"application/json")]}
        elif not ctype.split(b";")[0].strip().lower().endswith(b"json"):
            return await _error(415, "content-type", f"send JSON (application/json), not {ctype.decode('latin-1')}")(scope, receive, send)
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
) -> FastAPI:
    """The FastAPI app for ``service``; ``static`` holds the web page's files by name."""
    api = FastAPI(title="qrag retriever", version="1", description="Q-RAG multi-step retrieval over sharded chunk indexes.")
    static = static or {}

    @api.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError):
        return _error(exc.status, exc.field, exc.message, exc.headers)

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
        return _error(exc.status_code, None, str(exc.detail))

    @api.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return _error(500, None, f"internal error: {type(exc).__name__}")

    if on_request is not None:
        @api.middleware("http")
        async def count(request: Request, call_next):
            t0 = time.perf_counter()
            response = await call_next(request)
            route = request.scope.get("route")
            on_request(getattr(route, "path", "unmatched"), response.status_code, time.perf_counter() - t0)
            return response

    # -- page --------------------------------------------------------------------------------

    @api.get("/", include_in_schema=False)
    async def page():
        if "index.html" not in static:
            return _error(404, None, "no web page bundled with this server")
        return Response(static["index.html"], media_type=STATIC_TYPES[".html"])

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

    @api.post("/v1/corpora", status_code=201, summary="Create a corpus (optionally with documents)")
    async def create_corpus(body: CreateCorpus):
        out = await service.create(body.name, [d.model_dump() for d in body.documents] if body.documents else None, body.chunk_tokens, body.wait)
        return out if body.wait or not body.documents else JSONResponse(out, status_code=202)

    @api.get("/v1/corpora/{name}", summary="Corpus stats: documents, chunks, tokens, shards, bytes")
    async def corpus_stats(name: str):
        return await service.corpus_stats(name)

    @api.delete("/v1/corpora/{name}", summary="Delete a corpus")
    async def delete_corpus(name: str):
        return await service.delete(name)

    @api.post("/v1/corpora/{name}/documents", summary="Append documents (send large uploads in several requests)")
    async def append(name: str, body: AppendDocuments):
        out = await service.append(name, [d.model_dump() for d in body.documents], body.wait)
        return out if body.wait else JSONResponse(out, status_code=202)

    @api.post("/v1/corpora/{name}/reindex", status_code=202, summary="Re-embed a corpus with the served model")
    async def reindex(name: str):
        return await service.reindex(name)

    @api.get("/v1/jobs/{job_id}", summary="Progress of an indexing job")
    async def job(job_id: str):
        return service.job(job_id)

    @api.post("/v1/retrieve", summary="Multi-step retrieval over a corpus or an inline context")
    async def retrieve(body: RetrieveRequest):
        params = RetrieveParams(**body.model_dump())
        if params.stop_threshold is not None:
            params.stop_threshold = float(params.stop_threshold)
        return await service.retrieve(params)

    api.add_middleware(BodyGuard, limit=service.cfg.max_body_bytes)
    return api


def static_files(folder) -> dict[str, bytes]:
    """The web page's files (read once, so replicas on other nodes need no shared disk)."""
    root = Path(folder)
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.suffix in STATIC_TYPES} if root.is_dir() else {}


__all__ = ["build_api", "static_files", "BodyGuard"]
