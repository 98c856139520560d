"""Padding-free encoder passes (qrag.model.packed) compute what the padded forward computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qrag.model.encoder import encode, load_encoder, set_dropout
from qrag.model.packed import (
    Packing,
    encode_packed,
    pack_bounds,
    packed_hidden,
    packed_mean_pool,
    packing_unsupported,
)

CPU = torch.device("cpu")


def _seqs(rng: np.random.Generator, n: int, vocab: int = 1000, longest: int = 40) -> list[np.ndarray]:
    lengths = rng.integers(1, longest, size=n)
    lengths[0] = longest  # one sequence at the full width, the others padded in a padded batch
    return [rng.integers(5, vocab, size=int(k)).astype(np.int64) for k in lengths]


@pytest.fixture(scope="module")
def tiny(tiny_encoder):
    model = load_encoder(tiny_encoder)
    model.eval()
    return model


def test_packed_vectors_equal_the_padded_forward(tiny):
    seqs = _seqs(np.random.default_rng(0), 13)
    padded = encode(tiny, seqs, pad_id=0, device=CPU)
    # A small token budget splits the sequences over several packs, in input order.
    packed = encode_packed(tiny, seqs, device=CPU, max_tokens=64)
    assert packed.shape == padded.shape
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-4)


def test_packed_gradients_equal_the_padded_forward(tiny):
    seqs = _seqs(np.random.default_rng(1), 7)
    grads = []
    for run in (
        lambda: encode(tiny, seqs, pad_id=0, device=CPU, grad=True),
        lambda: encode_packed(tiny, seqs, device=CPU, grad=True),
    ):
        tiny.zero_grad(set_to_none=True)
        (run() ** 2).sum().backward()
        grads.append({n: p.grad.clone() for n, p in tiny.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_sequence_does_not_see_its_neighbours(tiny):
    """Attention stays within a sequence: a neighbour's tokens change nothing of its vector."""
    rng = np.random.default_rng(2)
    target = rng.integers(5, 1000, size=9)
    alone = encode_packed(tiny, [target], device=CPU)[0]
    for neighbours in ([rng.integers(5, 1000, size=30)], [rng.integers(5, 1000, size=3)] * 4):
        together = encode_packed(tiny, [*neighbours, target], device=CPU)[-1]
        torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-4)


def test_dropout_runs_in_train_mode_and_not_in_eval(tiny_encoder):
    model = load_encoder(tiny_encoder)
    set_dropout(model, 0.3)
    seqs = _seqs(np.random.default_rng(3), 5)
    model.train()
    torch.manual_seed(0)
    a = encode_packed(model, seqs, device=CPU, grad=True)
    b = encode_packed(model, seqs, device=CPU, grad=True)
    assert not torch.allclose(a, b)
    model.eval()
    torch.testing.assert_close(
        encode_packed(model, seqs, device=CPU), encode(model, seqs, pad_id=0, device=CPU), atol=1e-5, rtol=1e-4
    )


def test_packing_layout():
    packing = Packing.of(np.arange(6), np.array([2, 3, 1]), CPU)
    assert packing.positions.tolist() == [0, 1, 0, 1, 2, 0]
    assert packing.segments.tolist() == [0, 0, 1, 1, 1, 2]
    assert packing.cu_seqlens.tolist() == [0, 2, 5, 6] and packing.cu_seqlens.dtype == torch.int32
    assert packing.max_len == 3 and packing.count == 3
    pooled = packed_mean_pool(torch.arange(12, dtype=torch.float32).reshape(6, 2), packing)
    assert pooled.tolist() == [[1.0, 2.0], [6.0, 7.0], [10.0, 11.0]]


def test_pack_bounds_keep_the_budget_and_the_order():
    assert pack_bounds(np.array([3, 3, 3, 10, 1]), 6) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert pack_bounds(np.array([2, 2]), 100) == [(0, 2)]
    assert pack_bounds(np.array([], dtype=np.int64), 8) == []


