"""The address Serve's HTTP proxies really bind, asked of the Serve controller.

``http_options.host`` decides who can reach the app, whatever a config field of ours says; the
controller holds the value the proxies were started with (and direct-ingress replicas use too).
Ray has no public API for it: this reads the controller's ``get_http_config``, the call Serve's
own replicas make. Anything that goes wrong counts as a public bind, so the app then refuses to
start without API keys. Serve's HAProxy ingress (``RAY_SERVE_ENABLE_HA_PROXY``) binds the same host:
HAProxy's HTTP port and each Ingress replica's own HTTP port both take ``http_options.host``.
"""

from __future__ import annotations

import asyncio
import logging

import ray

log = logging.getLogger("qrag.serving")

# What an unknown bind is taken for: reachable from every interface.
PUBLIC = "0.0.0.0"


def _controller():
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


async def proxy_bind_host(timeout_s: float = 10.0) -> str:
    """The host Serve's HTTP proxies bind (``http_options.host``), or :data:`PUBLIC` when the
    controller cannot tell within ``timeout_s``."""
    try:
        controller = await asyncio.wait_for(asyncio.to_thread(_controller), timeout_s)
        options = await asyncio.wait_for(controller.get_http_config.remote(), timeout_s)
    except Exception as exc:  # no Serve, another Ray version, a slow controller: all unknown
        log.warning("the HTTP proxies' bind address is unknown (%s: %s); taken as public", type(exc).__name__, exc)
        return PUBLIC
    host = getattr(options, "host", None)
    return host if isinstance(host, str) and host.strip() else PUBLIC


__all__ = ["PUBLIC", "proxy_bind_host"]
