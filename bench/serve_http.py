"""HTTP end to end against the library path, in one process, no Ray (issue 14 item 3).

The service's own FastAPI app (``qrag.serving.http_api.build_api``) over uvicorn on 127.0.0.1,
backed by the in-process encoder and shards (``qrag.serving.service.local_service``: the same
``RetrievalService`` that Ray Serve's ingress wraps, minus Serve's proxy and handle hops), timed
against the same service called directly on the same event loop, on the same questions:

* ``library``: ``await service.retrieve(...)`` (the service path without HTTP);
* ``http``: ``POST /v1/retrieve`` over a kept-alive connection per client, at concurrency 1 and
  at each ``--concurrency`` (closed loop: every client sends its next question when the last
  answer is in).

Each layout of shard holders in `--holders` is served in turn (`per-shard`: one holder per shard,
as the Serve deployments by default; `1`: every shard in one holder, as `shard_deployments: 1`),
with each `--state-batch` value (the in-process encoder embeds the states of concurrent requests
in one forward, up to that many). Reads a corpus built by ``bench/serve_scale.py --storage DIR``
(corpus ``bench``); on a GPU machine, after the serve_scale call in the same command:

    PYTHONPATH=platform python bench/serve_http.py --storage /tmp/idx10m --encoder $PWD/.carry/longctx/encoder \\
        --positions relative --shards 4 --out $OUT/serve_http_10m_h100.json

Needs fastapi and uvicorn (carry their wheels to the GPU image).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_common import free_port, git_commit, machine_info, write_result  # noqa: E402


def args_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--storage", required=True, help="index folder holding the corpus")
    ap.add_argument("--corpus", default="bench")
    ap.add_argument(
        "--encoder", default="minilm", help="the encoder the corpus was built with ('minilm' or a HF directory)"
    )
    ap.add_argument("--positions", default="relative", choices=["none", "absolute", "relative"])
    ap.add_argument("--shards", type=int, default=4, help="the corpus's shard count")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--concurrency", default="8,32", help="closed-loop HTTP clients, beside concurrency 1")
    ap.add_argument(
        "--holders",
        default="per-shard,1",
        help="shard-holder layouts timed, comma-separated: per-shard (one holder per shard, as the Serve "
        "deployments) and/or a number (1 = every shard in one holder: one scoring pass per step)",
    )
    ap.add_argument(
        "--state-batch",
        default="32",
        help="state_batch_size values timed, comma-separated: concurrent requests' states embedded in one forward "
        "(1 = one request per forward, the in-process encoder before it batched)",
    )
    ap.add_argument("--out", default=None)
    return ap


def summary(ms: list[float], seconds: float | None = None) -> dict:
    ms = sorted(ms)
    out = {
        "queries": len(ms),
        "p50_ms": round(statistics.median(ms), 3),
        "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 3),
        "mean_ms": round(statistics.fmean(ms), 3),
    }
    if seconds:
        out["queries_per_s"] = round(len(ms) / seconds, 1)
    return out


class Client:
    """One kept-alive HTTP/1.1 connection to the server."""

    def __init__(self, port: int):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def retrieve(self, body: dict) -> tuple[float, list[int]]:
        data = json.dumps(body).encode()
        t0 = time.perf_counter()
        self.conn.request("POST", "/v1/retrieve", data, {"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        payload = resp.read()
        ms = (time.perf_counter() - t0) * 1000
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {payload[:300]!r}")
        return ms, [s["chunk_id"] for s in json.loads(payload)["steps"]]


def main() -> None:
    args = args_parser().parse_args()
    import torch
    import uvicorn

    from qrag.retrieval.embedder import load_embedding_model, resolve_source
    from qrag.serving.http_api import build_api
    from qrag.serving.service import RetrieveParams, local_service
    from qrag.serving.service_config import ServeConfig
    from qrag.index.store import CorpusStore

    model = load_embedding_model(resolve_source(None, args.encoder), args.device, positions=args.positions)
    dev = model.device
    cfg = ServeConfig(storage=args.storage, encoder=args.encoder, shards=args.shards)
    # Questions made of corpus words, as serve_scale's (its helper reads the corpus on the CPU).
    from serve_scale import questions_from

    from qrag.index.local import LocalIndex
    from qrag.index.shards import ShardOptions

    store = CorpusStore(args.storage)
    questions = questions_from(
        LocalIndex(store, model, torch.device("cpu"), ShardOptions(faiss="never")), args.queries + 10
    )
    warm, timed = questions[:10], questions[10:]
    body = lambda q: {"question": q, "corpus": args.corpus, "max_steps": args.steps, "alternatives": 0}  # noqa: E731

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def measure(holders: int | None, state_batch: int) -> tuple[dict, list[list[int]]]:
        """One service (``holders`` shard holders: shard_deployments; ``state_batch``: state_batch_size), served on a
        fresh port: the library and HTTP paths."""
        service = local_service(
            replace(cfg, state_batch_size=state_batch), model, device=str(dev), holders=holders or cfg.shards
        )
        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(
                build_api(service),
                host="127.0.0.1",
                port=port,
                log_level="warning",
                access_log=False,
                loop="asyncio",
                # the library phase runs between the warm-up and the HTTP phase: on a slow
                # device it outlasts uvicorn's 5 s keep-alive, which closed the connection
                timeout_keep_alive=600,
            )
        )
        asyncio.run_coroutine_threadsafe(server.serve(), loop)
        deadline = time.time() + 60
        while not server.started:
            if time.time() > deadline:
                raise SystemExit("serve_http: uvicorn did not start")
            time.sleep(0.05)

        def library(q: str) -> tuple[float, list[int]]:
            params = RetrieveParams(question=q, corpus=args.corpus, max_steps=args.steps, alternatives=0)
            t0 = time.perf_counter()
            out = asyncio.run_coroutine_threadsafe(service.retrieve(params), loop).result(120)
            return (time.perf_counter() - t0) * 1000, [s["chunk_id"] for s in out["steps"]]

        client = Client(port)
        for q in warm:  # kernels, graphs, allocator, the connection
            library(q)
            client.retrieve(body(q))
        lib = [library(q) for q in timed]
        one = [client.retrieve(body(q)) for q in timed]
        row = {
            "holders": len(service.holders),
            "state_batch_size": state_batch,
            "library_concurrency_1": summary([ms for ms, _ in lib]),
            "http_concurrency_1": summary([ms for ms, _ in one]),
            "same_chunks_http_vs_library": round(sum(a[1] == b[1] for a, b in zip(lib, one)) / len(lib), 4),
            "http_closed_loop": [],
        }
        row["http_overhead_ms_p50"] = round(
            row["http_concurrency_1"]["p50_ms"] - row["library_concurrency_1"]["p50_ms"], 3
        )
        for c in [int(x) for x in args.concurrency.split(",") if x.strip()]:
            clients = [Client(port) for _ in range(c)]
            share = [timed[i::c] for i in range(c)]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                parts = list(pool.map(lambda i: [clients[i].retrieve(body(q))[0] for q in share[i]], range(c)))
            wall = time.perf_counter() - t0
            row["http_closed_loop"].append({"concurrency": c, **summary([ms for p in parts for ms in p], wall)})
        server.should_exit = True
        return row, [picks for _, picks in lib]

    layouts = [None if h == "per-shard" else int(h) for h in args.holders.split(",") if h.strip()]
    batches = [int(b) for b in args.state_batch.split(",") if b.strip()]
    rows, picks = zip(*(measure(h, b) for h in layouts for b in batches))
    result = {
        "bench": "serve_http",
        "machine": machine_info(),
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "device": str(dev),
        "corpus": {
            "storage": args.storage,
            "name": args.corpus,
            "shards": args.shards,
            "chunks": int(store.read(args.corpus).chunks),
        },
        "steps": args.steps,
        "positions": args.positions,
        "method": "one process, no Ray: the service's FastAPI app on uvicorn (127.0.0.1, HTTP/1.1 keep-alive) against "
        "the same RetrievalService awaited directly on the same event loop; same questions; per holder layout "
        "and state_batch_size",
        "modes": list(rows),
        "same_chunks_across_modes": round(
            sum(len({tuple(p[i]) for p in picks}) == 1 for i in range(len(timed))) / len(timed), 4
        ),
    }
    print(json.dumps(result))
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
