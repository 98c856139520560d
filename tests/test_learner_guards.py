"""Learner rules that an outside review's planted bugs slipped past (issue 33): each test names the
bug it catches, and was seen failing with it planted.

* the target EMA moves *both* target encoders (state and action) by τ;
* the soft value V is taken over ``learner.value_top_k`` chunks, not ``learner.top_k``;
* an update's metrics weight each micro-batch by its share of the episodes;
* the gradient is divided by the update's transition count before it is clipped.

The last two replace the rollout with a stub, so that what is measured is the update's
bookkeeping alone (no encoder pass decides the numbers).
"""

from __future__ import annotations

import copy

import pytest
import torch

from test_learner_targets import ENVS, Spy, make_learner


def _params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("tau", [0.3, 1.0])
def test_the_target_ema_moves_both_target_encoders(tiny_encoder, tau):
    """Planted bug caught: the EMA skipping the action encoder's target (or the state's)."""
    learner, episodes, _ = make_learner(tiny_encoder, ENVS["terminate"], tau=tau)
    qnet = learner.qnet
    with torch.no_grad():  # targets unlike the online encoders, so a skipped EMA shows
        for p in list(qnet.target_state_encoder.parameters()) + list(qnet.target_action_encoder.parameters()):
            p.add_(0.1)
    before = {"state": _params(qnet.target_state_encoder), "action": _params(qnet.target_action_encoder)}
    learner.train_update(episodes)
    online = {"state": _params(qnet.state_encoder), "action": _params(qnet.action_encoder)}
    after = {"state": _params(qnet.target_state_encoder), "action": _params(qnet.target_action_encoder)}
    for name in ("state", "action"):
        moved = [a for a, b in zip(after[name], before[name]) if not torch.equal(a, b)]
        assert moved, f"the {name} encoder's target did not move"
        for old, new, on in zip(before[name], after[name], online[name]):
            assert torch.allclose(new, old + tau * (on - old), atol=1e-6), name


def test_the_soft_value_uses_value_top_k(tiny_encoder, monkeypatch):
    """Planted bug caught: ``learner.value_top_k`` ignored (V over ``top_k`` chunks)."""
    learner, episodes, _ = make_learner(tiny_encoder, ENVS["never_terminate"], alpha=0.05, top_k=3, value_top_k=1)
    spy = Spy(monkeypatch)
    learner.train_update(episodes)
    assert spy.values and {call["top_k"] for call in spy.values} == {1}
    learner2, episodes2, _ = make_learner(tiny_encoder, ENVS["never_terminate"], alpha=0.05, top_k=2)
    spy2 = Spy(monkeypatch)
    learner2.train_update(episodes2)
    assert {call["top_k"] for call in spy2.values} == {2}  # value_top_k unset: top_k


def _stub_rollout(learner, parts: list[dict], grad: float = 0.0, transitions: int = 1):
    """Replace the rollout: part i reports ``parts[i]``'s metrics; every part adds ``grad`` to each
    online parameter's gradient and reports ``transitions`` transitions."""
    calls = iter(parts)

    def rollout(episodes, alpha):
        values = next(calls)
        if grad:
            for p in learner.qnet.online_parameters():
                p.grad = torch.full_like(p, grad) if p.grad is None else p.grad + grad
        return {
            "loss_sum": 0.0,
            "q_taken": values["q"],
            "target": values["q"],
            "episode_return": values["success"],
            "success": values["success"],
            "episode_length": values["length"],
            "transitions": transitions,
            "counts": {"transitions": float(transitions)},
        }

    learner._rollout_and_backward = rollout


def test_update_metrics_weight_micro_batches_by_their_episodes(tiny_encoder):
    """Planted bug caught: micro-batch metrics weighted by part count (1/parts) instead of each
    part's share of the episodes. Six episodes in micro-batches of 4 and 2."""
    learner, episodes, _ = make_learner(tiny_encoder, ENVS["terminate"], micro_batch=4)
    _stub_rollout(learner, [{"success": 1.0, "q": 0.6, "length": 1.0}, {"success": 0.0, "q": 0.0, "length": 2.0}])
    m = learner.train_update(episodes)
    assert m.success == pytest.approx(4 / 6) and m.episode_return == pytest.approx(4 / 6)
    assert m.q_taken == pytest.approx(0.6 * 4 / 6) and m.episode_length == pytest.approx((4 * 1 + 2 * 2) / 6)


def test_the_gradient_is_divided_by_the_transitions_before_it_is_clipped(tiny_encoder):
    """Planted bug caught: the gradient clipped first and divided by the transition count after
    (a step |transitions| times smaller than the clip allows)."""
    clip, transitions = 0.5, 50
    learner, episodes, _ = make_learner(tiny_encoder, ENVS["terminate"], grad_clip=clip)
    _stub_rollout(learner, [{"success": 0.0, "q": 0.0, "length": 1.0}], grad=1.0, transitions=transitions)
    n_params = sum(p.numel() for p in learner.qnet.online_parameters())
    mean_norm = n_params**0.5 / transitions  # every gradient entry 1 / transitions after the division
    assert mean_norm > clip  # so the clip must act
    seen: list[float] = []
    real_step = learner.optimizer.step

    def step(*args, **kwargs):
        grads = [p.grad.flatten() for p in learner.qnet.online_parameters() if p.grad is not None]
        seen.append(float(torch.cat(grads).norm()))
        return real_step(*args, **kwargs)

    learner.optimizer.step = step
    m = learner.train_update(episodes)
    assert m.grad_norm == pytest.approx(mean_norm, rel=2e-3)  # the norm of the mean gradient, before clipping
    assert seen[0] == pytest.approx(clip, rel=2e-3)  # the step gets the clipped mean gradient


def test_the_stub_matches_the_learner(tiny_encoder):
    """The stubs above return what the real rollout returns (same keys): they test the real update."""
    learner, episodes, _ = make_learner(tiny_encoder, ENVS["terminate"])
    real = copy.copy(learner)._rollout_and_backward(episodes, 0.0)
    assert {
        "loss_sum",
        "q_taken",
        "target",
        "episode_return",
        "success",
        "episode_length",
        "transitions",
        "counts",
    } <= set(real)


def test_the_policy_entropy_diagnostic_is_the_softmax_entropy_over_the_top_k(tiny_encoder):
    """Planted bug caught: the entropy averaged over the top-k instead of summed (ln k at uniform)."""
    learner, _, _ = make_learner(tiny_encoder, ENVS["terminate"], top_k=4)
    q = torch.tensor([[0.9, 0.5, 0.45, 0.4, 0.3, 0.1], [0.5, 0.5, 0.5, 0.5, 0.5, 0.5]])
    available = torch.ones_like(q, dtype=torch.bool)
    _, entropy = learner.sample_actions_with_entropy(q, available, 0.1)
    p = torch.softmax(torch.tensor([0.9, 0.5, 0.45, 0.4]) / 0.1, 0)
    assert entropy[0] == pytest.approx(float(-(p * p.log()).sum()), rel=1e-5)
    assert entropy[1] == pytest.approx(float(torch.log(torch.tensor(4.0))), rel=1e-5)  # uniform over the top 4
