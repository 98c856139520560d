import numpy as np
import pytest
import torch

from qrag.config import EnvConfig, LearnerConfig, ModelConfig
from qrag.rl.learner import alpha_at, lambda_returns, lr_factor, soft_value


def test_lambda_returns_hand_computed():
    gamma, lam = 0.9, 0.5
    v1, v2 = 0.4, 0.7  # V(s_1), V(s_2)
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    dones = torch.tensor([[0.0, 0.0, 1.0]])
    next_values = torch.tensor([[v1, v2, 123.0]])  # value after the last step must be ignored
    g = lambda_returns(rewards, dones, next_values, gamma, lam)[0]
    g2 = 1.0
    g1 = 0 + gamma * ((1 - lam) * v2 + lam * g2)
    g0 = 0 + gamma * ((1 - lam) * v1 + lam * g1)
    assert g.tolist() == pytest.approx([g0, g1, g2])


def test_lambda_returns_early_termination_and_extremes():
    rewards = torch.tensor([[1.0, 0.0]])
    dones = torch.tensor([[1.0, 1.0]])  # ended at step 0
    assert lambda_returns(rewards, dones, torch.tensor([[5.0, 5.0]]), 0.99, 0.5)[0, 0] == 1.0
    # λ = 0: one-step TD target r + γ V(s_{t+1}); λ = 1: Monte-Carlo return.
    r = torch.tensor([[0.0, 1.0]])
    d = torch.tensor([[0.0, 1.0]])
    v = torch.tensor([[0.3, 0.0]])
    assert lambda_returns(r, d, v, 0.9, 0.0)[0, 0].item() == pytest.approx(0.9 * 0.3)
    assert lambda_returns(r, d, v, 0.9, 1.0)[0, 0].item() == pytest.approx(0.9)


def test_soft_value_masks_before_top_k():
    q = torch.tensor([[5.0, 1.0, 0.9, 0.1]])
    available = torch.tensor([[False, True, True, True]])  # the best chunk is already selected
    v = soft_value(q, available, alpha=0.05, top_k=1, soft=True)
    assert v.item() == pytest.approx(1.0)  # not 5.0: unavailable chunks never enter V
    hard = soft_value(q, available, alpha=0.05, top_k=3, soft=False)
    assert hard.item() == pytest.approx(1.0)
    soft = soft_value(q, available, alpha=0.05, top_k=3, soft=True)
    expected = 0.05 * np.log(np.exp(1 / 0.05) + np.exp(0.9 / 0.05) + np.exp(0.1 / 0.05))
    assert soft.item() == pytest.approx(expected, rel=1e-5)


def test_lr_schedule_and_alpha_never_rises():
    cfg = LearnerConfig(warmup_updates=10, final_lr_fraction=0.1, alpha=0.05)
    lrs = [lr_factor(u, 10, 100, 0.1) for u in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lr_factor(100, 10, 100, 0.1) == pytest.approx(0.1)
    alphas = [alpha_at(u, cfg, 100) for u in range(101)]
    assert all(a2 <= a1 + 1e-12 for a1, a2 in zip(alphas, alphas[1:]))
    assert alphas[0] == 0.05 and alphas[100] == pytest.approx(0.005)


def _learner(tiny_encoder, dropout: float = 0.0, targets: bool = True, device: str = "cpu", **learner_kw):
    """A learner on the tiny encoder, of the class ``learner.objective`` names (soft PQN unless
    set); ``targets``: whether the Q-network has target encoders."""
    from qrag.model.checkpoint import untrained_qnet
    from qrag.rl.train import learner_class

    dev = torch.device(device)
    qnet, tok, layout = untrained_qnet(
        ModelConfig(encoder=tiny_encoder, positions="relative", dropout=dropout), dev, use_target=targets
    )
    cfg = LearnerConfig(**{"episodes_per_update": 4, "micro_batch": 2, "warmup_updates": 1, "lr": 1e-3, **learner_kw})
    return learner_class(cfg)(qnet, layout, EnvConfig(max_steps=3), cfg, total_updates=10, device=dev), tok, layout


def _episodes(tok, layout, n=4):
    from qrag.data.sample import Sample
    from qrag.data.tokens import tokenize_samples

    samples = [Sample(f"s{i}", f"question {i}", [f"chunk {j} of {i}" for j in range(6)], [1, 4]) for i in range(n)]
    return tokenize_samples(samples, tok, layout, chunk_tokens=16, question_tokens=16)


def test_update_trains_every_transition_including_the_last(tiny_encoder):
    learner, tok, layout = _learner(tiny_encoder, alpha=0.0)
    eps = _episodes(tok, layout)
    before = [p.detach().clone() for p in learner.qnet.online_parameters()]
    target_before = [p.detach().clone() for p in learner.qnet.target_state_encoder.parameters()]
    m = learner.train_update(eps)
    # every step of every episode, the terminal one included, enters the loss
    assert m.transitions == pytest.approx(m.episode_length * len(eps))
    assert m.transitions >= len(eps)
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.qnet.online_parameters()))
    # targets moved by exactly tau towards the online weights
    online = list(learner.qnet.state_encoder.parameters())
    for t_old, t_new, o in zip(target_before, learner.qnet.target_state_encoder.parameters(), online):
        assert torch.allclose(t_new, t_old + 0.02 * (o.detach() - t_old), atol=1e-6)
    assert learner.update == 1


