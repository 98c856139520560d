"""Packed passes replayed from CUDA graphs (qrag.model.packed_graphs): a bucketed batch computes
each real sequence's vector as the unpadded pass does, and a replay follows the weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qrag.model.encoder import load_encoder
from qrag.model.packed import encode_packed, packed_hidden, packed_mean_pool
from qrag.model.packed_graphs import PackedGraphs, packed_shape, packing_from_inputs, padded_inputs

CPU = torch.device("cpu")
GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _seqs(seed: int, n: int, longest: int = 60) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 1000, size=int(k)).astype(np.int64) for k in rng.integers(1, longest, size=n)]


def _lengths(seqs) -> np.ndarray:
    return np.array([len(s) for s in seqs], dtype=np.int64)


@pytest.fixture(scope="module")
def tiny(tiny_encoder):
    return load_encoder(tiny_encoder).eval()


def test_a_bucketed_batch_gives_each_real_sequence_its_unpadded_vector(tiny):
    seqs = _seqs(0, 11)
    lengths = _lengths(seqs)
    shape = packed_shape(lengths, max_tokens=2048, length_limit=512)
    inputs = torch.from_numpy(padded_inputs(np.concatenate(seqs), lengths, shape, pad_id=0))
    packing = packing_from_inputs(inputs, shape)
    with torch.no_grad():
        bucketed = packed_mean_pool(packed_hidden(tiny, packing), packing)
        unpadded = encode_packed(tiny, seqs, device=CPU)
    assert bucketed.shape[0] == shape.sequences > len(seqs)
    torch.testing.assert_close(bucketed[: len(seqs)], unpadded, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("n, longest", [(1, 2), (11, 60), (250, 220), (40, 500)])
def test_bucketed_inputs_cover_every_token_with_short_enough_sequences(n, longest):
    lengths = _lengths(_seqs(n, n, longest))
    max_tokens = 32768
    shape = packed_shape(lengths, max_tokens, length_limit=512)
    assert shape.tokens >= lengths.sum() and shape.tokens % (max_tokens // 32) == 0
    assert shape.tokens - lengths.sum() < max_tokens // 32  # at most one step of fillers
    assert shape.length >= lengths.max() and shape.sequences & (shape.sequences - 1) == 0
    inputs = padded_inputs(np.zeros(int(lengths.sum()), np.int64), lengths, shape, pad_id=0)
    t = shape.tokens
    positions, segments, offsets = inputs[t : 2 * t], inputs[2 * t : 3 * t], inputs[3 * t :]
    assert len(offsets) == shape.sequences + 1 and offsets[0] == 0 and offsets[-1] == t
    sizes = np.diff(offsets)
    assert (sizes >= 0).all() and sizes.max() <= shape.length  # the flash grid's length holds them all
    assert (sizes[:n] == lengths).all()
    assert (positions < shape.length).all() and (np.bincount(segments, minlength=shape.sequences) == sizes).all()


def test_batches_past_the_largest_bucket_have_no_shape():
    assert packed_shape(np.array([600]), 32768, length_limit=512) is None  # longer than the encoder
    assert packed_shape(np.array([300] * 200), 32768, length_limit=512) is None  # more than the budget


@GPU_ONLY
def test_replayed_passes_equal_the_eager_ones_and_follow_the_weights(tiny_encoder):
    gpu = torch.device("cuda", torch.cuda.current_device())
    model = load_encoder(tiny_encoder).to(gpu).to(torch.bfloat16).eval()
    graphs = PackedGraphs(gpu, max_tokens=4096, pad_id=0)
    first, second = _seqs(1, 30), _seqs(2, 29)

    def replayed(seqs):
        return encode_packed(model, seqs, device=gpu, max_tokens=4096, autocast=False, replay=graphs.pool)

    def eager(seqs):
        return encode_packed(model, seqs, device=gpu, max_tokens=4096, autocast=False)

    a, b = replayed(first), replayed(second)
    assert graphs.replays == 2 and not graphs.fallbacks
    if packed_shape(_lengths(first), 4096, 512) == packed_shape(_lengths(second), 4096, 512):
        assert graphs.captured_shapes == 1  # the second batch replayed the first's graph
    torch.testing.assert_close(a, eager(first), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(b, eager(second), atol=2e-2, rtol=2e-2)  # a kept its own vectors
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # in place, as the learner's refresh of its copies
    moved = replayed(first)
    torch.testing.assert_close(moved, eager(first), atol=2e-2, rtol=2e-2)
    assert not torch.allclose(moved, a, atol=1e-3)


@GPU_ONLY
def test_a_learner_with_packed_graphs_takes_the_eager_learners_step(tiny_encoder):
    from test_learner import _episodes, _learner

    from qrag.model.encoder import HostCopy

    def first_available(q, available):
        idx = torch.argsort((~available).to(torch.int8), dim=1, stable=True)[:, :1]
        return HostCopy.start(q.gather(1, idx).float(), idx)

    runs = []
    for graphs in (False, True):
        learner, tok, layout = _learner(tiny_encoder, packed=True, bf16_copies=True, graphs=graphs, device="cuda")
        assert (learner.packed_graphs is not None) is graphs
        learner.policy_top_k = first_available
        metrics = [learner.train_update(_episodes(tok, layout)) for _ in range(2)]
        runs.append(metrics)
    assert learner.packed_graphs.replays > 0 and not learner.packed_graphs.fallbacks
    for eager_m, graphed_m in zip(*runs):
        assert graphed_m.loss == pytest.approx(eager_m.loss, rel=2e-2, abs=1e-4)


def test_no_packed_graphs_on_the_cpu(tiny_encoder):
    from test_learner import _learner

    learner, _, _ = _learner(tiny_encoder, packed=True, graphs=True)
    assert learner.packed and learner.packed_graphs is None
