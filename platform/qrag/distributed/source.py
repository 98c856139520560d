"""FeederPool: the learner's episode source over EpisodeFeeder actors (``distributed.runners`` of them).

Requests are numbered 0, 1, 2, ...; request j goes to feeder j mod n as that feeder's
(j div n)-th batch, and the learner consumes them in order. ``prefetch`` requests per feeder are
always in flight, so while the learner trains on one batch the next ones are being packed.

A feeder that dies is restarted by Ray (``max_restarts``) and Ray re-runs the requests it held
on the restarted copy (``max_task_retries`` = ``distributed.request_retries``): a batch is a
function of the feeder's shard and its number, so the re-run returns the same episodes and the
replay stays deterministic. Only a feeder that hangs is the pool's business: one that does not
answer within the timeout is killed (Ray restarts it) and its requests are issued again.
Every answer carries the pid of the feeder process that computed it, so restarts are counted
(``perf/runner_restarts``) and so are the requests a restarted feeder had to re-run
(``perf/runner_requests_lost``; the metrics keep the config's word, runner).
"""

from __future__ import annotations

import logging
import time

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from qrag.config import TrainConfig
from qrag.data.tokens import TokenizedSample, TokenLayout
from qrag.distributed.faults import FaultPlan
from qrag.distributed.placement import runner_resources
from qrag.distributed.feeder import EpisodeFeeder

log = logging.getLogger(__name__)


def episodes_per_request(cfg: TrainConfig) -> int:
    d = cfg.distributed
    return d.envs_per_runner or -(-cfg.learner.episodes_per_update // max(1, d.runners))


class FeederPool:
    def __init__(self, cfg: TrainConfig, tokenizer_path: str, layout: TokenLayout, faults: FaultPlan):
        """Start the feeders (they load their shards while the learner loads its model)."""
        d = cfg.distributed
        self.cfg, self.n = cfg, d.runners
        self.batch_size = cfg.learner.episodes_per_update
        self.per_request = episodes_per_request(cfg)
        self.depth = self.n * max(1, d.prefetch)
        actor = ray.remote(EpisodeFeeder).options(  # the dashboard shows the class name: EpisodeFeeder
            num_cpus=d.runner_cpus,
            num_gpus=0,
            max_restarts=d.runner_max_restarts,
            max_task_retries=d.request_retries,
            resources=runner_resources(cfg),  # e.g. pinned to the CPU worker group (qrag.distributed.placement)
        )
        crash = faults.runner_crash(self.n, self.per_request)
        self.feeders = [
            actor.remote(cfg, i, self.n, tokenizer_path, layout, self.per_request, *(crash if i == 0 else (None, None)))
            for i in range(self.n)
        ]
        self.in_flight: dict[int, tuple[ray.ObjectRef, int]] = {}  # request -> (answer, feeder pid when issued)
        self.pids: list[int] = []
        self.buffer: list[TokenizedSample] = []
        self.next_request = 0
        self.lost = 0  # requests re-run because their feeder died or hung
        self.restarts = 0  # feeder processes replaced
        self.infos: list[dict] = []

    def start(self, update: int) -> None:
        """Wait until every feeder holds its shard, then fill the pipeline from ``update`` on."""
        self.infos = ray.get([f.info.remote() for f in self.feeders])
        self.pids = [info["pid"] for info in self.infos]
        first, skip = divmod(update * self.batch_size, self.per_request)
        self.next_request = first
        for j in range(first, first + self.depth):
            self._issue(j)
        if skip:
            self.buffer = self._receive(first)[skip:]
            self.next_request = first + 1
            self._issue(first + self.depth)

    def _issue(self, j: int) -> None:
        feeder = j % self.n
        self.in_flight[j] = (self.feeders[feeder].episodes_for_pid.remote(j // self.n), self.pids[feeder])

    def _receive(self, j: int) -> list[TokenizedSample]:
        d = self.cfg.distributed
        feeder, hangs = j % self.n, 0
        deadline = time.monotonic() + d.request_timeout_s
        while True:
            ref, issued_to = self.in_flight[j]
            try:
                pid, batch = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except ActorUnavailableError as exc:  # being restarted: ask again shortly, while the timeout allows
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"EpisodeFeeder {feeder} stayed unavailable for {d.request_timeout_s:g} s"
                    ) from exc
                time.sleep(0.5)
                self._issue(j)
                continue
            except GetTimeoutError as exc:
                hangs += 1
                if hangs > d.request_retries:
                    raise RuntimeError(
                        f"EpisodeFeeder {feeder} did not answer request {j} within {d.request_timeout_s:g} s, "
                        f"{hangs} times; giving up"
                    ) from exc
                log.warning(
                    "EpisodeFeeder %d did not answer request %d in %g s; restarting it", feeder, j, d.request_timeout_s
                )
                ray.kill(self.feeders[feeder], no_restart=False)  # stuck: make Ray restart it
                deadline = time.monotonic() + d.request_timeout_s
                for k in [k for k in self.in_flight if k % self.n == feeder]:  # what it held, to its restarted copy
                    self._issue(k)
                continue
            except RayActorError as exc:  # out of restarts or retries
                raise RuntimeError(
                    f"EpisodeFeeder {feeder} is gone (request {j}; distributed.runner_max_restarts / "
                    f"request_retries exhausted): {exc}"
                ) from exc
            del self.in_flight[j]
            if pid != self.pids[feeder]:
                self.restarts += 1
                self.pids[feeder] = pid
                log.warning("EpisodeFeeder %d was restarted (pid %d); Ray re-ran the requests it held", feeder, pid)
            if pid != issued_to:
                self.lost += 1
            return batch.unpack()

    def next_batch(self) -> list[TokenizedSample]:
        while len(self.buffer) < self.batch_size:
            self.buffer.extend(self._receive(self.next_request))
            self._issue(self.next_request + self.depth)
            self.next_request += 1
        batch, self.buffer = self.buffer[: self.batch_size], self.buffer[self.batch_size :]
        return batch

    def shutdown(self) -> None:
        for f in self.feeders:
            ray.kill(f, no_restart=True)
        self.feeders, self.in_flight = [], {}
