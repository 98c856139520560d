"""The graphed scoring step (qrag.index.score_graphs): padded to a batch bucket, fed through its
input buffers, replayed, its results cut back to the real rows. CUDA graphs need a GPU, so the
recorder is replaced by an eager one that re-runs the recorded step on every replay: it reads
the same input buffers a graph would, so a replay that forgot to refresh them, a padded row
that leaked, or a stale entry for a replaced shard all show as wrong hits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qrag.index.score_graphs import ScoreGraphs, pack, unpack
from qrag.index.shards import selected_matrix
from test_shard_batch import D, make_shards


class EagerGraph:
    def __init__(self, step):
        self.step = step
        self.outputs = step()

    def replay(self) -> None:
        _, packed = self.step()
        self.outputs[1].copy_(packed)  # a graph writes its results into the same memory


def eager_record(self, step, device):
    graph = EagerGraph(step)
    return graph, graph.outputs


@pytest.fixture
def graphs(monkeypatch):
    monkeypatch.setattr(ScoreGraphs, "_record", eager_record)
    return ScoreGraphs(batch_buckets=(1, 4, 8))


def reference(shards, states, selected, n_total, k):
    sel = torch.from_numpy(selected_matrix(selected, n_total))
    out = []
    for s in shards:
        q, i, pos = s.best_chunks_on_device(torch.from_numpy(states), sel, n_total, k)
        out.append((q.numpy(), i.numpy(), None if pos is None else pos.numpy()))
    return out


def assert_same(got, want):
    assert len(got) == len(want)
    for (q, i, pos), (wq, wi, wpos) in zip(got, want):
        np.testing.assert_array_equal(q, wq)
        np.testing.assert_array_equal(i, wi)
        assert (pos is None) == (wpos is None)
        if pos is not None:
            np.testing.assert_array_equal(pos, wpos)


@pytest.mark.parametrize("positions", ["none", "relative"])
def test_replays_answer_like_the_eager_step_for_every_batch_size(graphs, positions):
    shards = [s for s in make_shards(positions) if s.n]
    rng = np.random.default_rng(0)
    n_total, k = 30, 3
    for rows in (1, 3, 3, 2, 5, 1, 3):  # buckets 1, 4, 4 (a replay), 4, 8, 1 (a replay), 4
        states = rng.standard_normal((rows, D)).astype(np.float32)
        selected = [sorted(rng.choice(n_total, size=2, replace=False).tolist()) for _ in range(rows)]
        got = graphs.replay_best_chunks(
            shards, torch.from_numpy(states), selected_matrix(selected, n_total), n_total, k
        )
        assert_same(got, reference(shards, states, selected, n_total, k))
        assert all(q.shape == (rows, k) for q, _, _ in got)  # padded rows cut off
    assert graphs.captures == 3 and graphs.replays == 4  # buckets 1, 4 and 8, each captured once


def test_more_rows_than_the_largest_bucket_and_a_failed_capture_fall_back(graphs, monkeypatch):
    shards = [s for s in make_shards("relative") if s.n]
    states = torch.zeros(9, D)
    assert graphs.replay_best_chunks(shards, states, selected_matrix([[]] * 9, 30), 30, 2) is None

    def broken(self, step, device):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(ScoreGraphs, "_record", broken)
    assert graphs.replay_best_chunks(shards, torch.zeros(2, D), selected_matrix([[]] * 2, 30), 30, 2) is None
    assert any("capturing" in why for why in graphs.failures.values())
    monkeypatch.setattr(ScoreGraphs, "_record", eager_record)
    assert (
        graphs.replay_best_chunks(shards, torch.zeros(2, D), selected_matrix([[]] * 2, 30), 30, 2) is None
    )  # not retried


def test_a_replaced_shard_is_captured_again(graphs):
    states = np.random.default_rng(2).standard_normal((2, D)).astype(np.float32)
    sel = selected_matrix([[1], [2]], 30)
    first = [s for s in make_shards("relative", seed=0) if s.n]
    graphs.replay_best_chunks(first, torch.from_numpy(states), sel, 30, 2)
    entry_key = next(iter(graphs._captured))
    second = [s for s in make_shards("relative", seed=5) if s.n]
    # The same ids, pointers and sizes as the first shards: only the weak references tell them apart.
    graphs._captured[
        tuple([tuple((id(s), s.rows_within(30), s.vectors.data_ptr()) for s in second), *entry_key[1:]])
    ] = graphs._captured[entry_key]
    got = graphs.replay_best_chunks(second, torch.from_numpy(states), sel, 30, 2)
    assert_same(got, reference(second, states, [[1], [2]], 30, 2))
    assert graphs.captures == 2


def test_pack_and_unpack_keep_every_dtype_bit_for_bit():
    tensors = [
        torch.tensor([[1.5, -np.inf]], dtype=torch.float32),
        torch.tensor([3, -1], dtype=torch.int64),
        torch.tensor([0.25], dtype=torch.float64),
        torch.tensor([[True, False]]),
    ]
    got = unpack(pack(tensors).numpy(), [(t.dtype, tuple(t.shape)) for t in tensors])
    for g, t in zip(got, tensors):
        np.testing.assert_array_equal(g, t.numpy())
        assert g.dtype == t.numpy().dtype and g.flags.writeable


def test_serve_config_reaches_the_shard_options():
    """`score_graphs: false` in serve/config.yaml's args turns the graphed step off for every shard."""
    from qrag.config import from_dict
    from qrag.serving.service_config import ServeConfig

    assert ServeConfig().shard_options().graphs is True
    options = from_dict(ServeConfig, {"score_graphs": False, "faiss": "never", "approx_above": 7}).shard_options()
    assert (options.graphs, options.faiss, options.approx_above) == (False, "never", 7)
