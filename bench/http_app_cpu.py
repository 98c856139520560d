"""CPU time of the HTTP app per retrieval request, the service itself taken away.

Question: how much of one interpreter's time does the app (guards, FastAPI routing, body
validation, the answer's serialisation) spend on a `POST /v1/retrieve`, apart from the search?
In a Serve replica that time shares one GIL with the retrieval rounds, so it bounds a replica's
throughput. The app (`qrag.serving.http_api.build_api`, with API keys, as served) is called
directly as an ASGI app, in a loop, around a stub service that answers a realistic 4-step answer
at once; no network, no Ray.

    python bench/http_app_cpu.py --requests 3000 --out bench/results/http_app_cpu.json
    python bench/http_app_cpu.py --profile 20     # the 20 costliest functions (cProfile)
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "bench"))

from qrag.serving.auth import digest  # noqa: E402
from qrag.serving.http_api import build_api  # noqa: E402
from qrag.serving.service_config import ServeConfig  # noqa: E402

KEY = "bench-read-key-" + "r" * 16
TEXT = (
    "It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his chin nuzzled into "
    "his breast in an effort to escape the vile wind, slipped quickly through the glass doors of Victory Mansions. "
) * 2


def answer(question: str, steps: int = 4, alternatives: int = 3) -> dict:
    """The shape of a real answer: each step its chunk, Q, position and runner-ups."""

    def chunk(i: int) -> dict:
        return {"chunk_id": 1000 + i, "doc_id": f"book-{i % 7}", "text": TEXT}

    return {
        "corpus": "books",
        "question": question,
        "n_chunks": 156_000,
        "stopped_early": False,
        "steps": [
            {
                "step": s + 1,
                **chunk(s),
                "q": 0.5 - 0.01 * s,
                "position": 10.0 * s,
                "alternatives": [{**chunk(10 * s + a), "q": 0.4 - 0.01 * a} for a in range(alternatives)],
            }
            for s in range(steps)
        ],
        "timings": {"tokenize_ms": 0.4, "encode_ms": 3.5, "score_ms": 5.9, "merge_ms": 0.5, "total_ms": 10.9},
        "search": {"max_steps": steps, "beam_width": 1, "stop_threshold": None, "alternatives": alternatives},
        "model": {"fingerprint": "0123456789abcdef", "trained": True},
    }


class StubService:
    """What the routes need of a RetrievalService for a retrieval: its config and retrieve()."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg

    async def retrieve(self, p) -> dict:
        return answer(p.question, p.max_steps, p.alternatives)


async def call(app, body: bytes) -> int:
    status = 0
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/retrieve",
        "raw_path": b"/v1/retrieve",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"authorization", f"Bearer {KEY}".encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


async def run(n: int) -> dict:
    cfg = ServeConfig(storage="unused")
    app = build_api(StubService(cfg), {}, None, {digest(KEY): "read"})
    body = json.dumps(
        {"corpus": "books", "question": "what happened when the clocks were striking thirteen", "max_steps": 4}
    ).encode()
    for _ in range(200):  # warm-up
        assert await call(app, body) == 200
    cpu0, t0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        await call(app, body)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    return {
        "requests": n,
        "cpu_us_per_request": round(cpu / n * 1e6, 1),
        "wall_us_per_request": round(wall / n * 1e6, 1),
        "answer_bytes": len(json.dumps(answer("q"))),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--profile", type=int, default=0, help="print the N costliest functions instead")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        asyncio.run(run(args.requests))
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
        return
    from bench_common import machine_info, write_result

    result = {"bench": "http_app_cpu", **machine_info(), **asyncio.run(run(args.requests))}
    print(json.dumps(result))
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