def test_ablations_run(tiny_encoder):
    for kw in ({"use_target": False}, {"soft_q": False}):
        learner, tok, layout = _learner(tiny_encoder, **kw)
        if not kw.get("use_target", True):
            learner.qnet.use_target = False
        m = learner.train_update(_episodes(tok, layout))
        assert np.isfinite(m.loss)


def test_sampling_respects_availability_and_top_k(tiny_encoder):
    learner, _, _ = _learner(tiny_encoder, top_k=2, alpha=10.0)
    q = torch.tensor([[0.9, 0.8, 0.7, 0.1]]).repeat(500, 1)
    available = torch.tensor([[False, True, True, True]]).repeat(500, 1)
    actions = learner.sample_actions(q, available, alpha=10.0)
    assert set(actions.tolist()) == {1, 2}  # never the selected chunk 0, never outside the top-2
    greedy = learner.sample_actions(q, available, alpha=0.0)
    assert set(greedy.tolist()) == {1}


def record_on_encode(monkeypatch, what) -> dict[str, set]:
    """``what(model)`` at every encode() call of the learner, per pass (its ``kind``)."""
    import qrag.rl.learner as learner_mod

    seen: dict[str, set] = {}
    real_encode = learner_mod.encode

    def spy(model, seqs, **kw):
        seen.setdefault(kw["kind"], set()).add(what(model))
        return real_encode(model, seqs, **kw)

    monkeypatch.setattr(learner_mod, "encode", spy)
    return seen


def test_dropout_reaches_both_encoders_in_the_loss_pass(tiny_encoder, monkeypatch):
    """With model.dropout > 0: acting and V see deterministic encoders, the loss passes (states
    and chosen chunks, with gradients) run in train mode, so dropout regularises both encoders.
    (The state encoder used to stay in eval mode for its loss pass.)"""
    learner, tok, layout = _learner(tiny_encoder, dropout=0.1)
    modes = record_on_encode(monkeypatch, lambda model: model.training)
    learner.train_update(_episodes(tok, layout))
    assert modes["states_grad"] == {True} and modes["chosen_chunks"] == {True}
    assert modes["states"] == {False} and modes["chunks"] == {False}
    assert modes["target_states"] == {False} and modes["target_chunks"] == {False}


def test_passes_without_gradients_run_without_dropout_even_without_targets(tiny_encoder, monkeypatch):
    """w/o target bootstraps V from the online state encoder: that pass too runs in eval mode (it
    used to carry the loss pass's dropout noise into V)."""
    learner, tok, layout = _learner(tiny_encoder, dropout=0.1, targets=False, use_target=False)
    modes = record_on_encode(monkeypatch, lambda model: model.training)
    learner.train_update(_episodes(tok, layout))
    assert modes["target_states"] == {False}  # the online state encoder, for V
    assert modes["states_grad"] == {True}
    assert learner.qnet.state_encoder.training  # the mode comes back after each pass


