"""bench/serve_ray.py's Serve plan: the deployments a layout asks for and a config the app accepts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def serve_ray():
    sys.path.insert(0, str(ROOT / "bench"))
    import serve_ray

    return serve_ray


@pytest.mark.parametrize("holders", [1, 2, 4])
def test_layout_deployments_share_one_gpu(serve_ray, holders):
    plan = serve_ray.layout_deployments(shards=4, holders=holders, gpus=1, encoder_gpus=0.2, max_ongoing=64)
    names = [d["name"] for d in plan]
    assert names == ["Ingress", "Encoder", *(f"Shard{i}" for i in range(holders))]
    gpu = sum(d.get("ray_actor_options", {}).get("num_gpus", 0.0) for d in plan)
    assert 0.99 <= gpu <= 1.0  # the encoder and the shard deployments fill the one GPU, no more
    cpu_plan = serve_ray.layout_deployments(shards=4, holders=holders, gpus=0, encoder_gpus=0.2, max_ongoing=64)
    assert all(d.get("ray_actor_options", {}).get("num_gpus", 0.0) == 0.0 for d in cpu_plan)


def test_layout_config_is_one_the_app_starts_with(serve_ray, tmp_path):
    """The bench binds Serve to 127.0.0.1 without API keys: the app must know the address is
    loopback, or its Ingress refuses to start (it did, before the config named the host)."""
    from qrag.serving.auth import startup_problem

    args = serve_ray.args_parser().parse_args(["--storage", str(tmp_path), "--gpus", "0"])
    for holders in (4, 1, serve_ray.COLOCATED):
        cfg = serve_ray.layout_config(args, holders)
        assert cfg.shard_holders() == (1 if holders == serve_ray.COLOCATED else holders)
        assert cfg.colocate == (holders == serve_ray.COLOCATED)
        assert startup_problem(cfg.http_host, {}, cfg.allow_unauthenticated) is None


def test_colocated_layout_is_the_ingress_with_the_whole_gpu(serve_ray):
    plan = serve_ray.layout_deployments(shards=4, holders=serve_ray.COLOCATED, gpus=1, encoder_gpus=0.2, max_ongoing=64)
    assert [d["name"] for d in plan] == ["Ingress"] and plan[0]["ray_actor_options"]["num_gpus"] == 1.0
