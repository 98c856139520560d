"""Multi-step RAG w. SFT (paper Table 3's supervised baseline): the same two encoders and the same
Q(s, a) = <E_s(s), R(pos) E_a(a)>, trained by teacher forcing on the support facts instead of RL.

Per episode the support facts are taken in a random order; at step t the state holds the
question and the facts taken so far (document order, as in the MDP), and the loss is the
cross-entropy of a softmax over every available chunk (temperature ``learner.sft_temperature``)
that puts its mass on the facts still missing. Search, checkpoints and evaluation are the
Q-RAG ones, so the two rows of the table differ only in how the encoders were trained.

:class:`TrajectorySupervisedLearner` (``learner.objective=sft_trajectory``) is the paper's own
description of that baseline: Beam Retriever's trajectory supervision, adapted to these encoders.
The facts are taken in their given (document) order, and at step t only the t-th fact is a
positive: every other available chunk, the facts still to come included, is a negative of an
independent binary cross-entropy (a sigmoid per chunk, not a softmax over them). Ours asks for any
missing fact, in a random order each episode, so it never teaches Q to rank one support fact
below another.

:class:`WarmStartedPQNLearner` chains the two (``learner.sft_warmup_updates``): supervised updates
first, then soft PQN from the encoders they left, its target encoders reset to them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from qrag.model.encoder import pad_rows
from qrag.rl.env import RetrievalEnv
from qrag.rl.learner import SoftPQNLearner
from qrag.model.qnet import QNetwork
from qrag.data.tokens import TokenizedSample


class SupervisedLearner(SoftPQNLearner):
    """Drop-in for :class:`SoftPQNLearner` (same schedule, optimiser, checkpoints)."""

    def _rollout_and_backward(self, episodes: Sequence[TokenizedSample], alpha: float) -> dict:
        qnet, dev, layout = self.qnet, self.device, self.layout
        env = RetrievalEnv(episodes, self.env_cfg, layout)  # fact classes and valid chunks under the credit rule
        flat = [c for s in episodes for c in s.chunks]
        chunk_vecs = pad_rows(self._embed(qnet.action_encoder, flat, grad=True, kind="chunks"), env.n_chunks)
        n_chunks = torch.from_numpy(env.n_chunks).to(dev)
        orders = [self.fact_order(np.asarray(sorted({int(i) for i in s.support}), dtype=np.int64)) for s in episodes]
        selected = np.zeros_like(env.selected)
        losses, q_pos = [], []
        for t in range(max(len(o) for o in orders)):
            rows = np.array([i for i, o in enumerate(orders) if len(o) > t], dtype=np.int64)
            rows_t = torch.from_numpy(rows).to(dev)
            seqs = [
                layout.state(episodes[i].question, [episodes[i].chunks[j] for j in np.flatnonzero(selected[i])])
                for i in rows
            ]
            states = self._embed(qnet.state_encoder, seqs, grad=True, kind="states")
            sel = torch.from_numpy(selected[rows]).to(dev)
            q = QNetwork.twin_scores(
                states, qnet.place(chunk_vecs[rows_t], qnet.positions(sel, n_chunks[rows_t]))
            ).mean(-1)
            available = torch.from_numpy(env.valid[rows] & ~selected[rows]).to(dev)
            missing = torch.from_numpy(env.gold[rows] & ~selected[rows]).to(dev) & available
            following = torch.zeros_like(available)
            following[
                torch.arange(len(rows), device=dev), torch.as_tensor([orders[i][t] for i in rows], device=dev)
            ] = True
            positive = self.positives(missing, following & available)
            losses.append(self.step_loss(q.float() / self.cfg.sft_temperature, available, positive))
            q_pos.append(q.detach()[positive])
            for i in rows:
                selected[i, orders[i][t]] = True
        per_step = torch.cat(losses)
        loss_sum = per_step.sum()  # train_update divides by the update's count of steps
        self._backward(loss_sum)
        return {
            "loss_sum": float(loss_sum.detach()),
            "q_taken": float(torch.cat(q_pos).float().mean()),
            "target": 1.0,
            "episode_return": 0.0,
            "success": 0.0,
            "episode_length": float(np.mean([len(o) for o in orders])),
            "transitions": int(len(per_step)),
            "counts": {"transitions": float(len(per_step))},
        }

    def fact_order(self, facts: np.ndarray) -> np.ndarray:
        """The order the support facts are taken in: a new random one each episode."""
        return facts[torch.randperm(len(facts), generator=self.generator).numpy()]

    @staticmethod
    def positives(missing: torch.Tensor, following: torch.Tensor) -> torch.Tensor:
        """Which chunks are right at this step (rows x chunks): every fact still missing."""
        return missing

    @staticmethod
    def step_loss(logits: torch.Tensor, available: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
        """Per row: cross-entropy of a softmax over the available chunks, its mass on the positives."""
        logits = logits.masked_fill(~available, float("-inf"))
        return torch.logsumexp(logits, 1) - torch.logsumexp(logits.masked_fill(~positive, float("-inf")), 1)


class TrajectorySupervisedLearner(SupervisedLearner):
    """The paper's "Multi-step RAG w. SFT": Beam Retriever's trajectory supervision (see the module
    docstring for how it differs from :class:`SupervisedLearner`)."""

    def fact_order(self, facts: np.ndarray) -> np.ndarray:
        """The given order: support facts as they lie in the context (bAbI's time order)."""
        return facts

    @staticmethod
    def positives(missing: torch.Tensor, following: torch.Tensor) -> torch.Tensor:
        """Only the next fact of the gold trajectory."""
        return following

    @staticmethod
    def step_loss(logits: torch.Tensor, available: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
        """Per row: the mean binary cross-entropy of every available chunk (1 for the positive)."""
        bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, positive.float(), reduction="none")
        return (bce * available).sum(1) / available.sum(1).clamp(min=1)


class WarmStartedPQNLearner(SupervisedLearner):
    """The first ``learner.sft_warmup_updates`` updates supervised, soft PQN after them; one
    optimiser, schedule and checkpoint format throughout (a run resumes in either phase)."""

    def _rollout_and_backward(self, episodes: Sequence[TokenizedSample], alpha: float) -> dict:
        if self.update < self.cfg.sft_warmup_updates:
            return super()._rollout_and_backward(episodes, alpha)
        return SoftPQNLearner._rollout_and_backward(self, episodes, alpha)

    def train_update(self, episodes: Sequence[TokenizedSample]):
        if self.update == self.cfg.sft_warmup_updates:
            # The EMA targets still lag behind the supervised encoders: bootstrap PQN from the
            # encoders it starts with, not from a blend with the untrained ones.
            self.qnet.update_targets(1.0)
        return super().train_update(episodes)