def test_graphed_passes_give_the_learners_own_vectors(tiny_encoder):
    """learner.graphs' bucketed, padded passes (eager on the CPU, the same code a GPU captures)
    give the vectors of the learner's own encode(), in input order, and count the same tokens."""
    from qrag.model.encoder import EncodeStats
    from qrag.rl.graphed_passes import GraphedPasses

    learner, tok, layout = _learner(tiny_encoder)
    eps = _episodes(tok, layout, n=5)
    seqs = [c for e in eps for c in e.chunks] + [e.question for e in eps]
    passes = GraphedPasses(learner.qnet, layout.pad_id, torch.device("cpu"), max_tokens=64)
    stats = EncodeStats()
    learner.qnet.eval()
    graphed = passes.encode(learner.qnet.action_encoder, seqs, stats, "chunks")
    eager = learner._encode(learner.qnet.action_encoder, seqs, False, "chunks")
    assert graphed.shape == eager.shape
    assert torch.allclose(graphed, eager, atol=1e-5)
    assert stats.tokens == sum(len(s) for s in seqs) and stats.padded_tokens >= stats.tokens
    too_long = [np.full(600, 5, dtype=np.int64)]  # past the largest length bucket: the caller encodes it
    assert passes.encode(learner.qnet.action_encoder, too_long, stats, "chunks") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphed_passes_follow_the_optimiser_on_a_gpu(tiny_encoder):
    """The graphs read the parameters in place: after updates (optimiser steps, target updates),
    graphed and eager passes still agree, for the online and the target encoders."""
    from qrag.model.encoder import EncodeStats

    learner, tok, layout = _learner(tiny_encoder, dropout=0.1, device="cuda:0", lr=1e-2, tau=0.5, packed=False)
    assert _learner(tiny_encoder, device="cuda:0")[0].graphed is None  # packed passes (the default) need none
    qnet = learner.qnet
    eps = _episodes(tok, layout)
    seqs = [c for e in eps for c in e.chunks]
    for _ in range(3):
        learner.train_update(eps)
        for encoder in (qnet.action_encoder, qnet.target_state_encoder):
            learner.qnet.eval()
            graphed = learner.graphed.encode(encoder, seqs, EncodeStats(), "check")
            eager = learner._encode(encoder, seqs, False, "check")
            learner.qnet.train()
            assert torch.allclose(graphed, eager, atol=2e-2), (graphed - eager).abs().max()
    assert learner.graphed.captured_shapes > 0 and not learner.graphed.fallbacks


@pytest.mark.parametrize("cudnn", [False, True])
def test_training_passes_keep_off_cudnn_attention_unless_asked(tiny_encoder, monkeypatch, cudnn):
    """learner.cudnn_attention=false (the default): every encoder pass of an update, the loss passes
    included, runs with cuDNN's attention disabled; true leaves PyTorch's own choice."""
    learner, tok, layout = _learner(tiny_encoder, cudnn_attention=cudnn)
    seen = record_on_encode(monkeypatch, lambda model: torch.backends.cuda.cudnn_sdp_enabled())
    learner.train_update(_episodes(tok, layout))
    seen = set().union(*seen.values())
    assert seen == {cudnn}
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the process's setting comes back after the update


def test_a_timed_update_splits_its_encoder_time_by_pass(tiny_encoder):
    """EncodeStats.timed (bench/train_speed.py --timed): every pass and the backward get their seconds,
    which add up to the encoder total; untimed, nothing is measured (no syncs in a normal update)."""
    learner, tok, layout = _learner(tiny_encoder)
    learner.stats.timed = True
    m = learner.train_update(_episodes(tok, layout))
    assert {"chunks", "target_chunks", "states", "target_states", "chosen_chunks", "backward"} <= set(
        learner.stats.by_kind
    )
    assert m.encoder_seconds == pytest.approx(sum(learner.stats.by_kind.values())) and m.encoder_seconds > 0
    learner.stats.timed = False
    assert learner.train_update(_episodes(tok, layout)).encoder_seconds == 0 and not learner.stats.by_kind


def _passes_by_kind(learner, monkeypatch) -> dict[str, int]:
    """How many encoder passes of each kind the learner makes (its ``_embed`` calls)."""
    counts: dict[str, int] = {}
    real_embed = learner._embed

    def spy(model, seqs, grad=False, kind="encode"):
        counts[kind] = counts.get(kind, 0) + 1
        return real_embed(model, seqs, grad=grad, kind=kind)

    monkeypatch.setattr(learner, "_embed", spy)
    return counts


