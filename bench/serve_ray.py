"""Shard layouts through Ray Serve on one GPU (issue 14): HTTP end to end via Serve's proxy.

`bench/serve_http.py` timed the service's FastAPI app in process (no Ray); this times the Serve
application that `serve/config.yaml` deploys (`qrag.distributed.serving.build_app`: Ingress ->
Encoder -> Shard deployments), on one local Ray cluster (127.0.0.1), for each value of
`ServeConfig.shard_deployments` in --layouts (the shards spread over that many Shard
deployments; = --shards is one deployment per shard, the default), and for `colocate: true` (the
Ingress alone, holding the encoder and every shard: no handle calls per step). Per layout:

* sequential: --queries questions one after another (concurrency 1), p50/p99;
* concurrent: --concurrency clients in a closed loop for --load-seconds, queries/s and p50/p99.

The corpus is built first by the library in a child process (`bench/two_gpu.py`'s builder: books
cycled until --tokens, --shards shards). Prints one JSON line and writes --out.

One-GPU machine, from the repository root, carrying Ray's wheels (.carry/two/whl, as for
`bench/two_gpu.py`), an encoder config (.carry/two/minilm16: random-init weights of MiniLM's
shape, same speed) and books:
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/two/whl/*.whl \\
      && export PYTHONPATH=/tmp/site && HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 python3 bench/serve_ray.py \\
           --random-encoder .carry/two/minilm16 --corpus .carry/two/novels --out $OUT/serve_ray.json --ray-logs $OUT/raylogs
CPU check (tiny): python bench/serve_ray.py --gpus 0 --cpus 2 --tokens 30000 --queries 10 --load-seconds 3 --concurrency 2
    --random-encoder DIR --corpus ../shared/data/gutenberg_novels --corpus-workers 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_common import free_port  # noqa: E402
from two_gpu import (  # noqa: E402
    Load, RayHead, cluster_env, copy_ray_logs, corpus_and_ray_args, corpus_in_child, gpu_assignment, random_encoder, time_queries,
    wait_healthy,
)


def args_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=None, help="GPUs for Ray (default: all torch sees, at most 1); 0 = a CPU check")
    corpus_and_ray_args(ap, tokens=10_000_000, shards=4)
    ap.add_argument("--layouts", default="4,1,colocated", help="layouts to time, in order: shard_deployments values, or 'colocated' "
                    "(colocate: true, the Ingress holds the encoder and every shard; default 4,1,colocated)")
    ap.add_argument("--steps", type=int, default=4, help="retrieval steps per query (default 4)")
    ap.add_argument("--queries", type=int, default=200, help="sequential queries per layout")
    ap.add_argument("--concurrency", type=int, default=8, help="closed-loop clients of the concurrent phase")
    ap.add_argument("--load-seconds", type=float, default=20.0, help="length of the concurrent phase")
    ap.add_argument("--encoder-gpus", type=float, default=0.2, help="GPU fraction of the Encoder; the shards share the rest")
    ap.add_argument("--max-ongoing", type=int, default=64, help="max_ongoing_requests of the Ingress")
    ap.add_argument("--out", help="also write the JSON here")
    return ap


COLOCATED = "colocated"


def layout_deployments(shards: int, holders: int | str, gpus: int, encoder_gpus: float, max_ongoing: int) -> list[dict]:
    """Serve's per-deployment options (the `deployments:` section of serve/config.yaml) for
    ``holders`` Shard deployments sharing one GPU with the Encoder, or the colocated Ingress
    holding the whole GPU."""
    ingress = {"name": "Ingress", "max_ongoing_requests": max_ongoing, "max_queued_requests": 4 * max_ongoing}
    if holders == COLOCATED:
        return [{**ingress, "ray_actor_options": {"num_cpus": 0, "num_gpus": 1.0 if gpus else 0.0}}]
    shard_gpus = round((1.0 - encoder_gpus) / holders, 4) if gpus else 0.0
    return [ingress,
            {"name": "Encoder", "ray_actor_options": {"num_cpus": 0, "num_gpus": encoder_gpus if gpus else 0.0}},
            *({"name": f"Shard{i}", "ray_actor_options": {"num_cpus": 0, "num_gpus": shard_gpus}} for i in range(holders))]


def layout_config(args, holders: int | str):
    """The app's ServeConfig for one layout."""
    from qrag.serving.service_config import ServeConfig

    device = "cuda" if args.gpus else "cpu"
    colocate = holders == COLOCATED
    return ServeConfig(checkpoint=args.checkpoint, storage=args.storage, shards=args.shards, colocate=colocate,
                       shard_deployments=1 if colocate else holders,
                       encoder_device=device, shard_device=device, faiss="never", chunk_tokens=args.chunk_tokens,
                       http_host="127.0.0.1")  # what serve.start binds: the app refuses a public address without API keys


