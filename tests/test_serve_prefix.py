"""Issue 32 findings 1 and 5 on Ray Serve: the app deployed under a route_prefix other than '/'
still asks a key of every route but the public ones (and counts documents before parsing), and
the bind address the app checks is the one Serve's proxies really have."""

from __future__ import annotations

import asyncio
import os

import pytest

pytest.importorskip("ray.serve")

from qrag.client import AsyncClient  # noqa: E402
from qrag.serving.service_config import ServeConfig  # noqa: E402

from conftest import free_ports  # noqa: E402
from test_http_hardening import PREFIX, READ, WRITE, keys_by_route  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def prefixed(tiny_encoder, tmp_path_factory):
    """The default layout (shards in the Ingress) under route_prefix /prefix, with keys."""
    import ray
    from ray import serve

    from qrag.distributed.serving import build_app

    port, metrics_port = free_ports(2)
    cfg = ServeConfig(
        encoder=tiny_encoder,
        storage=str(tmp_path_factory.mktemp("serve") / "indexes"),
        shards=2,
        chunk_tokens=24,
        max_documents=50,
        max_body_bytes=200_000,
    )
    saved = os.environ.get("QRAG_API_KEYS")
    os.environ["QRAG_API_KEYS"] = f"{READ}:read,{WRITE}:write"  # the replicas inherit it, as from a Secret
    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=2,
        configure_logging=False,
        _metrics_export_port=metrics_port,
        log_to_driver=False,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port, "request_timeout_s": 60})
        serve.run(build_app(cfg, {}, [{"name": "Ingress", "num_replicas": 1}]), name="prefixed", route_prefix=PREFIX)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        if saved is None:
            os.environ.pop("QRAG_API_KEYS", None)
        else:
            os.environ["QRAG_API_KEYS"] = saved


def test_keys_follow_the_route_under_a_route_prefix(prefixed):
    asyncio.run(keys_by_route(lambda key: AsyncClient(prefixed + PREFIX, key)))


def test_the_bind_checked_is_the_proxies_own(prefixed):
    from qrag.distributed.proxy_bind import proxy_bind_host

    assert asyncio.run(proxy_bind_host()) == "127.0.0.1"  # what serve.start's http_options said
