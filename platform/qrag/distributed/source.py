"""RunnerPool: the learner's episode source over EnvRunner actors.

Requests are numbered 0, 1, 2, ...; request j goes to runner j mod n as that runner's
(j div n)-th batch, and the learner consumes them in order. ``prefetch`` requests per runner are
always in flight, so while the learner trains on one batch the next ones are being packed.

A runner that dies is restarted by Ray (``max_restarts``) and Ray re-runs the requests it held
on the restarted copy (``max_task_retries`` = ``distributed.request_retries``): a batch is a
function of the runner's shard and its number, so the re-run returns the same episodes and the
replay stays deterministic. Only a runner that hangs is the pool's business: one that does not
answer within the timeout is killed (Ray restarts it) and its requests are issued again.
Every answer carries the pid of the runner process that computed it, so restarts are counted
(``perf/runner_restarts``) and so are the requests a restarted runner had to re-run
(``perf/runner_requests_lost``).
"""

from __future__ import annotations

import logging
import os
import time

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from qrag.config import TrainConfig
from qrag.data.tokens import TokenizedSample, TokenLayout
from qrag.distributed.faults import FaultPlan
from qrag.distributed.placement import runner_resources
from qrag.distributed.episodes import EpisodeBatch
from qrag.distributed import runner as runner_impl

log = logging.getLogger(__name__)


def episodes_per_request(cfg: TrainConfig) -> int:
    d = cfg.distributed
    return d.envs_per_runner or -(-cfg.learner.episodes_per_update // max(1, d.runners))


class EnvRunner(runner_impl.EnvRunner):
    """The actor (named EnvRunner in Ray's dashboard and state API): a runner whose answers name
    the process that computed them."""

    def episodes_for_pid(self, k: int) -> tuple[int, EpisodeBatch]:
        return os.getpid(), self.episodes_for(k)


class RunnerPool:
    def __init__(self, cfg: TrainConfig, tokenizer_path: str, layout: TokenLayout, faults: FaultPlan):
        """Start the runners (they load their shards while the learner loads its model)."""
        d = cfg.distributed
        self.cfg, self.n = cfg, d.runners
        self.batch_size = cfg.learner.episodes_per_update
        self.per_request = episodes_per_request(cfg)
        self.depth = self.n * max(1, d.prefetch)
        actor = ray.remote(EnvRunner).options(
            num_cpus=d.runner_cpus, num_gpus=0, max_restarts=d.runner_max_restarts, max_task_retries=d.request_retries,
            resources=runner_resources(cfg),  # e.g. pinned to the CPU worker group (qrag.distributed.placement)
        )
        crash = faults.runner_crash(self.n, self.per_request)
        self.runners = [
            actor.remote(cfg, i, self.n, tokenizer_path, layout, self.per_request, *(crash if i == 0 else (None, None)))
            for i in range(self.n)
        ]
        self.in_flight: dict[int, tuple[ray.ObjectRef, int]] = {}  # request -> (answer, runner pid when issued)
        self.pids: list[int] = []
        self.buffer: list[TokenizedSample] = []
        self.next_request = 0
        self.lost = 0  # requests re-run because their runner died or hung
        self.restarts = 0  # runner processes replaced
        self.infos: list[dict] = []

    def start(self, update: int) -> None:
        """Wait until every runner holds its shard, then fill the pipeline from ``update`` on."""
        self.infos = ray.get([r.info.remote() for r in self.runners])
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
        runner = j % self.n
        self.in_flight[j] = (self.runners[runner].episodes_for_pid.remote(j // self.n), self.pids[runner])

    def _receive(self, j: int) -> list[TokenizedSample]:
        d = self.cfg.distributed
        runner, hangs = j % self.n, 0
        deadline = time.monotonic() + d.request_timeout_s
        while True:
            ref, issued_to = self.in_flight[j]
            try:
                pid, batch = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except ActorUnavailableError as exc:  # being restarted: ask again shortly, while the timeout allows
                if time.monotonic() > deadline:
                    raise RuntimeError(f"EnvRunner {runner} stayed unavailable for {d.request_timeout_s:g} s") from exc
                time.sleep(0.5)
                self._issue(j)
                continue
            except GetTimeoutError as exc:
                hangs += 1
                if hangs > d.request_retries:
                    raise RuntimeError(f"EnvRunner {runner} did not answer request {j} within {d.request_timeout_s:g} s, "
                                       f"{hangs} times; giving up") from exc
                log.warning("EnvRunner %d did not answer request %d in %g s; restarting it", runner, j, d.request_timeout_s)
                ray.kill(self.runners[runner], no_restart=False)  # stuck: make Ray restart it
                deadline = time.monotonic() + d.request_timeout_s
                for k in [k for k in self.in_flight if k % self.n == runner]:  # what it held, to its restarted copy
                    self._issue(k)
                continue
            except RayActorError as exc:  # out of restarts or retries
                raise RuntimeError(f"EnvRunner {runner} is gone (request {j}; distributed.runner_max_restarts / "
                                   f"request_retries exhausted): {exc}") from exc
            del self.in_flight[j]
            if pid != self.pids[runner]:
                self.restarts += 1
                self.pids[runner] = pid
                log.warning("EnvRunner %d was restarted (pid %d); Ray re-ran the requests it held", runner, pid)
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
        for r in self.runners:
            ray.kill(r, no_restart=True)
        self.runners, self.in_flight = [], {}

