"""The retrieval MDP, batched over many episodes (paper §3.1).

s_0 = [q]; an action selects one not-yet-selected chunk; s_{t+1} = ord([q, a_0..a_t]) in document
order. The reward is 0 until the step at which every support fact has been found (under the
credit rule ``env.credit``: its own chunk, or any chunk with its text; see :mod:`qrag.data.credit`),
where it is 1 (or ``0.5 + 0.5·|gold|/|selected|`` with ``penalize_extra_steps``). With
``env.reward=per_fact`` each step that finds a new support fact earns 1/|F| instead (partial
progress, not the paper's rule). The episode ends there, or
at T steps; with ``never_terminate`` it goes on to T with reward 0 after the success, so that the
learned Q of "extra" steps falls and a Q threshold can stop retrieval.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from qrag.config import EnvConfig
from qrag.data.credit import support_classes
from qrag.data.tokens import TokenizedSample, TokenLayout


REWARDS = ("terminal", "per_fact")


class RetrievalEnv:
    def __init__(self, samples: Sequence[TokenizedSample], cfg: EnvConfig, layout: TokenLayout):
        if cfg.max_steps < 1:
            raise ValueError("env.max_steps must be at least 1")
        if cfg.reward not in REWARDS:
            raise ValueError(f"env.reward: expected one of {', '.join(REWARDS)}, got {cfg.reward!r}")
        if cfg.reward == "per_fact" and cfg.penalize_extra_steps:
            raise ValueError("env.penalize_extra_steps scales the terminal reward: it needs env.reward=terminal")
        self.samples = list(samples)
        self.cfg = cfg
        self.layout = layout
        n = len(self.samples)
        self.n_chunks = np.array([s.n_chunks for s in self.samples], dtype=np.int64)
        width = int(self.n_chunks.max()) if n else 0
        self.valid = np.arange(width)[None, :] < self.n_chunks[:, None]
        # fact[i, j]: the support fact chunk j counts as (-1: none), under the credit rule.
        self.fact = np.full((n, width), -1, dtype=np.int64)
        self.n_gold = np.zeros(n, dtype=np.int64)
        for i, s in enumerate(self.samples):
            classes, self.n_gold[i] = support_classes(s.chunks, s.support, cfg.credit)
            self.fact[i, : len(classes)] = classes
        self.gold = self.fact >= 0
        self.found = np.zeros((n, max(1, int(self.n_gold.max()) if n else 1)), dtype=bool)
        self.selected = np.zeros((n, width), dtype=bool)
        self.order: list[list[int]] = [[] for _ in range(n)]  # actions in the order taken
        self.t = np.zeros(n, dtype=np.int64)
        self.done = np.zeros(n, dtype=bool)
        self.succeeded = np.zeros(n, dtype=bool)
        self.episode_return = np.zeros(n, dtype=np.float64)
        # An episode with fewer chunks than T ends when none are left.
        self.horizon = np.minimum(cfg.max_steps, self.n_chunks)

    @property
    def active(self) -> np.ndarray:
        return np.flatnonzero(~self.done)

    def available(self, rows: np.ndarray | None = None) -> np.ndarray:
        rows = np.arange(len(self.samples)) if rows is None else rows
        return self.valid[rows] & ~self.selected[rows]

    def states(self, rows: np.ndarray) -> list[np.ndarray]:
        """Token ids of the current state of each episode in ``rows``."""
        out = []
        for r in rows:
            chosen = np.flatnonzero(self.selected[r])  # document order
            sample = self.samples[r]
            out.append(self.layout.state(sample.question, [sample.chunks[i] for i in chosen]))
        return out

    def step(self, rows: np.ndarray, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Apply one action per episode in ``rows``; returns (rewards, dones) for those rows."""
        rows = np.asarray(rows, dtype=np.int64)
        actions = np.asarray(actions, dtype=np.int64)
        if self.done[rows].any():
            raise ValueError("step() on a finished episode")
        if not self.available(rows)[np.arange(len(rows)), actions].all():
            raise ValueError("an action selects an unavailable chunk")
        was_success = self.succeeded[rows].copy()
        self.selected[rows, actions] = True
        for r, a in zip(rows, actions):
            self.order[r].append(int(a))
        self.t[rows] += 1
        facts = self.fact[rows, actions]
        hit = facts >= 0
        new_fact = np.zeros(len(rows), dtype=bool)
        new_fact[hit] = ~self.found[rows[hit], facts[hit]]
        self.found[rows[hit], facts[hit]] = True
        covered = self.found[rows].sum(1) >= self.n_gold[rows]
        newly = covered & ~was_success
        self.succeeded[rows] |= covered
        rewards = np.zeros(len(rows), dtype=np.float64)
        if self.cfg.reward == "per_fact":
            rewards[new_fact] = 1.0 / self.n_gold[rows][new_fact]
        elif self.cfg.penalize_extra_steps:
            rewards[newly] = 0.5 + 0.5 * self.n_gold[rows][newly] / self.t[rows][newly]
        else:
            rewards[newly] = 1.0
        self.episode_return[rows] += rewards
        out_of_steps = self.t[rows] >= self.horizon[rows]
        dones = out_of_steps | (newly & (not self.cfg.never_terminate))
        self.done[rows] |= dones
        return rewards, dones
