"""RunnerPool: the learner's episode source over EnvRunner actors.

Requests are numbered 0, 1, 2, ...; request j goes to runner j mod n as that runner's
(j div n)-th batch, and the learner consumes them in order. ``prefetch`` requests per runner are
always in flight, so while the learner trains on one batch the next ones are being packed.

A runner that dies is restarted by Ray (``max_restarts``); the requests it held are lost, and
the pool issues them again to the restarted runner, which returns the same episodes (a batch is
a function of the runner's shard and its number). A runner that does not answer within the
timeout is killed so that Ray restarts it.
"""

from __future__ import annotations

import logging
import time

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from ..config import TrainConfig
from ..tokens import TokenizedSample, TokenLayout
from .faults import FaultPlan
from .placement import runner_resources
from .runner import EnvRunner

log = logging.getLogger(__name__)


def episodes_per_request(cfg: TrainConfig) -> int:
    d = cfg.distributed
    return d.envs_per_runner or -(-cfg.learner.episodes_per_update // max(1, d.runners))


class RunnerPool:
    def __init__(self, cfg: TrainConfig, tokenizer_path: str, layout: TokenLayout, faults: FaultPlan):
        """Start the runners (they load their shards while the learner loads its model)."""
        d = cfg.distributed
        self.cfg, self.n = cfg, d.runners
        self.batch_size = cfg.learner.episodes_per_update
        self.per_request = episodes_per_request(cfg)
        self.depth = self.n * max(1, d.prefetch)
        actor = ray.remote(EnvRunner).options(
            num_cpus=d.runner_cpus, num_gpus=0, max_restarts=d.runner_max_restarts, max_task_retries=0,
            resources=runner_resources(cfg),  # e.g. pinned to the CPU worker group (qrag.distributed.placement)
        )
        crash = faults.runner_crash(self.n, self.per_request)
        self.runners = [
            actor.remote(cfg, i, self.n, tokenizer_path, layout, self.per_request, *(crash if i == 0 else (None, None)))
            for i in range(self.n)
        ]
        self.in_flight: dict[int, ray.ObjectRef] = {}
        self.buffer: list[TokenizedSample] = []
        self.next_request = 0
        self.lost = 0  # requests lost to dead or stuck runners and issued again
        self.infos: list[dict] = []

    def start(self, update: int) -> None:
        """Wait until every runner holds its shard, then fill the pipeline from ``update`` on."""
        self.infos = ray.get([r.info.remote() for r in self.runners])
        first, skip = divmod(update * self.batch_size, self.per_request)
        self.next_request = first
        for j in range(first, first + self.depth):
            self._issue(j)
        if skip:
            self.buffer = self._receive(first)[skip:]
            self.next_request = first + 1
            self._issue(first + self.depth)

    def _issue(self, j: int) -> None:
        self.in_flight[j] = self.runners[j % self.n].episodes_for.remote(j // self.n)

    def _receive(self, j: int) -> list[TokenizedSample]:
        d = self.cfg.distributed
        runner, deaths, lost = j % self.n, 0, False
        deadline = time.monotonic() + d.request_timeout_s
        while True:
            try:
                batch = ray.get(self.in_flight[j], timeout=max(0.1, deadline - time.monotonic()))
                del self.in_flight[j]
                return batch.unpack()
            except (RayActorError, GetTimeoutError) as exc:
                if not lost:
                    lost = True
                    self.lost += 1
                    log.warning("EnvRunner %d lost request %d (%s); issuing it again", runner, j, type(exc).__name__)
                if isinstance(exc, ActorUnavailableError):
                    # Being restarted: ask again shortly, for as long as the timeout allows.
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"EnvRunner {runner} stayed unavailable for {d.request_timeout_s:g} s") from exc
                    time.sleep(0.5)
                    self._issue(j)
                    continue
                deaths += 1
                if deaths > d.request_retries:
                    raise RuntimeError(f"EnvRunner {runner} lost request {j} {deaths} times; giving up: {exc}") from exc
                if isinstance(exc, GetTimeoutError):
                    ray.kill(self.runners[runner], no_restart=False)  # stuck: make Ray restart it
                deadline = time.monotonic() + d.request_timeout_s
                # Everything the dead runner held is lost too: ask its restarted copy again.
                for k in [k for k in self.in_flight if k % self.n == runner]:
                    self._issue(k)

    def next_batch(self) -> list[TokenizedSample]:
        while len(self.buffer) < self.batch_size:
            self.buffer.extend(self._receive(self.next_request))
            self._issue(self.next_request + self.depth)
            self.next_request += 1
        batch, self.buffer = self.buffer[: self.batch_size], self.buffer[self.batch_size :]
        return batch

    def shutdown(self) -> None:
        for r in self.runners:
            ray.kill(r, no_restart=True)
        self.runners, self.in_flight = [], {}

