"""The GPU shard scorer (relative_scores, compiled there) is the blocked eager rule, written once more."""

import numpy as np
import torch

from qrag.config import ModelConfig
from qrag.index import shards as shards_mod
from qrag.index.shards import ShardIndex, ShardOptions, positions_at, relative_scores
from qrag.model.positions import rope_frequencies
from qrag.retrieval.scoring import score_chunks


def test_relative_scores_equal_positions_then_score_chunks_with_the_selected_excluded():
    torch.manual_seed(0)
    d, n, n_total, shard, n_shards = 16, 37, 150, 1, 4
    states = torch.randn(3, d)
    vectors = torch.randn(n, d)
    gpos = shard + n_shards * torch.arange(n)
    sel = torch.tensor([[5, 21, 150], [9, 150, 150], [150, 150, 150]])  # padded with n_total
    got = relative_scores(states, vectors, gpos, sel, n_total, 10.0, 9.0, rope_frequencies(d, 10000.0))
    pos = positions_at("relative", gpos, sel, n_total, 10.0, 9.0)
    want = score_chunks(states, vectors, pos, 10000.0, block=7)
    want[0, (21 - shard) // n_shards] = float("-inf")  # 21 = shard 1, row 5; 5 and 9 live in shard 1 too
    want[0, (5 - shard) // n_shards] = float("-inf")
    want[1, (9 - shard) // n_shards] = float("-inf")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


class _Seg:
    def __init__(self, positions, vectors):
        self.positions, self.vectors = positions, vectors
        self.batch = 0
        self.doc_ids = [f"d{i}" for i in range(len(positions))]
        self.texts = [f"t{i}" for i in range(len(positions))]
        self.tokens = [np.array([1, 2], dtype=np.int64) for _ in positions]


def test_fused_best_chunks_gives_the_blocked_paths_hits(monkeypatch):
    rng = np.random.default_rng(1)
    d, n_shards, shard, rows = 16, 2, 0, 40
    cfg = ModelConfig(encoder="unused", positions="relative")
    index = ShardIndex("c", shard, n_shards, cfg, d, torch.device("cpu"), ShardOptions(faiss="never", score_block=64))
    index.add(_Seg(shard + n_shards * np.arange(rows), rng.standard_normal((rows, d)).astype(np.float32)))
    states = torch.from_numpy(rng.standard_normal((2, d)).astype(np.float32))
    selected, n_total = [[4, 11], []], 2 * rows
    mine = [[g // n_shards for g in s if g % n_shards == shard] for s in selected]
    blocked = index._exact_best_chunks(states, selected, mine, rows, n_total, 5)  # CPU: the blocked eager path
    monkeypatch.setitem(shards_mod._FUSED, "fn", relative_scores)  # the compiled function's source, eagerly
    fused = index._fused_best_chunks(states, selected, index.vectors, rows, n_total, 5)
    for a, b in zip(blocked, fused):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_the_compiled_scorer_may_keep_a_variant_per_device_and_shape(monkeypatch):
    """Shards on 2 GPUs at 100M tokens ran out of dynamo's default 8 compiled variants of
    relative_scores (each device is its own guard) and the rest ran eagerly."""
    import torch._dynamo.config as dynamo_config

    import qrag.index.shards as shards_mod

    monkeypatch.setattr(dynamo_config, "recompile_limit", 8)
    monkeypatch.setattr(shards_mod, "_FUSED", {})
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic=None: fn)  # compiling itself is not under test
    assert shards_mod._fused() is shards_mod.relative_scores
    assert dynamo_config.recompile_limit >= 2 * 8