@pytest.mark.parametrize("packed", [False, True])
def test_shared_loss_passes_take_the_per_step_learners_step(tiny_encoder, monkeypatch, packed):
    """With dropout, the loss re-encodes the states (steps 0 and 1 in one pass) and every step's
    chosen chunks (one pass at the end). With dropout's noise off, loss and gradients are those of
    the dropout-free learner, which keeps each step's own acting pass for the loss: each transition
    meets its own state and its own chunk."""
    import dataclasses

    learner, tok, layout = _learner(tiny_encoder, dropout=0.1, alpha=0.5, packed=packed)
    for module in learner.qnet.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0  # the deterministic network, on the dropout learner's code path
    eps = _episodes(tok, layout)
    counts = _passes_by_kind(learner, monkeypatch)
    acted_q: list[torch.Tensor] = []  # Q(s_t, a_t) as acting saw it, in transition order
    real_sample = learner.sample_top_k

    def sample_and_record(pending, alpha):
        vals, idx = pending.wait()
        actions, entropy = real_sample(pending, alpha)
        taken = torch.as_tensor(actions).unsqueeze(1) == idx
        acted_q.append(vals[taken])
        return actions, entropy

    monkeypatch.setattr(learner, "sample_top_k", sample_and_record)
    results = []
    for dropout in (0.1, 0.0):
        learner.qnet.cfg = dataclasses.replace(learner.qnet.cfg, dropout=dropout)
        counts.clear()
        acted_q.clear()
        learner.generator.manual_seed(3)
        learner.qnet.zero_grad(set_to_none=True)
        out = learner._rollout_and_backward(eps, alpha=0.5)
        grads = [p.grad.clone() for p in learner.qnet.online_parameters() if p.grad is not None]
        results.append((float(out["loss_sum"]), out["transitions"], grads, dict(counts)))
        # The loss's Q of each transition (its state and chunk re-encoded) is the Q it acted on.
        assert float(out["q_taken"]) == pytest.approx(float(torch.cat(acted_q).mean()), rel=1e-5)
    (loss, n, grads, counts), (loss_ref, n_ref, grads_ref, counts_ref) = results
    assert n == n_ref > 2 * len(eps)  # some episodes took a third step: a states pass of its own
    # Packed: steps 0 and 1 in one pass, step 2 in its own; padded: a pass per step (_embed_steps).
    assert counts["chosen_chunks"] == 1 and counts["states_grad"] == (2 if packed else 3)
    assert counts_ref["chosen_chunks"] == 1 and "states_grad" not in counts_ref
    assert loss == pytest.approx(loss_ref, rel=1e-5)
    assert len(grads) == len(grads_ref) > 0
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, grads_ref))


@pytest.mark.parametrize("packed", [False, True])
def test_several_steps_share_a_pass_only_where_nothing_is_padded(tiny_encoder, monkeypatch, packed):
    """_embed_steps: packed, one pass over every step's sequences; padded, one pass per step, so that
    the short states of step 0 are not padded to step 1's longer ones (a GPU's padded batches are
    not cut by length). The vectors are each sequence's own, in step order, either way."""
    import qrag.model.encoder as encoder_mod

    monkeypatch.setattr(encoder_mod, "split_ratio_for", lambda device: 0.0)  # a GPU's rule
    learner, tok, layout = _learner(tiny_encoder, packed=packed)
    eps = _episodes(tok, layout)
    short = [e.question for e in eps]
    long = [layout.state(e.question, list(e.chunks[:3])) for e in eps]
    counts = _passes_by_kind(learner, monkeypatch)
    learner.qnet.eval()
    learner.stats.reset()
    vectors = learner._embed_steps(learner.qnet.state_encoder, [short, long], kind="loss")
    assert counts["loss"] == (1 if packed else 2)
    real = sum(len(s) for s in short + long)
    if packed:
        assert learner.stats.padded_tokens == real
    else:  # each step padded to its own longest only (widths rounded up to 8)
        width = lambda seqs: -(-max(len(s) for s in seqs) // 8) * 8  # noqa: E731
        assert learner.stats.padded_tokens == len(short) * width(short) + len(long) * width(long)
    with torch.no_grad():
        alone = torch.cat([learner._encode(learner.qnet.state_encoder, [s], False, "check") for s in short + long])
    assert torch.allclose(vectors, alone, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_padded_passes_take_their_own_token_budget(tiny_encoder, monkeypatch, packed):
    """learner.padded_tokens bounds the padded passes' batches and learner.encode_tokens the packed
    ones': a preset's wide packed budget (configs/hotpot.yaml) must not widen the padded batches of
    an encoder that cannot pack, which a GPU does not cut by length. Planted bug caught: the padded
    passes given encode_tokens (their batches as wide as the packed budget)."""
    import qrag.rl.learner as learner_mod

    budgets: list[tuple[str, int]] = []
    for name in ("encode", "encode_packed"):  # the learner's own imports of the two passes
        real = getattr(learner_mod, name)

        def spy(*args, _real=real, _name=name, **kw):
            budgets.append((_name, kw["max_tokens"]))
            return _real(*args, **kw)

        monkeypatch.setattr(learner_mod, name, spy)
    learner, tok, layout = _learner(tiny_encoder, packed=packed, encode_tokens=131072, padded_tokens=64)
    learner.train_update(_episodes(tok, layout))
    wanted = ("encode_packed", 131072) if packed else ("encode", 64)
    assert budgets and set(budgets) == {wanted}
