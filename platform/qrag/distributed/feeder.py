"""EpisodeFeeder: the CPU side of training, one shard of the training split per feeder.

A feeder takes the prepared training split (chunked and tokenised once, then read from the
Arrow cache: ``qrag.data.prepared``), keeps its ``.shard()``: every ``count``-th sample starting
at ``index``, decodes only those, and then answers ``episodes_for(k)``: its k-th batch of
ready-to-step episodes, packed for the object store. It steps no environment: the learner does.
(Older code and docs called it EnvRunner; the config keys still count "runners": one runner is
one feeder.)

Batch k is a pure function of (seed, index, k): the feeder walks shuffled epochs of its shard,
each epoch's order drawn from ``seed``, ``index`` and the epoch number. So a request lost with a
dead feeder can be re-issued to its restarted copy and returns the same episodes, and a learner
resumed at update u asks for exactly the episodes an uninterrupted run would have seen.

Stepping the MDP stays in the learner (``qrag.rl.env.RetrievalEnv``): it is index bookkeeping over
these arrays between two GPU encoder calls, and a round trip per step would only add latency.

The class is plain Python (tests build it directly); ``qrag.distributed.source`` runs it as a
Ray actor, named EpisodeFeeder in Ray's dashboard and state API.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from qrag.config import TrainConfig
from qrag.data import DataError
from qrag.data.answer_support import training_part
from qrag.data.prepared import prepare_split
from qrag.model.encoder import load_tokenizer
from qrag.data.tokens import TokenLayout
from qrag.distributed.episodes import EpisodeBatch
from qrag.distributed.faults import claim_once, hard_exit


class ShardStream:
    """Positions 0, 1, 2, ... of an endless walk over shuffled epochs of ``size`` items."""

    def __init__(self, size: int, seed: int, index: int):
        if size <= 0:
            raise ValueError("an empty shard")
        self.size, self.seed, self.index = size, seed, index
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:  # requests arrive in order: keep only recent epochs
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, self.index, epoch]).permutation(self.size)
        return self._perms[epoch]

    def take(self, start: int, count: int) -> list[int]:
        return [int(self._perm(p // self.size)[p % self.size]) for p in range(start, start + count)]


class EpisodeFeeder:
    """One shard of the training split, served as batches of ready-to-step episodes."""

    def __init__(
        self,
        cfg: TrainConfig,
        index: int,
        count: int,
        tokenizer_path: str,
        layout: TokenLayout,
        episodes_per_request: int,
        crash_at: int | None = None,
        crash_marker: str | None = None,
    ):
        t0 = time.perf_counter()
        self.index, self.count, self.per_request = index, count, episodes_per_request
        self.crash_at, self.crash_marker = crash_at, crash_marker  # fault injection (tests)
        tokenizer = load_tokenizer(tokenizer_path)
        mine = TokenLayout.from_tokenizer(tokenizer, cfg.model.max_state_tokens)
        if mine != layout:
            raise ValueError(
                f"episode feeder {index}: tokenizer {tokenizer_path} gives {mine}, the learner's model uses {layout}"
            )
        # The train split minus its validation part, as ``TrainingRun.load_data`` splits it.
        train = prepare_split(cfg.data, "train", tokenizer, layout).split_validation(cfg.data.val_fraction)[0]
        if len(train) < count:
            raise DataError(
                f"episode feeder {index}: the training split has {len(train)} samples, too few for {count} feeders "
                f"(distributed.runners)"
            )
        mine = train.shard(count, index)
        _, self.episodes, _ = training_part(cfg.data.supervision, mine.samples(), mine.tokenized())
        self.stream = ShardStream(len(self.episodes), cfg.seed, index)
        self.served = 0
        self.startup_s = time.perf_counter() - t0

    def info(self) -> dict[str, Any]:
        return {"index": self.index, "samples": len(self.episodes), "pid": os.getpid(), "startup_s": self.startup_s}

    def episodes_for(self, k: int) -> EpisodeBatch:
        """The feeder's k-th batch (k counts this feeder's requests from the start of training)."""
        if k == self.crash_at and claim_once(self.crash_marker):
            hard_exit(f"EpisodeFeeder {self.index} dies while serving its request {k}")
        picks = self.stream.take(k * self.per_request, self.per_request)
        self.served += len(picks)
        return EpisodeBatch.pack([self.episodes[i] for i in picks])

    def episodes_for_pid(self, k: int) -> tuple[int, EpisodeBatch]:
        """:meth:`episodes_for` with the pid of the process that packed it: the pool counts
        restarts, and the requests a restarted feeder had to re-run, by it."""
        return os.getpid(), self.episodes_for(k)
