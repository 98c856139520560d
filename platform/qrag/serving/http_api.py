"""The HTTP face of the retrieval service: FastAPI routes under /v1, OpenAPI at /docs (the
bodies and answers of :mod:`qrag.serving.api_models`, the bearer keys as a security scheme),
the web page at /, and JSON errors that name the field at fault (4xx for the client's mistakes).

The ASGI guards around the routes (keys by the route reached, Host, Origin, body bounds) are in
:mod:`qrag.serving.http_guards`. Bodies from ``OFF_LOOP_BYTES`` on are parsed and validated in
worker threads (:class:`OffLoopRoute`), so one large request never stalls the event loop.

Built around a :class:`qrag.serving.service.RetrievalService`; Ray Serve mounts it as its ingress
(``qrag.distributed.serving``), tests mount it in-process.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from qrag.index.store import StoreError
from qrag.serving.api_models import (
    AppendDocuments,
    CorpusJobs,
    CorpusList,
    CorpusStats,
    CreateCorpus,
    Deleted,
    DocumentIn,  # noqa: F401
    ErrorBody,
    Health,
    Job,
    JobAnswer,
    Reindex,
    RetrieveAnswer,
    RetrieveRequest,
)
from qrag.serving.errors import ServiceError, os_error, store_error
from qrag.serving.http_guards import (
    KEY_SCOPE,
    OFF_LOOP_BYTES,
    PUBLIC_ROUTES,
    BodyGuard,
    Guard,
    Observed,
    RouteTable,
    SecurityHeaders,
    error_response,
    off_loop,
)
from qrag.serving.http_headers import PAGE_HEADERS
from qrag.serving.retrieval import RetrieveParams
from qrag.serving.service import RetrievalService

log = logging.getLogger("qrag.http")

STATIC_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
BEARER = "bearer"  # the OpenAPI security scheme of the API keys
_error = error_response


# What pydantic puts in an error's location for the member of a union a value failed, e.g.
# ("beam_temperature", "float") for a field typed StrictFloat | StrictInt: not a field of the request.
_UNION_MEMBERS = {"float", "int", "str", "bool", "none"}


def _field(loc: tuple[Any, ...]) -> str | None:
    """("body", "documents", 3, "text") -> "documents[3].text"; ("body", "stop_threshold", "float") ->
    "stop_threshold"."""
    parts = [p for p in loc if p not in ("body", "query", "path")]
    while len(parts) > 1 and parts[-1] in _UNION_MEMBERS:
        parts.pop()
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


# -- bodies parsed off the event loop -------------------------------------------------------------


def parse_body(adapter: TypeAdapter, body: bytes) -> Any:
    """Parse and validate a body as FastAPI does (same errors), for a worker thread."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        raise RequestValidationError(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", e.pos),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": e.msg},
                }
            ]
        ) from None
    except RecursionError:
        raise RequestValidationError(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body",),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": "arrays or objects nested too deeply"},
                }
            ]
        ) from None
    try:
        return adapter.validate_python(data)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        ) from None


