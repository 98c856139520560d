"""What the learner regresses Q onto, checked against values the test computes itself.

Each test names the planted bug it catches (verified by planting it in a copy of the package).
The learner is observed through spies on the environment (rewards, dones, actions), on
``soft_value`` (the bootstrapped V) and on ``QNetwork.pair_scores`` (the Q of the loss); nothing
here depends on how the learner arranges its arrays.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import qrag.rl.learner as learner_mod
from qrag.model.checkpoint import untrained_qnet
from qrag.config import EnvConfig, LearnerConfig, ModelConfig
from qrag.data.sample import Sample
from qrag.rl.env import RetrievalEnv
from qrag.rl.learner import SoftPQNLearner
from qrag.model.qnet import QNetwork
from qrag.retrieval.search import Retriever
from qrag.data.tokens import tokenize_samples

CPU = torch.device("cpu")
GAMMA, LAM = 0.9, 0.5

# One question and context, several answer keys: a greedy policy picks the same chunks for all of
# them, so within one batch some episodes succeed at the first step, some at the second, some never.
CHUNKS = ["the river alpha flows north to the sea", "the castle beta stands on a hill", "a ship gamma sails at night"]
SUPPORTS = [[0], [1], [2], [0, 1], [1, 2], [0, 2]]


def make_learner(tiny_encoder, env: EnvConfig, positions: str = "none", use_target: bool = True, **kw):
    qnet, tok, layout = untrained_qnet(
        ModelConfig(encoder=tiny_encoder, positions=positions), CPU, use_target=use_target
    )
    cfg = LearnerConfig(
        **{
            "gamma": GAMMA,
            "lam": LAM,
            "episodes_per_update": len(SUPPORTS),
            "micro_batch": len(SUPPORTS),
            "warmup_updates": 1,
            "lr": 1e-3,
            "alpha": 0.0,
            "grad_clip": 1e9,
            **kw,
        }
    )
    learner = SoftPQNLearner(qnet, layout, env, cfg, total_updates=10, device=CPU)
    samples = [Sample(f"s{i}", "which river flows north", list(CHUNKS), sup) for i, sup in enumerate(SUPPORTS)]
    return learner, tokenize_samples(samples, tok, layout, chunk_tokens=32, question_tokens=16), layout


class Spy:
    """Records env steps (with the selection before each), soft_value calls and loss-pass Qs."""

    def __init__(self, monkeypatch, constant_value: float | None = None):
        self.steps: list[dict] = []
        self.values: list[dict] = []
        self.q_taken: list[torch.Tensor] = []
        real_step, real_soft, real_pair = RetrievalEnv.step, learner_mod.soft_value, QNetwork.pair_scores

        def step(env, rows, actions):
            before = env.selected[np.asarray(rows)].copy()
            r, d = real_step(env, rows, actions)
            self.steps.append(
                {
                    "env": env,
                    "rows": np.asarray(rows).copy(),
                    "actions": np.asarray(actions).copy(),
                    "selected_before": before,
                    "rewards": np.asarray(r, dtype=float).copy(),
                    "dones": np.asarray(d).copy(),
                }
            )
            return r, d

        def soft_value(q, available, alpha, top_k, soft):
            v = real_soft(q, available, alpha, top_k, soft)
            self.values.append(
                {
                    "q": q.detach().clone(),
                    "available": available.clone(),
                    "alpha": alpha,
                    "top_k": top_k,
                    "soft": soft,
                    "v": v.detach().clone(),
                }
            )
            return torch.full_like(v, constant_value) if constant_value is not None else v

        def pair_scores(state, placed_chunk):
            out = real_pair(state, placed_chunk)
            self.q_taken.append(out.detach().clone())
            return out

        monkeypatch.setattr(RetrievalEnv, "step", step)
        monkeypatch.setattr(learner_mod, "soft_value", soft_value)
        monkeypatch.setattr(QNetwork, "pair_scores", staticmethod(pair_scores))

    def episodes(self) -> dict[int, list[tuple[float, bool]]]:
        """(reward, done) of each transition, per episode row, in time order."""
        out: dict[int, list[tuple[float, bool]]] = {}
        for s in self.steps:
            for row, r, d in zip(s["rows"], s["rewards"], s["dones"]):
                out.setdefault(int(row), []).append((float(r), bool(d)))
        return out

    def transition_order(self) -> list[tuple[int, int]]:
        """(row, t) of every transition, in the order the learner stacks them (step by step)."""
        order, t_of = [], {}
        for s in self.steps:
            for row in s["rows"]:
                order.append((int(row), t_of.get(int(row), 0)))
                t_of[int(row)] = t_of.get(int(row), 0) + 1
        return order


def expected_returns(transitions: list[tuple[float, bool]], v: float) -> list[float]:
    """G_t = r_t + γ(1 − d_t)[(1 − λ)V + λ G_{t+1}] with V(s_{t+1}) = v everywhere; written out
    per episode, independently of qrag.rl.learner.lambda_returns."""
    out = [0.0] * len(transitions)
    g_next = 0.0
    for t in range(len(transitions) - 1, -1, -1):
        r, d = transitions[t]
        out[t] = r if d else r + GAMMA * ((1 - LAM) * v + LAM * g_next)
        g_next = out[t]
    return out


ENVS = {
    "terminate": EnvConfig(max_steps=2),
    "never_terminate": EnvConfig(max_steps=2, never_terminate=True),
    "penalize_extra_steps": EnvConfig(max_steps=2, penalize_extra_steps=True),
    "both": EnvConfig(max_steps=2, never_terminate=True, penalize_extra_steps=True),
}


@pytest.mark.parametrize("name", list(ENVS))
def test_targets_are_lambda_returns_and_the_last_target_is_the_reward(tiny_encoder, monkeypatch, name):
    """Planted bugs caught: the last transition bootstraps (``(1 − d)`` dropped in lambda_returns,
    or dones not set at T); λ-returns that ignore rewards after a success (never_terminate) or the
    extra-steps penalty; a target off by one step."""
    env_cfg = ENVS[name]
    v_const = 0.37
    learner, episodes, _ = make_learner(tiny_encoder, env_cfg)
    spy = Spy(monkeypatch, constant_value=v_const)
    m = learner.train_update(episodes)
    per_episode = spy.episodes()
    targets = {row: expected_returns(tr, v_const) for row, tr in per_episode.items()}
    # The batch covers the case each setting is about.
    lengths = [len(tr) for tr in per_episode.values()]
    rewards = [r for tr in per_episode.values() for r, _ in tr]
    if env_cfg.never_terminate:
        assert all(n == 2 for n in lengths)
        assert any(tr[0][0] > 0 for tr in per_episode.values())  # a success at t=0, then a step with reward 0
    else:
        assert 1 in lengths and 2 in lengths
    if env_cfg.penalize_extra_steps:
        assert any(0 < r < 1 for r in rewards)  # 0.5 + 0.5·|gold|/|selected| after an extra step
    for row, tr in per_episode.items():
        assert targets[row][-1] == pytest.approx(tr[-1][0])  # the last target is the last reward, no bootstrap
    q = torch.cat(spy.q_taken)  # [K, 2]: Q1, Q2 of every transition, in the learner's order
    g = torch.tensor([targets[row][t] for row, t in spy.transition_order()], dtype=q.dtype)
    assert len(g) == len(q) == m.transitions
    expected_loss = ((q - g[:, None]) ** 2).mean(0).sum()
    assert m.loss == pytest.approx(float(expected_loss), rel=1e-5)
    assert m.target == pytest.approx(float(g.mean()), rel=1e-5)


def _perturb(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def _selected_after(step: dict, i: int) -> np.ndarray:
    after = step["selected_before"][i].copy()
    after[step["actions"][i]] = True
    return after


def _expected_next_q(learner: SoftPQNLearner, spy: Spy, state_enc, action_enc) -> list[torch.Tensor]:
    """min(Q1, Q2)(s_{t+1}, ·) of the episodes that go on after each step, recomputed from scratch
    with the given encoders (positions off)."""
    layout = learner.layout
    model = copy.deepcopy(learner.qnet)  # a copy: Retriever puts its model in eval mode
    model.state_encoder, model.action_encoder = copy.deepcopy(state_enc), copy.deepcopy(action_enc)
    retr = Retriever(model, layout, CPU)
    out = []
    for s in spy.steps:
        rows = []
        for i, row in enumerate(s["rows"]):
            if s["dones"][i]:
                continue
            sample = s["env"].samples[row]
            chosen = np.flatnonzero(_selected_after(s, i))
            state = retr.embed_states([layout.state(sample.question, [sample.chunks[j] for j in chosen])])
            twins = QNetwork.twin_scores(state, retr.embed_chunks(sample.chunks).unsqueeze(0))[0]  # [N, 2]
            rows.append(twins.min(-1).values)
        if rows:
            out.append(torch.stack(rows))
    return out


def _check_values(spy: Spy, expected: list[torch.Tensor], soft: bool, alpha: float) -> None:
    assert len(expected) == len(spy.values) > 0
    for exp_q, call in zip(expected, spy.values):
        avail = call["available"]
        assert torch.allclose(call["q"][avail], exp_q[avail], atol=1e-5)
        top = exp_q.masked_fill(~avail, float("-inf")).topk(min(call["top_k"], exp_q.shape[1]), dim=1).values
        v = alpha * torch.logsumexp(top / alpha, dim=1) if soft else top[:, 0]
        assert call["alpha"] == pytest.approx(alpha)
        assert torch.allclose(call["v"], v, atol=1e-5)


@pytest.mark.parametrize("soft_q", [True, False])
def test_v_uses_the_target_encoders_and_the_min_over_twin_halves(tiny_encoder, monkeypatch, soft_q):
    """Planted bugs caught: V from the online state encoder or the online chunk vectors, the mean
    (or max) of the twin halves instead of the min, soft_q=false still taking the soft value."""
    learner, episodes, _ = make_learner(tiny_encoder, ENVS["never_terminate"], soft_q=soft_q, alpha=0.05)
    qnet = learner.qnet
    _perturb(qnet.target_state_encoder, 1)  # the targets now differ from the online encoders
    _perturb(qnet.target_action_encoder, 2)
    before = (
        copy.deepcopy(qnet.target_state_encoder),
        copy.deepcopy(qnet.target_action_encoder),
    )  # the EMA moves them after
    spy = Spy(monkeypatch)
    learner.train_update(episodes)
    _check_values(spy, _expected_next_q(learner, spy, *before), soft_q, 0.05)


def test_without_targets_v_uses_the_online_encoders(tiny_encoder, monkeypatch):
    """Planted bug caught: target_encoders() returning anything but the online encoders when the
    Q-network has no targets (use_target=false, as TrainingRun builds it)."""
    learner, episodes, _ = make_learner(tiny_encoder, ENVS["never_terminate"], use_target=False, alpha=0.05)
    qnet = learner.qnet
    before = copy.deepcopy(qnet.state_encoder), copy.deepcopy(qnet.action_encoder)  # the update moves them after
    spy = Spy(monkeypatch)
    learner.train_update(episodes)
    _check_values(spy, _expected_next_q(learner, spy, *before), True, 0.05)


def test_use_target_false_in_the_config_uses_the_online_encoders(tiny_encoder, monkeypatch):
    learner, episodes, _ = make_learner(tiny_encoder, ENVS["never_terminate"], use_target=True, alpha=0.05)
    learner.cfg.use_target = False
    qnet = learner.qnet
    _perturb(qnet.target_state_encoder, 1)
    _perturb(qnet.target_action_encoder, 2)
    before = copy.deepcopy(qnet.state_encoder), copy.deepcopy(qnet.action_encoder)
    spy = Spy(monkeypatch)
    learner.train_update(episodes)
    _check_values(spy, _expected_next_q(learner, spy, *before), True, 0.05)


def _gradient_of_one_update(learner: SoftPQNLearner, episodes) -> list[torch.Tensor]:
    """The accumulated gradient the optimiser steps with (grad_clip is huge: nothing is clipped)."""
    seen: list[torch.Tensor] = []
    real_step = learner.optimizer.step

    def step(*args, **kwargs):
        seen.extend(
            torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in learner.qnet.online_parameters()
        )
        return real_step(*args, **kwargs)

    learner.optimizer.step = step
    learner.train_update(episodes)
    return seen


def _assert_same_gradient(tiny_encoder, env: EnvConfig) -> None:
    whole, eps_whole, _ = make_learner(tiny_encoder, env)  # one micro-batch of 6 episodes
    parts, eps_parts, _ = make_learner(tiny_encoder, env, micro_batch=2)  # three of 2
    g_whole, g_parts = _gradient_of_one_update(whole, eps_whole), _gradient_of_one_update(parts, eps_parts)
    assert len(g_whole) == len(g_parts) > 0 and any(g.abs().sum() > 0 for g in g_whole)
    for a, b in zip(g_whole, g_parts):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def test_micro_batches_accumulate_the_gradient_of_one_batch(tiny_encoder):
    """Planted bugs caught: micro-batch losses not weighted by their share of the batch (summed),
    gradients zeroed between micro-batches. Every episode here lasts T steps (never_terminate)."""
    _assert_same_gradient(tiny_encoder, ENVS["never_terminate"])


def test_micro_batches_accumulate_the_gradient_of_one_batch_when_episodes_differ_in_length(tiny_encoder):
    _assert_same_gradient(tiny_encoder, ENVS["terminate"])


def test_boltzmann_policy_samples_the_softmax_over_the_top_k_available_chunks(tiny_encoder):
    """A frequency (chi-square) check against softmax(Q/α) over the top-k available chunks.
    Planted bugs caught: logits not divided by α, the Gumbel noise with the wrong sign, the top-k
    taken before masking the selected chunks."""
    learner, _, _ = make_learner(tiny_encoder, ENVS["terminate"], top_k=3)
    n, alpha = 30000, 0.1
    q = torch.tensor([[0.9, 0.5, 0.45, 0.4, 0.3, 0.1]]).repeat(n, 1)
    available = torch.tensor([[False, True, True, True, True, True]]).repeat(n, 1)  # chunk 0 is already selected
    counts = np.bincount(learner.sample_actions(q, available, alpha), minlength=6)
    assert counts[0] == counts[4] == counts[5] == 0  # only the top 3 *available* chunks
    p = torch.softmax(torch.tensor([0.5, 0.45, 0.4]) / alpha, 0).numpy()
    chi2 = float((((counts[1:4] - n * p) ** 2) / (n * p)).sum())
    assert chi2 < 20.0, (counts, n * p)  # 2 degrees of freedom: P(χ² > 20) ≈ 5e-5


def test_training_q_equals_the_acting_time_score(tiny_encoder, monkeypatch):
    """Q(s_t, a_t) that the loss regresses equals the score search gives the same chunk in the same
    state (relative positions: the rotation depends on what was selected before the step).
    Planted bugs caught: positions of the chosen chunk taken after the step, the loss pass
    encoding s_{t+1} instead of s_t, chosen chunks misaligned with their states."""
    learner, episodes, layout = make_learner(tiny_encoder, EnvConfig(max_steps=3), positions="relative", alpha=0.05)
    snapshot = copy.deepcopy(learner.qnet)  # the weights the rollout acted with
    spy = Spy(monkeypatch)
    learner.train_update(episodes)
    retr = Retriever(snapshot, layout, CPU)
    expected = []
    for s in spy.steps:
        for i, row in enumerate(s["rows"]):
            sample, sel = s["env"].samples[row], s["selected_before"][i]
            state = retr.embed_states([layout.state(sample.question, [sample.chunks[j] for j in np.flatnonzero(sel)])])
            scores = retr.score(
                state, retr.embed_chunks(sample.chunks), torch.from_numpy(sel)[None], torch.tensor([sample.n_chunks])
            )
            expected.append(scores[0, s["actions"][i]])
    assert any(s["selected_before"].any() for s in spy.steps)  # later steps, with rotated positions
    assert torch.allclose(torch.cat(spy.q_taken).mean(1), torch.stack(expected), atol=1e-5)
