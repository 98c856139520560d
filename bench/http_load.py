"""Closed-loop HTTP load for the serving benchmarks: C clients, each on its own kept-alive
connection, each sending its next request when the last answer is in.

The clients live in several processes (threads of one Python process share a GIL, and at a few
hundred requests a second one process would time itself rather than the server). Each answer's
own ``timings`` (the service's stages) are collected beside the latency the client saw.
"""

from __future__ import annotations

import http.client
import json
import math
import multiprocessing as mp
import random
import re
import statistics
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

CLIENTS_PER_PROCESS = 8
_SERVER_TIMING = re.compile(r"\bapp;dur=([0-9.]+)")


@dataclass
class Outcome:
    latencies_ms: list[float] = field(default_factory=list)
    service_ms: dict[str, list[float]] = field(default_factory=dict)  # the answers' timings, by stage
    statuses: dict[int, int] = field(default_factory=dict)
    errors: int = 0
    seconds: float = 0.0

    def merge(self, other: Outcome) -> None:
        self.latencies_ms += other.latencies_ms
        for k, v in other.service_ms.items():
            self.service_ms.setdefault(k, []).extend(v)
        for k, v in other.statuses.items():
            self.statuses[k] = self.statuses.get(k, 0) + v
        self.errors += other.errors
        self.seconds = max(self.seconds, other.seconds)


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


def summary(out: Outcome, clients: int) -> dict:
    lat = out.latencies_ms
    return {
        "clients": clients,
        "requests": len(lat),
        "seconds": round(out.seconds, 2),
        "queries_per_s": round(len(lat) / out.seconds, 1) if out.seconds else None,
        "p50_ms": _r(percentile(lat, 50)),
        "p90_ms": _r(percentile(lat, 90)),
        "p99_ms": _r(percentile(lat, 99)),
        "mean_ms": _r(statistics.fmean(lat)) if lat else None,
        "service_mean_ms": {k: _r(statistics.fmean(v)) for k, v in sorted(out.service_ms.items()) if v},
        "statuses": {str(k): v for k, v in sorted(out.statuses.items())},
        "errors": out.errors,
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


class _Client(threading.Thread):
    def __init__(
        self, url: str, bodies: list[dict], seed: int, stop: threading.Event, limit: int | None, headers: dict
    ):
        super().__init__(daemon=True)
        parts = urlsplit(url)
        self.host, self.port, self.path = parts.hostname, parts.port or 80, parts.path or "/"
        self.bodies, self.rng, self.stop, self.limit, self.headers = bodies, random.Random(seed), stop, limit, headers
        self.out = Outcome()

    def _connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=120)

    def run(self) -> None:
        conn, sent = self._connect(), 0
        headers = {"content-type": "application/json", **self.headers}
        while not self.stop.is_set() and (self.limit is None or sent < self.limit):
            body = json.dumps(self.rng.choice(self.bodies)).encode()
            t0 = time.perf_counter()
            try:
                conn.request("POST", self.path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
            except (OSError, http.client.HTTPException):
                self.out.errors += 1
                conn.close()
                conn = self._connect()
                continue
            ms = (time.perf_counter() - t0) * 1000.0
            sent += 1
            self.out.statuses[response.status] = self.out.statuses.get(response.status, 0) + 1
            if response.status != 200:
                continue
            self.out.latencies_ms.append(ms)
            for k, v in (json.loads(data).get("timings") or {}).items():
                self.out.service_ms.setdefault(k, []).append(v)
            app = _SERVER_TIMING.search(response.getheader("server-timing") or "")
            if app:  # the server's own time, request received to answer started
                self.out.service_ms.setdefault("app_ms", []).append(float(app.group(1)))
        conn.close()


def _process(
    url: str,
    bodies: list[dict],
    clients: int,
    seed: int,
    seconds: float | None,
    limit: int | None,
    headers: dict,
    start_at: float,
    queue,
) -> None:
    stop = threading.Event()
    threads = [_Client(url, bodies, seed * 1000 + i, stop, limit, headers) for i in range(clients)]
    while time.time() < start_at:  # every process starts together
        time.sleep(0.001)
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    if seconds is not None:
        time.sleep(seconds)
        stop.set()
    for t in threads:
        t.join()
    out = Outcome(seconds=time.perf_counter() - t0)
    for t in threads:
        out.merge(t.out)
    queue.put(out)


def closed_loop(
    url: str,
    bodies: list[dict],
    clients: int,
    seconds: float | None = None,
    requests_per_client: int | None = None,
    headers: dict | None = None,
) -> dict:
    """``clients`` clients posting ``bodies`` (chosen at random) to ``url`` for ``seconds`` (or
    ``requests_per_client`` each); the summary of what they saw."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    n_proc = max(1, math.ceil(clients / CLIENTS_PER_PROCESS))
    start_at = time.time() + 0.5
    procs = []
    for p in range(n_proc):
        share = clients // n_proc + (1 if p < clients % n_proc else 0)
        procs.append(
            ctx.Process(
                target=_process,
                args=(url, bodies, share, p, seconds, requests_per_client, headers or {}, start_at, queue),
            )
        )
    for proc in procs:
        proc.start()
    total = Outcome()
    for _ in procs:
        total.merge(queue.get())
    for proc in procs:
        proc.join()
    return summary(total, clients)
