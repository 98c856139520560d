"""bench/serve_ray.py's plan: the app it deploys per layout (as serve/config.yaml ships it, or
spread over GPUs), the Ray environment per variant, and Serve's spans read back."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def serve_ray():
    sys.path.insert(0, str(ROOT / "bench"))
    import serve_ray

    return serve_ray


def plan(serve_ray, layout: str, gpus: int):
    args = serve_ray.args_parser().parse_args(["--storage", "/tmp/unused", "--gpus", str(gpus)])
    return serve_ray.layout_app(serve_ray.app_config(args.config), layout, args, gpus)


def test_the_default_layout_is_the_shipped_config(serve_ray):
    """`default` deploys serve/config.yaml's app as shipped, bound to loopback without keys (the
    Ingress would refuse to start if the app thought the address public)."""
    from qrag.serving.auth import startup_problem
    from qrag.serving.service_config import ServeConfig

    conf, deployments = plan(serve_ray, "default", gpus=1)
    shipped = serve_ray.app_config(str(ROOT / "serve" / "config.yaml"))
    assert deployments == shipped["deployments"]
    assert {k: v for k, v in conf.items() if k not in ("storage", "checkpoint", "http_host")} == {
        k: v for k, v in shipped["args"].items() if k not in ("storage", "checkpoint", "http_host")
    }
    cfg = ServeConfig(**conf)
    assert cfg.shard_deployments == 0 and startup_problem(cfg.http_host, {}, cfg.allow_unauthenticated) is None


@pytest.mark.parametrize("gpus", [1, 2])
def test_replicas_share_each_gpu(serve_ray, gpus):
    _, deployments = plan(serve_ray, "per_gpu=3", gpus=gpus)
    ingress = next(d for d in deployments if d["name"] == "Ingress")
    assert ingress["num_replicas"] == 3 * gpus and ingress["ray_actor_options"]["num_gpus"] == pytest.approx(
        1 / 3, abs=1e-3
    )


@pytest.mark.parametrize("gpus", [2, 4])
def test_replicas_take_a_whole_gpu_each(serve_ray, gpus):
    """replicas=N spreads N copies over N GPUs: the app's default share (1 / replicas_per_gpu)
    would let Ray pack two of them onto one GPU and leave another idle."""
    _, deployments = plan(serve_ray, f"replicas={gpus}", gpus=gpus)
    ingress = next(d for d in deployments if d["name"] == "Ingress")
    assert ingress["num_replicas"] == gpus and ingress["ray_actor_options"]["num_gpus"] == 1
    _, deployments = plan(serve_ray, "replicas=2", gpus=0)
    assert next(d for d in deployments if d["name"] == "Ingress")["ray_actor_options"]["num_gpus"] == 0


def test_one_gpu_against_two_is_a_ratio_of_the_same_layout(serve_ray):
    def row(best, peaks):
        return {
            "max_queries_per_s_with_p99_under_limit": best,
            "curve": [{"queries_per_s": q} for q in peaks],
        }

    keys = [serve_ray.layout_key("default", "haproxy", n, True) for n in (1, 2)]
    assert keys == ["default@haproxy@1gpu", "default@haproxy@2gpu"]
    assert serve_ray.layout_key("default", "classic", 1, False) == "default"
    result = {
        "layouts": {
            keys[0]: row(500.0, [80.0, 550.0]),
            keys[1]: row(950.0, [85.0, 1100.0]),
            "shards=2@haproxy@2gpu": row(300.0, [310.0]),  # measured on two only: no ratio
            "default@classic@1gpu": row(None, [90.0]),  # nothing under the p99 limit
            "default@classic@2gpu": row(200.0, [210.0]),
        }
    }
    got = serve_ray.scaling(result, [1, 2])
    assert set(got) == {"default@haproxy", "default@classic"}
    assert got["default@haproxy"]["best_qps_p99_under_limit"] == {"1gpu": 500.0, "2gpu": 950.0, "ratio": 1.9}
    assert got["default@haproxy"]["peak_qps"]["ratio"] == 2.0
    assert got["default@classic"]["best_qps_p99_under_limit"]["ratio"] is None
    assert serve_ray.scaling(result, [1]) == {}


def test_gpu_counts_beyond_the_machine_are_refused(serve_ray, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["serve_ray.py", "--storage", "/tmp/unused", "--gpus", "1", "--gpu-counts", "1,2"])
    with pytest.raises(SystemExit, match="beyond the machine's 1 GPUs"):
        serve_ray.main()


def test_shard_deployments_take_a_gpu_each_beside_the_ingress(serve_ray):
    conf, deployments = plan(serve_ray, "shards=4", gpus=4)
    gpus = {d["name"]: d["ray_actor_options"]["num_gpus"] for d in deployments}
    assert conf["shard_deployments"] == 4 and sorted(gpus) == ["Ingress", "Shard0", "Shard1", "Shard2", "Shard3"]
    assert all(gpus[f"Shard{i}"] > 0.5 for i in range(4))  # no two shards on one GPU
    assert gpus["Ingress"] + gpus["Shard0"] <= 1.0  # the Ingress fits beside one shard
    conf, deployments = plan(serve_ray, "shards=2", gpus=0)
    assert all(d.get("ray_actor_options", {}).get("num_gpus", 0.0) == 0.0 for d in deployments)
    assert conf["encoder_device"] == conf["shard_device"] == "cpu"


def test_unknown_layouts_and_environments_are_refused(serve_ray):
    with pytest.raises(SystemExit, match="unknown layout"):
        plan(serve_ray, "colocated", gpus=1)
    with pytest.raises(SystemExit, match="unknown --serve-env"):
        serve_ray.serve_env("fast", 0.0)
    assert serve_ray.serve_env("throughput", 0.0)["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"  # Serve's proxy kept
    assert "RAY_SERVE_TRACING_SAMPLING_RATIO" in serve_ray.serve_env("classic", 0.1)
    assert serve_ray.serve_env("haproxy", 0.0)["RAY_SERVE_ENABLE_HA_PROXY"] == "1"  # HAProxy instead of the proxy


def test_spans_are_read_once_each(serve_ray, tmp_path):
    """Spans files grow between layouts: each reading takes only what was written since."""
    folder = tmp_path / "serve" / "spans"
    folder.mkdir(parents=True)

    def span(name: str, ms: int) -> str:
        return (
            json.dumps(
                {
                    "name": name,
                    "start_time": "2026-11-28T00:00:00.000000Z",
                    "end_time": f"2026-11-28T00:00:00.{ms:03d}000Z",
                },
                indent=4,
            )
            + "\n"
        )

    (folder / "proxy").write_text(span("proxy_http_request", 10) + span("proxy_http_request", 20))
    offsets: dict[str, int] = {}
    first = serve_ray.new_spans(tmp_path, offsets)
    assert first == {"proxy_http_request": [pytest.approx(10.0), pytest.approx(20.0)]}
    with open(folder / "proxy", "a") as fh:
        fh.write(span("proxy_http_request", 30) + span("replica_handle_request", 5)[:-20])  # the last one half written
    second = serve_ray.new_spans(tmp_path, offsets)
    assert second == {"proxy_http_request": [pytest.approx(30.0)]}
    assert serve_ray.span_summary(first)["proxy_http_request"]["mean_ms"] == pytest.approx(15.0)


def test_the_ray_wheel_shrinks_without_jars_and_source_maps_and_its_record_matches(tmp_path):
    import csv
    import io
    import subprocess
    import zipfile

    wheel = tmp_path / "ray-0-py3-none-any.whl"
    files = {
        "ray/__init__.py": b"x = 1\n",
        "ray/jars/ray_dist.jar": b"j" * 1000,
        "ray/dashboard/client/build/static/js/main.js": b"js",
        "ray/dashboard/client/build/static/js/main.js.map": b"m" * 1000,
    }
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("ray-0.dist-info/RECORD", "".join(f"{n},sha256=x,{len(d)}\n" for n, d in files.items()))
    subprocess.run([sys.executable, str(ROOT / "bench" / "serve_gpu_wheel.py"), str(wheel)], check=True)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        record = [r[0] for r in csv.reader(io.StringIO(z.read("ray-0.dist-info/RECORD").decode()))]
    kept = {"ray/__init__.py", "ray/dashboard/client/build/static/js/main.js"}
    assert names == kept | {"ray-0.dist-info/RECORD"}
    assert set(record) == kept


def test_the_serve_gpu_call_refuses_to_run_without_ray_installed_by_the_call_before(tmp_path):
    import subprocess

    got = subprocess.run(
        ["bash", "bench/serve_gpu.sh", "run"],
        cwd=ROOT,
        env={
            **os.environ,
            "OUT": str(tmp_path / "out"),
            "SITE": str(tmp_path / "site"),
            "WORK": str(tmp_path / "work"),
            "CARRY": str(tmp_path / "none"),
        },
        capture_output=True,
        text=True,
    )
    assert got.returncode == 2 and "run 'wheels' in the call before" in got.stderr


def test_the_serve_gpu_calls_stage_each_carried_part_for_the_run(tmp_path):
    """The carry does not fit one call: each call's part of .carry/serve joins one staged copy in
    /tmp, and the run names a part that no call has carried yet."""
    import subprocess

    def call(mode: str, carry: Path):
        env = {
            **os.environ,
            "OUT": str(tmp_path / "out"),
            "SITE": str(tmp_path / "site"),
            "WORK": str(tmp_path / "work"),
            "CARRY": str(carry),
            "WHEELS": str(tmp_path / "no_wheels"),
        }
        return subprocess.run(["bash", "bench/serve_gpu.sh", mode], cwd=ROOT, env=env, capture_output=True, text=True)

    first, second = tmp_path / "part1", tmp_path / "part2"
    (first / "data" / "babi").mkdir(parents=True)
    (first / "provenance.env").write_text("QRAG_COMMIT=abc\n")
    (second / "minilm").mkdir(parents=True)
    (second / "minilm" / "config.json").write_text("{}")
    (tmp_path / "site" / "ray").mkdir(parents=True)  # stands in for what 'wheels' installed
    assert call("wheels", first).returncode == 0
    missing = call("run", tmp_path / "nothing_carried")
    assert missing.returncode == 2 and "no minilm staged" in missing.stderr
    assert "carry .carry/serve/minilm" in missing.stderr
    assert call("wheels", second).returncode == 0
    staged = tmp_path / "work" / "carry"
    assert (staged / "data" / "babi").is_dir() and (staged / "minilm" / "config.json").is_file()
    assert (staged / "provenance.env").read_text() == "QRAG_COMMIT=abc\n"


def test_a_serve_gpu_call_can_run_later_parts_only_after_the_train_part(tmp_path):
    """PARTS splits the run over calls on one warm machine; a part that needs the checkpoint
    names the part that makes it."""
    import subprocess

    carried = tmp_path / "carry"
    (carried / "data" / "gutenberg_novels").mkdir(parents=True)
    (carried / "minilm").mkdir(parents=True)
    (tmp_path / "site" / "ray").mkdir(parents=True)
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "SITE": str(tmp_path / "site"),
        "WORK": str(tmp_path / "work"),
        "CARRY": str(carried),
        "PARTS": "serve",
    }
    got = subprocess.run(["bash", "bench/serve_gpu.sh", "run"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert got.returncode == 2 and "run the train part first" in got.stderr