def deploy_layout(args, holders: int | str, port: int) -> str:
    from ray import serve

    from qrag.distributed.serving import build_app

    serve.run(build_app(layout_config(args, holders), {}, layout_deployments(args.shards, holders, args.gpus, args.encoder_gpus,
                                                                              args.max_ongoing)),
              name="qrag", route_prefix="/")
    return wait_healthy(f"http://127.0.0.1:{port}")


def main() -> None:
    args = args_parser().parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    layouts = [x.strip() if x.strip() == COLOCATED else int(x) for x in args.layouts.split(",") if x.strip()]
    if any(d != COLOCATED and not 1 <= d <= args.shards for d in layouts):
        raise SystemExit(f"serve_ray.py: a layout is 'colocated' or between 1 and --shards ({args.shards}), got {layouts}")
    if args.gpus is None:
        import torch

        args.gpus = min(1, torch.cuda.device_count())
    from bench_common import machine_info, write_result

    tmp = Path(tempfile.mkdtemp(prefix="qrag_serve_ray_"))
    args.storage = str(Path(args.storage).resolve()) if args.storage else str(tmp / "indexes")
    if args.random_encoder:
        os.environ["QRAG_ENCODER"] = random_encoder(args.random_encoder, tmp / "encoder")
    corpus, questions = corpus_in_child(args)
    head = RayHead(tmp, args.gpus, args.cpus, cluster_env(), dashboard=args.dashboard)
    result: dict = {"bench": "serve_ray", **machine_info(), "gpus": args.gpus, "corpus": corpus, "steps": args.steps,
                    "encoder": f"random-init, shape of {args.random_encoder}" if args.random_encoder else os.environ.get("QRAG_ENCODER", "minilm (bundled)"),
                    "settings": {"shards": args.shards, "layouts": layouts, "queries": args.queries, "concurrency": args.concurrency,
                                 "load_seconds": args.load_seconds, "encoder_gpus": args.encoder_gpus, "max_ongoing_requests": args.max_ongoing},
                    "layouts": {}}
    try:
        import ray
        from ray import serve

        ray.init(address=head.address, logging_level="ERROR", log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for holders in layouts:
            t0 = time.perf_counter()
            url = deploy_layout(args, holders, port)
            row: dict = {"deploy_seconds": round(time.perf_counter() - t0, 1)}
            row["sequential"] = time_queries(url, questions, args.queries, args.steps)
            with Load(url, questions, args.concurrency, args.steps) as load:
                time.sleep(args.load_seconds)
            row["concurrent"] = load.summary()
            row["placement"] = gpu_assignment()
            key = COLOCATED if holders == COLOCATED else f"shard_deployments_{holders}"
            result["layouts"][key] = row
            print(f"serve_ray.py: {key}: {row}", file=sys.stderr, flush=True)
            serve.delete("qrag")
        result["complete"] = True
        serve.shutdown()
        ray.shutdown()
    except BaseException:
        traceback.print_exc()  # before the cluster stops: a driver that loses the GCS is aborted without a traceback
        raise
    finally:
        head.stop()
        if args.ray_logs:
            copy_ray_logs(tmp / "ray", Path(args.ray_logs))
    print(json.dumps(result))
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
