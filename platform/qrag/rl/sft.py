"""Multi-step RAG w. SFT (paper Table 3's supervised baseline): the same two encoders and the same
Q(s, a) = <E_s(s), R(pos) E_a(a)>, trained by teacher forcing on the support facts instead of RL.
Search, checkpoints and evaluation are the Q-RAG ones, so the rows differ only in how the encoders
were trained.

At step t the state holds the question and the facts taken so far (document order, as in the MDP).
Three choices make the loss, each a ``learner.sft_*`` switch (null = the objective's own):

* ``sft_order``: the support facts taken in a new ``random`` order each episode, or the ``given``
  (document) order;
* ``sft_positives``: every fact still ``missing`` is right, or only the ``next`` fact of the order;
* ``sft_loss``: the cross-entropy of one ``softmax`` over the available chunks (its mass on the
  positives), or a ``bce`` per available chunk, averaged (the facts still to come are negatives too
  when only the next one is right). Logits are Q / ``learner.sft_temperature``.

``learner.objective=sft`` (ours, :class:`SupervisedLearner`) is random, missing, softmax: it never
teaches Q to rank one support fact below another. ``sft_trajectory``
(:class:`TrajectorySupervisedLearner`) is given, next, bce: the paper's description of the row,
Beam Retriever's trajectory supervision adapted to these encoders.

Neither teaches the state after the last fact, and a softmax leaves the level of Q free, so a threshold
on Q (the learned stop) has nothing to stand on; ``learner.sft_stop`` adds that state as one more step,
with a stop option of logit 0 that is right there and wrong everywhere else (under ``bce``: that state's
chunks all negatives); ``learner.sft_stop_weight`` weighs that state's loss against the others'.

:class:`WarmStartedPQNLearner` chains ours and PQN (``learner.sft_warmup_updates``): supervised updates
first, then soft PQN from the encoders they left, its target encoders reset to them.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar, Literal

import numpy as np
import torch

from qrag.config import ConfigError, LearnerConfig
from qrag.config import choices as literal_choices
from qrag.model.encoder import pad_rows, to_device
from qrag.rl.env import RetrievalEnv
from qrag.rl.learner import SoftPQNLearner
from qrag.model.qnet import QNetwork
from qrag.data.tokens import TokenizedSample


@dataclass(frozen=True)
class SftChoices:
    """The three choices that make a supervised loss (the module docstring says what each means)."""

    order: Literal["random", "given"]
    positives: Literal["missing", "next"]
    loss: Literal["softmax", "bce"]


OURS = SftChoices("random", "missing", "softmax")  # learner.objective=sft (and the PQN warm start)
PAPERS = SftChoices("given", "next", "bce")  # learner.objective=sft_trajectory
SWITCHES = {"order": "sft_order", "positives": "sft_positives", "loss": "sft_loss"}  # SftChoices -> LearnerConfig
# Every learner key that only a supervised update reads (null or false: not set).
SUPERVISED_ONLY = (*SWITCHES.values(), "sft_stop")


def sft_choices(cfg: LearnerConfig, own: SftChoices) -> SftChoices:
    """``own`` (the objective's choices) with every ``learner.sft_*`` switch that is set in its place."""
    hints = typing.get_type_hints(LearnerConfig)
    picked = {}
    for attr, name in SWITCHES.items():
        value, allowed = getattr(cfg, name), literal_choices(hints[name])
        if value is not None and value not in allowed:  # from_dict checks it at load; a cfg built in code is not
            raise ConfigError(
                f"learner.{name}: expected {' or '.join(allowed)} (null = the objective's own), got {value!r}"
            )
        picked[attr] = getattr(own, attr) if value is None else value
    return SftChoices(**picked)


class SupervisedLearner(SoftPQNLearner):
    """Drop-in for :class:`SoftPQNLearner` (same schedule, optimiser, checkpoints)."""

    own: ClassVar[SftChoices] = OURS  # what the learner.sft_* switches left null stand for

    @cached_property
    def choices(self) -> SftChoices:
        return sft_choices(self.cfg, self.own)

    def _rollout_and_backward(self, episodes: Sequence[TokenizedSample], alpha: float) -> dict:
        qnet, dev, layout = self.qnet, self.device, self.layout
        env = RetrievalEnv(episodes, self.env_cfg, layout)  # fact classes and valid chunks under the credit rule
        flat = [c for s in episodes for c in s.chunks]
        chunk_vecs = pad_rows(self._embed(qnet.action_encoder, flat, grad=True, kind="chunks"), env.n_chunks)
        n_chunks = to_device(env.n_chunks, dev)
        orders = [self.fact_order(np.asarray(sorted({int(i) for i in s.support}), dtype=np.int64)) for s in episodes]
        # Teacher forcing fixes every step's state in advance: all of them go through the state
        # encoder at once (one packed pass: its kernel launches, not its size, bound the host).
        selected = np.zeros_like(env.selected)
        steps, seqs = [], []  # per step: its rows and what they had selected, and its states
        # With learner.sft_stop, each episode has one more step: the state after its last fact.
        last = 1 if self.cfg.sft_stop else 0
        for t in range(max(len(o) for o in orders) + last):
            rows = np.array([i for i, o in enumerate(orders) if len(o) + last > t], dtype=np.int64)
            steps.append((rows, selected[rows]))  # a copy: fancy indexing
            seqs.append(
                [
                    layout.state(episodes[i].question, [episodes[i].chunks[j] for j in np.flatnonzero(selected[i])])
                    for i in rows
                ]
            )
            for i in rows:
                if len(orders[i]) > t:
                    selected[i, orders[i][t]] = True
        all_states = self._embed_steps(qnet.state_encoder, seqs, kind="states")
        losses = []
        q_pos_sum, q_pos_n = torch.zeros((), device=dev), 0.0
        step_states = all_states.split([len(rows) for rows, _ in steps])
        for t, ((rows, selected_before), states) in enumerate(zip(steps, step_states)):
            rows_t = to_device(rows, dev)
            sel = to_device(selected_before, dev)
            q = QNetwork.twin_scores(
                states, qnet.place(chunk_vecs[rows_t], qnet.positions(sel, n_chunks[rows_t]))
            ).mean(-1)
            available_np = env.valid[rows] & ~selected_before
            going_on = [k for k, i in enumerate(rows) if len(orders[i]) > t]  # the rest are past their last fact
            following_np = np.zeros_like(available_np)
            following_np[going_on, [orders[rows[k]][t] for k in going_on]] = True
            positive_np = self.positives(env.gold[rows] & available_np, following_np & available_np)
            available, positive = to_device(available_np, dev), to_device(positive_np, dev)
            loss = self.step_loss(q.float() / self.cfg.sft_temperature, available, positive)
            if len(going_on) < len(rows) and self.cfg.sft_stop_weight != 1.0:  # rows past their last fact
                weight = np.full(len(rows), self.cfg.sft_stop_weight, dtype=np.float32)
                weight[going_on] = 1.0
                loss = loss * to_device(weight, dev)
            losses.append(loss)
            q_pos_sum = q_pos_sum + (q.detach().float() * positive).sum()  # a masked sum: no wait for the GPU
            q_pos_n += float(positive_np.sum())
        per_step = torch.cat(losses)
        loss_sum = per_step.sum()  # train_update divides by the update's count of steps
        self._backward(loss_sum)
        return {
            "loss_sum": loss_sum.detach(),  # train_update reads the device's figures in one copy
            "q_taken": q_pos_sum / max(q_pos_n, 1.0),
            "target": 1.0,
            "episode_return": 0.0,
            "success": 0.0,
            "episode_length": float(np.mean([len(o) for o in orders])),
            "transitions": int(len(per_step)),
            "counts": {"transitions": float(len(per_step))},
        }

    def fact_order(self, facts: np.ndarray) -> np.ndarray:
        """The order the support facts are taken in: random (a new one each episode) or given (as they
        lie in the context: bAbI's time order)."""
        if self.choices.order == "given":
            return facts
        return facts[torch.randperm(len(facts), generator=self.generator).numpy()]

    def positives(self, missing: np.ndarray, following: np.ndarray) -> np.ndarray:
        """Which chunks are right at this step (rows x chunks): every fact still missing, or the next one only."""
        return following if self.choices.positives == "next" else missing

    def step_loss(self, logits: torch.Tensor, available: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
        """Per row: the cross-entropy of a softmax over the available chunks with its mass on the
        positives, or the mean binary cross-entropy of every available chunk (1 for a positive)."""
        if self.choices.loss == "bce":
            bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, positive.float(), reduction="none")
            return (bce * available).sum(1) / available.sum(1).clamp(min=1)
        if self.cfg.sft_stop:
            # The stop option: logit 0, right exactly where no chunk is (the state after the last fact). A softmax
            # alone leaves Q's level free; against a fixed option, Q must rise above it while a fact is missing
            # and fall below it once none is.
            stop = ~positive.any(1, keepdim=True)
            logits = torch.cat([logits, torch.zeros_like(logits[:, :1])], 1)
            available = torch.cat([available, torch.ones_like(stop)], 1)
            positive = torch.cat([positive, stop], 1)
        logits = logits.masked_fill(~available, float("-inf"))
        return torch.logsumexp(logits, 1) - torch.logsumexp(logits.masked_fill(~positive, float("-inf")), 1)


class TrajectorySupervisedLearner(SupervisedLearner):
    """The paper's "Multi-step RAG w. SFT" (``learner.objective=sft_trajectory``): the same learner
    whose switches default to Beam Retriever's trajectory supervision."""

    own: ClassVar[SftChoices] = PAPERS


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