class OffLoopRoute(APIRoute):
    """A route whose bodies of ``OFF_LOOP_BYTES`` and more are parsed and validated in the body
    worker threads: FastAPI then finds the validated model and takes it as it is."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler
        adapter = TypeAdapter(self.body_field.field_info.annotation)

        async def handle(request: Request) -> Response:
            body = await request.body()
            if len(body) >= OFF_LOOP_BYTES:
                request._json = await off_loop(parse_body, adapter, body)  # what Request.json() returns from now on
            return await handler(request)

        return handle


# -- OpenAPI --------------------------------------------------------------------------------------

ERRORS = {
    status: {"model": ErrorBody, "description": what}
    for status, what in (
        (400, "Invalid JSON, a body that is not UTF-8, a repeated header"),
        (401, "No or unknown API key"),
        (403, "A read key on a write, or a cross-origin write"),
        (413, "Body too large, too many documents or JSON values"),
        (415, "Not JSON"),
        (421, "Host not in allowed_hosts"),
        (422, "A field of the wrong type or out of range (named in 'field')"),
        (503, "Overloaded, a backend failed, or past request_timeout_s (Retry-After)"),
    )
}


def with_security(schema: dict[str, Any], public: frozenset[str]) -> dict[str, Any]:
    """The bearer keys as a security scheme: required on every operation but the public ones
    (/healthz takes one optionally: its details need a read key)."""
    schema.setdefault("components", {}).setdefault("securitySchemes", {})[BEARER] = {
        "type": "http",
        "scheme": "bearer",
        "description": "An API key: 'Authorization: Bearer <key>' (read or write scope).",
    }
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            operation["security"] = [{}, {BEARER: []}] if path in public else [{BEARER: []}]
    return schema


def install_openapi(api: FastAPI, keyed: bool, public: frozenset[str]) -> None:
    """OpenAPI with the key scheme when the server has keys (built once, as FastAPI does)."""

    def openapi() -> dict[str, Any]:
        if api.openapi_schema is None:
            schema = get_openapi(title=api.title, version=api.version, description=api.description, routes=api.routes)
            api.openapi_schema = with_security(schema, public) if keyed else schema
        return api.openapi_schema

    api.openapi = openapi


def build_api(
    service: RetrievalService,
    static: dict[str, bytes] | None = None,
    on_request: Callable[[str, int, float], None] | None = None,
    keys: dict[str, str] | None = None,
):
    """The ASGI app for ``service``: FastAPI routes inside the guards. ``static`` holds the web
    page's files by name; ``keys`` maps API-key digests to scopes (see :mod:`qrag.serving.auth`)."""
    api = FastAPI(
        title="qrag retriever", version="1", description="Q-RAG multi-step retrieval over sharded chunk indexes."
    )
    api.router.route_class = OffLoopRoute
    static = static or {}
    cfg = service.cfg
    keys = keys or {}
    install_openapi(api, bool(keys), PUBLIC_ROUTES)

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
            return _error(
                400,
                "body",
                f"invalid JSON: {err.get('ctx', {}).get('error', err.get('msg'))} "
                f"(at character {err['loc'][-1] if len(err['loc']) > 1 else '?'})",
            )
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
        suffix = name[name.rfind(".") :]
        return Response(static[name], media_type=STATIC_TYPES.get(suffix, "application/octet-stream"))

    # -- API ---------------------------------------------------------------------------------
    # Answers carry exactly the fields the service gave (exclude_unset): the models document them.
    answers = {"response_model_exclude_unset": True, "responses": ERRORS}

    @api.get(
        "/healthz",
        response_model=Health,
        summary="Health; with a read key (or on a server without keys) also which model is served",
        **answers,
    )
    async def healthz(request: Request):
        if keys and KEY_SCOPE not in request.scope:  # strangers learn that it runs, not what
            return {"status": "ok"}
        return await service.health()

    @api.get("/v1/corpora", response_model=CorpusList, summary="List corpora", **answers)
    async def list_corpora():
        return {"corpora": service.list_corpora()}

    def accepted(out: dict[str, Any], status: int = 200):
        """202 while the job goes on (wait:false, or it outlasted job_wait_s)."""
        job = out.get("job")
        return JSONResponse(out, status_code=202 if job and job["state"] in ("queued", "running") else status)

    @api.post(
        "/v1/corpora",
        status_code=201,
        response_model=JobAnswer,
        summary="Create a corpus (optionally with documents); visible once indexed",
        **answers,
    )
    async def create_corpus(body: CreateCorpus):
        out = await service.create(
            body.name,
            [d.model_dump() for d in body.documents] if body.documents else None,
            body.chunk_tokens,
            body.wait,
        )
        return accepted(out, 201)

    @api.get(
        "/v1/corpora/{name}",
        response_model=CorpusStats,
        summary="Corpus stats: documents, chunks, tokens, shards, bytes",
        **answers,
    )
    async def corpus_stats(name: str):
        return await service.corpus_stats(name)

    @api.delete("/v1/corpora/{name}", response_model=Deleted, summary="Delete a corpus", **answers)
    async def delete_corpus(name: str):
        return await service.delete(name)

    @api.post(
        "/v1/corpora/{name}/documents",
        response_model=JobAnswer,
        summary="Append documents (send large uploads in several requests)",
        **answers,
    )
    async def append(name: str, body: AppendDocuments):
        out = await service.append(name, [d.model_dump() for d in body.documents], body.wait)
        return accepted(out)

    @api.post(
        "/v1/corpora/{name}/reindex",
        status_code=202,
        response_model=JobAnswer,
        summary="Re-embed a corpus with the served model (one at a time per corpus)",
        **answers,
    )
    async def reindex(name: str, body: Reindex | None = None):
        return accepted(await service.reindex(name, wait=body.wait if body else False), 200)

    @api.get(
        "/v1/corpora/{name}/jobs",
        response_model=CorpusJobs,
        summary="The corpus's recent indexing jobs, newest first",
        **answers,
    )
    async def corpus_jobs(name: str):
        return await asyncio.to_thread(service.corpus_jobs, name)

    @api.get(
        "/v1/jobs/{job_id}",
        response_model=Job,
        summary="Progress of an indexing job (any replica answers; outcomes survive restarts)",
        **answers,
    )
    async def job(job_id: str):
        return await asyncio.to_thread(service.job, job_id)

    @api.post(
        "/v1/retrieve",
        response_model=RetrieveAnswer,
        summary="Multi-step retrieval over a corpus or an inline context",
        **answers,
    )
    async def retrieve(body: RetrieveRequest):
        # The answer as it is (RetrieveAnswer documents it): the hot route skips re-validating
        # and re-encoding the service's own dict through the model.
        return JSONResponse(await service.retrieve(RetrieveParams(**body.model_dump())))

    if cfg.cors_origins:
        api.add_middleware(
            CORSMiddleware,
            allow_origins=list(cfg.cors_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["authorization", "content-type"],
        )
    routes = RouteTable(lambda: api.router.routes)
    app = BodyGuard(api, limit=cfg.max_body_bytes, max_documents=cfg.max_documents, routes=routes)
    app = Guard(
        app,
        keys=keys,
        allowed_hosts=list(cfg.allowed_hosts),
        cors_origins=list(cfg.cors_origins),
        timeout_s=cfg.request_timeout_s,
        retry_after_s=cfg.retry_after_s,
        routes=routes,
    )
    app = SecurityHeaders(app)  # on the guards' refusals too
    if on_request is not None:
        app = Observed(app, routes, on_request)
    app.api = api  # the FastAPI object (routes, OpenAPI), for callers that add routes
    app.add_exception_handler = api.add_exception_handler  # Serve maps its overload errors through it
    return app


def static_files(folder) -> dict[str, bytes]:
    """The web page's files (read once, so replicas on other nodes need no shared disk)."""
    root = Path(folder)
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.suffix in STATIC_TYPES} if root.is_dir() else {}


__all__ = ["build_api", "static_files", "BodyGuard", "Guard", "OffLoopRoute"]