def test_architectures_that_cannot_pack_say_why(tiny, tiny_mpnet):
    assert packing_unsupported(tiny) is None
    reason = packing_unsupported(load_encoder(tiny_mpnet))
    assert reason is not None and "mpnet" in reason


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention needs a GPU")
def test_flash_packed_pass_matches_the_padded_one_on_a_gpu(tiny_encoder):
    gpu = torch.device("cuda", torch.cuda.current_device())
    model = load_encoder(tiny_encoder).to(gpu).eval()
    seqs = _seqs(np.random.default_rng(4), 33, longest=200)
    padded = encode(model, seqs, pad_id=0, device=gpu, grad=True)
    packed = encode_packed(model, seqs, device=gpu, grad=True)
    rel = (packed - padded).norm() / padded.norm()
    assert rel < 2e-2, rel  # bf16 autocast on both sides
    grads = []
    for out in (padded, packed):
        model.zero_grad(set_to_none=True)
        (out**2).sum().backward(retain_graph=True)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert (grads[1] - grads[0]).norm() / grads[0].norm() < 5e-2
    # and the hidden states come from flash's kernel, not the padded fallback
    packing = Packing.of(np.concatenate(seqs[:4]), np.array([len(s) for s in seqs[:4]]), gpu)
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.profiler.profile() as prof:
        packed_hidden(model, packing)
    assert any("flash" in e.key.lower() for e in prof.key_averages())


@pytest.mark.parametrize("objective", ["pqn", "sft"])
def test_a_packed_learner_takes_the_padded_learners_step(tiny_encoder, objective):
    """learner.packed changes how the passes run, not the update: same loss, same weights after."""
    from test_learner import _episodes, _learner

    from qrag.model.encoder import HostCopy

    def first_available(q, available):
        """A policy that float rounding cannot change: the first available chunk (the sampled one
        flips between two near-equal Q values on a rounding difference, and the loss with it)."""
        idx = torch.argsort((~available).to(torch.int8), dim=1, stable=True)[:, :1]
        return HostCopy.start(q.gather(1, idx).float(), idx)

    runs = []
    for packed in (False, True):
        learner, tok, layout = _learner(tiny_encoder, objective=objective, packed=packed)
        assert learner.packed is packed and learner.unpacked_reason is None
        learner.policy_top_k = first_available
        metrics = learner.train_update(_episodes(tok, layout))
        runs.append((metrics, [p.detach().clone() for p in learner.qnet.online_parameters()]))
    (padded, padded_weights), (packed, packed_weights) = runs
    assert packed.loss == pytest.approx(padded.loss, rel=1e-4, abs=1e-6)
    assert packed.encoder_padded_tokens == packed.encoder_tokens < padded.encoder_padded_tokens
    for a, b in zip(padded_weights, packed_weights):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_a_learner_on_an_encoder_that_cannot_pack_keeps_the_padded_passes(tiny_mpnet):
    from test_learner import _learner

    learner, _, _ = _learner(tiny_mpnet, packed=True)
    assert learner.packed is False and "mpnet" in learner.unpacked_reason
    default, _, _ = _learner(tiny_mpnet)  # null = on a GPU only: nothing to explain on the CPU
    assert default.packed is False and default.unpacked_reason is None


def test_bf16_copies_follow_every_update_and_act_like_the_fp32_encoders(tiny_encoder):
    """learner.bf16_copies: the passes without gradients run from bf16 copies, refreshed from the
    weights the last update left (a stale copy would act with old weights)."""
    from test_learner import _episodes, _learner

    learner, tok, layout = _learner(tiny_encoder, packed=True, bf16_copies=True)
    episodes = _episodes(tok, layout)
    for _ in range(2):
        learner.train_update(episodes)
    assert learner.bf16 is not None and len(learner.bf16._copies) >= 3  # online chunks + states, targets
    learner.bf16.refresh()
    encoders = (learner.qnet.state_encoder, learner.qnet.action_encoder, *learner.qnet.target_encoders())
    for module in encoders:
        twin = learner.bf16.of(module)
        assert all(t.dtype == torch.bfloat16 for t in twin.parameters())
        for t, s in zip(twin.parameters(), module.parameters()):
            torch.testing.assert_close(t, s.detach().to(torch.bfloat16), atol=0, rtol=0)
    seqs = [c for e in episodes for c in e.chunks]
    low = learner._embed(learner.qnet.action_encoder, seqs, kind="chunks")
    learner.bf16 = None
    full = learner._embed(learner.qnet.action_encoder, seqs, kind="chunks")
    assert ((low - full).norm() / full.norm()) < 3e-2


def test_bf16_copies_are_refreshed_at_the_start_of_each_update(tiny_encoder):
    from test_learner import _episodes, _learner

    learner, tok, layout = _learner(tiny_encoder, packed=True, bf16_copies=True)
    episodes = _episodes(tok, layout)
    learner.train_update(episodes)  # makes the copies from the initial weights
    twin = learner.bf16.of(learner.qnet.action_encoder)
    before = [t.clone() for t in twin.parameters()]
    learner.train_update(episodes)  # refreshes them from the first update's weights first
    assert any(not torch.equal(a, b) for a, b in zip(before, twin.parameters()))
