"""Starlette middleware for Serve's HTTP proxy: drops the client headers with which a request
could disable the proxy's timeout (``x-request-timeout-seconds: 0``) or its disconnect handling.

Serve loads it from ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=qrag.distributed.proxy_guard:middlewares``
set in the environment of the Ray nodes (``qrag serve`` sets it; the RayService manifest too).
The ingress strips the same headers and enforces its own deadline, so a cluster without it
still bounds every request.
"""

from __future__ import annotations

from starlette.middleware import Middleware

from qrag.serving.http_headers import strip_headers  # light: the proxy must not import torch


class StripTimeoutHeaders:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope["headers"] = strip_headers(scope.get("headers"))
        await self.app(scope, receive, send)


def middlewares() -> list[Middleware]:
    return [Middleware(StripTimeoutHeaders)]
