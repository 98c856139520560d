"""The batched shard scorer (score_shards: every torch shard of a device in one pass, one copy to
the host) answers exactly what each shard's own best_chunks answers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qrag.config import ModelConfig
from qrag.index import shards as shards_mod
from qrag.index.local import ShardsBackend
from qrag.index.shards import ShardIndex, ShardOptions, relative_scores, score_shards

D, N_SHARDS = 16, 4
SIZES = (9, 9, 0, 9)  # rows loaded per shard: shard 2 is empty


class _Seg:
    def __init__(self, positions: np.ndarray, vectors: np.ndarray):
        self.positions, self.vectors, self.batch = positions, vectors, 0
        self.doc_ids = [f"d{p}" for p in positions]
        self.texts = [f"t{p}" for p in positions]
        self.tokens = [np.array([1, int(p)], dtype=np.int32) for p in positions]


def make_shards(positions: str, batched: bool = True, seed: int = 0) -> list[ShardIndex]:
    rng = np.random.default_rng(seed)
    cfg = ModelConfig(encoder="unused", positions=positions)
    options = ShardOptions(faiss="never", score_block=40, batched=batched)  # small blocks: several per shard
    out = []
    for shard, rows in enumerate(SIZES):
        index = ShardIndex("c", shard, N_SHARDS, cfg, D, torch.device("cpu"), options)
        if rows:
            index.add(_Seg(shard + N_SHARDS * np.arange(rows), rng.standard_normal((rows, D)).astype(np.float32)))
        out.append(index)
    return out


# Selected sets of different lengths per row (unsorted: the scorers sort them); row 3 holds every
# chunk of shard 1 among the first 22 global positions: shard 1 has no finite score left for it.
SELECTED = [[], [6], [20, 0, 13], [1, 5, 9, 13, 17, 21, 2], [3, 4, 7, 8, 10, 11, 12]]


def selected_below(n_total: int) -> list[list[int]]:
    return [[g for g in row if g < n_total] for row in SELECTED]


def assert_same_hits(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.q.dtype == b.q.dtype and a.ids.dtype == b.ids.dtype
        np.testing.assert_array_equal(a.q, b.q)  # bit for bit: same picks, same Q, -inf alike
        np.testing.assert_array_equal(a.ids, b.ids)
        assert (a.pos is None) == (b.pos is None)
        if a.pos is not None:
            np.testing.assert_array_equal(a.pos, b.pos)
        assert a.records.keys() == b.records.keys()
        for g in a.records:
            assert a.records[g].doc_id == b.records[g].doc_id


@pytest.mark.parametrize("positions", ["none", "absolute", "relative"])
@pytest.mark.parametrize("k", [2, 5, 50])  # 50: more than any shard's rows
@pytest.mark.parametrize(
    "n_total", [22, 19, 2]
)  # fewer than loaded: shards answer from their first rows; 2: shard 3 empty too
def test_batched_scoring_gives_the_per_shard_hits(positions, k, n_total):
    shards = make_shards(positions)
    selected = selected_below(n_total)
    states = np.random.default_rng(1).standard_normal((len(selected), D)).astype(np.float32)
    want = [s.best_chunks(states, selected, n_total, k) for s in shards]
    got = score_shards(shards, states, selected, n_total, k)
    assert_same_hits(got, want)
    assert got[2].q.shape == (len(selected), 0)  # the empty shard
    if n_total == 22:  # row 3 excluded every chunk of shard 1: -1 ids, -inf Q
        assert got[1].q.shape[1] == min(k, 6)
        assert (got[1].ids[3] == -1).all() and np.isneginf(got[1].q[3]).all()
        assert (got[0].ids[3] >= 0).all()
    for r, row in enumerate(selected):
        assert not set(row) & {int(g) for h in got for g in h.ids[r]}


def test_batched_fused_scoring_gives_the_per_shard_hits(monkeypatch):
    """The compiled scorer's path (GPU only) run eagerly on the CPU, batched and per shard."""
    monkeypatch.setattr(ShardIndex, "_wants_fused", lambda self: True)
    monkeypatch.setitem(shards_mod._FUSED, "fn", relative_scores)
    shards = make_shards("relative")
    states = torch.from_numpy(np.random.default_rng(2).standard_normal((len(SELECTED), D)).astype(np.float32))
    want = [s.best_chunks(states, selected_below(22), 22, 4) for s in shards]
    assert_same_hits(score_shards(shards, states, selected_below(22), 22, 4), want)


def test_batched_off_keeps_the_per_shard_path(monkeypatch):
    calls = []
    monkeypatch.setattr(ShardIndex, "best_chunks_on_device", lambda self, *a: calls.append(self.shard))
    shards = make_shards("relative", batched=False)
    states = np.random.default_rng(3).standard_normal((2, D)).astype(np.float32)
    score_shards(shards, states, selected_below(22)[:2], 22, 3)
    assert calls == []


def test_one_copy_to_the_host_per_step_for_all_shards(monkeypatch):
    """Every host copy or read of a tensor goes through .cpu()/.item()/.tolist(): the batched path
    makes one for the four shards, the per-shard path several per shard."""
    counts = {"cpu": 0, "item": 0, "tolist": 0}
    for name in counts:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _original=original, **kw):
            counts[_name] += 1
            return _original(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    shards = make_shards("relative")
    states = np.random.default_rng(4).standard_normal((len(SELECTED), D)).astype(np.float32)
    backend = ShardsBackend(shards, 22)
    backend.score(states, list(range(len(SELECTED))), selected_below(22), 3)
    assert counts == {"cpu": 1, "item": 0, "tolist": 0}
    counts.update(cpu=0)
    [s.best_chunks(states, selected_below(22), 22, 3) for s in shards]
    assert counts["cpu"] >= 2 * 3  # three scored shards, top Q, rows and positions copied apart
