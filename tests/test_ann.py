"""The approximate candidate stage (qrag.index.ann): candidates from FAISS at rotated probes, scored
exactly; what it returns equals the exact path's values for the chunks it returns."""

import numpy as np
import pytest
import torch

pytest.importorskip("faiss")

from qrag.config import ModelConfig  # noqa: E402
from qrag.index.ann import AnnSettings, probe_positions  # noqa: E402
from qrag.index.shards import ShardIndex, ShardOptions, score_shards  # noqa: E402
from qrag.index.store import Segment  # noqa: E402
from qrag.retrieval.hits import merge_hits  # noqa: E402
from qrag.serving.service_config import ServeConfig  # noqa: E402


def shard_of(vectors: np.ndarray, model: ModelConfig, options: ShardOptions, shard: int = 0, n_shards: int = 1):
    """Shard ``shard`` of ``n_shards`` holding ``vectors`` as its rows (global g = shard + n_shards * row)."""
    index = ShardIndex("c", shard, n_shards, model, vectors.shape[1], torch.device("cpu"), options)
    append(index, vectors)
    return index


def append(index: ShardIndex, vectors: np.ndarray) -> None:
    m, empty = len(vectors), np.zeros(0, np.int64)
    positions = index.shard + index.n_shards * np.arange(index.n, index.n + m)
    index.add(Segment(1 + index.n, positions.astype(np.int64), vectors, [empty] * m, ["d"] * m, [""] * m))


def exact(**kw) -> ShardOptions:
    return ShardOptions(ann="never", faiss="never", **kw)


def approximate(**settings) -> ShardOptions:
    return ShardOptions(ann="always", faiss="never", ann_settings=AnnSettings(**settings))


def recall(want, got, k: int) -> float:
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(want.ids, got.ids)]))


@pytest.mark.parametrize("positions", ["none", "relative"])
def test_with_every_chunk_a_candidate_the_answer_is_the_exact_one(positions):
    rng = np.random.default_rng(0)
    n, d, k = 120, 16, 5
    vectors = rng.standard_normal((n, d)).astype(np.float32)
    model = ModelConfig(positions=positions, rope_base=10.0)
    states = rng.standard_normal((4, d)).astype(np.float32)
    reference = shard_of(vectors, model, exact())
    best = reference.best_chunks(states, [[]] * 4, n, 3).ids  # selected sets that hold the best chunks
    selected = [sorted(best[0].tolist()), [], [int(best[2, 0])], [119, 5]]
    want = reference.best_chunks(states, selected, n, k)
    got = shard_of(vectors, model, approximate(kind="flat", probes=2, candidates=n)).best_chunks(states, selected, n, k)
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_allclose(got.q, want.q, atol=1e-5)
    if positions == "relative":
        np.testing.assert_allclose(got.pos, want.pos, atol=1e-6)
    for row, sel in zip(got.ids, selected):
        assert not set(row) & set(sel), "a selected chunk came back"
    assert len(set(got.ids[1])) == k, "a chunk came back twice"


def test_probes_rotated_back_find_the_rotated_top_k():
    """Few candidates per probe: only a state rotated back by each probe's position (not forward,
    not unrotated) reaches the chunks that score best at their positions."""
    rng = np.random.default_rng(0)
    n, d, k = 3000, 32, 4
    vectors = rng.standard_normal((n, d)).astype(np.float32)
    model = ModelConfig(positions="relative", rope_base=10.0)  # fast rotation: positions matter
    states = rng.standard_normal((64, d)).astype(np.float32)
    selected = [sorted(rng.choice(n, 2, replace=False).tolist()) for _ in range(64)]
    want = shard_of(vectors, model, exact()).best_chunks(states, selected, n, k)
    got = shard_of(vectors, model, approximate(kind="flat", probes=16, candidates=k)).best_chunks(
        states, selected, n, k
    )
    one_probe = shard_of(vectors, ModelConfig(positions="none"), approximate(kind="flat", candidates=3 * k))
    unrotated = one_probe.best_chunks(states, selected, n, k)
    assert recall(want, got, k) >= 0.85
    assert recall(want, unrotated, k) < 0.6  # the plain inner-product search misses them


@pytest.mark.parametrize("kind", ["ivf_flat", "ivf_pq"])
def test_inverted_file_candidates_keep_most_of_the_exact_top_k(kind):
    rng = np.random.default_rng(1)
    n, d, k = 6000, 32, 8
    centres = rng.standard_normal((60, d))
    vectors = centres[rng.integers(0, 60, n)] + 0.4 * rng.standard_normal((n, d))
    vectors = (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)
    states = (centres[rng.integers(0, 60, 16)] + 0.4 * rng.standard_normal((16, d))).astype(np.float32)
    selected = [sorted(rng.choice(n, 3, replace=False).tolist()) for _ in range(16)]
    model = ModelConfig(positions="relative")
    want = shard_of(vectors, model, exact()).best_chunks(states, selected, n, k)
    ann = shard_of(vectors, model, approximate(kind=kind, nlist=64, nprobe=16, pq_bytes=8, probes=4))
    got = ann.best_chunks(states, selected, n, k)
    assert recall(want, got, k) >= 0.9
    assert ann.ann is not None and ann.ann.rows == n


def test_appended_rows_reach_the_candidates():
    rng = np.random.default_rng(2)
    d = 16
    model = ModelConfig(positions="relative")
    index = shard_of(rng.standard_normal((200, d)).astype(np.float32), model, approximate(kind="ivf_flat", nlist=4))
    states = rng.standard_normal((1, d)).astype(np.float32)
    index.best_chunks(states, [[]], 200, 3)  # builds the index over 200 rows
    append(index, np.repeat(10 * states, 2, axis=0))  # rows 200, 201: far the best for this state
    got = index.best_chunks(states, [[]], 202, 2)
    assert index.ann.rows == 202
    assert sorted(got.ids[0]) == [200, 201]


def test_a_shard_beyond_the_budget_answers_approximately_beside_exact_ones():
    rng = np.random.default_rng(3)
    n_shards, rows, d, k = 2, 150, 16, 6
    model = ModelConfig(positions="relative", rope_base=10.0)
    table = rng.standard_normal((n_shards * rows, d)).astype(np.float32)
    small = shard_of(table[0::2], model, exact(), 0, n_shards)
    large = shard_of(
        table[1::2],
        model,
        ShardOptions(faiss="never", ann_above=rows - 1, ann_settings=AnnSettings(kind="flat", candidates=rows)),
        1,
        n_shards,
    )
    assert large.uses_ann and not small.uses_ann
    reference = [shard_of(table[s::2], model, exact(), s, n_shards) for s in range(n_shards)]
    states = rng.standard_normal((3, d)).astype(np.float32)
    selected = [[1, 10], [], [299]]
    got = merge_hits(score_shards([small, large], states, selected, n_shards * rows, k), k)
    want = merge_hits(score_shards(reference, states, selected, n_shards * rows, k), k)
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_allclose(got.q, want.q, atol=1e-5)


def test_absolute_positions_and_small_shards_stay_exact():
    vectors = np.eye(8, dtype=np.float32)
    assert not shard_of(vectors, ModelConfig(positions="absolute"), ShardOptions(ann="always")).uses_ann
    assert not shard_of(vectors, ModelConfig(positions="relative"), ShardOptions()).uses_ann  # under ann_above
    with pytest.raises(ValueError, match="absolute"):
        probe_positions(1, ModelConfig(positions="absolute"), 4)


def test_probe_positions_cover_every_segment():
    model = ModelConfig(positions="relative", relative_delta=10.0, relative_ell=9.0)
    pos = probe_positions(2, model, 3)
    np.testing.assert_allclose(pos, [1.5, 4.5, 7.5, 11.5, 14.5, 17.5, 21.5, 24.5, 27.5])


def test_serve_config_builds_and_checks_the_candidate_stage():
    options = ServeConfig(ann="always", ann_index="ivf_flat", ann_nprobe=4, ann_probes=2).shard_options()
    assert options.ann == "always"
    assert (options.ann_settings.kind, options.ann_settings.nprobe, options.ann_settings.probes) == ("ivf_flat", 4, 2)
    with pytest.raises(ValueError, match="ann_probes"):
        ServeConfig(ann_probes=0).shard_options()


def saved_shard(vectors, folder, sha="sha-1", uid="u") -> ShardIndex:
    index = ShardIndex("c", 0, 1, ModelConfig(positions="relative"), vectors.shape[1], torch.device("cpu"))
    index.options = approximate(kind="ivf_flat", nlist=4)
    index.faiss_folder, index.uid = folder, uid
    m, empty = len(vectors), np.zeros(0, np.int64)
    index.add(Segment(1, np.arange(m, dtype=np.int64), vectors, [empty] * m, ["d"] * m, [""] * m), sha)
    return index


def test_a_built_candidate_index_is_saved_and_loaded_by_the_next_replica(tmp_path, monkeypatch):
    import qrag.index.ann as ann_mod

    rng = np.random.default_rng(4)
    vectors = rng.standard_normal((400, 16)).astype(np.float32)
    states = rng.standard_normal((2, 16)).astype(np.float32)
    first = saved_shard(vectors, tmp_path)
    first.warm_ann()
    assert first.ann.wait_saved(30)  # saved by the saver thread, off the request path
    assert (tmp_path / "ann_000.index").exists() and (tmp_path / "ann_000.json").exists()
    want = first.best_chunks(states, [[3], []], 400, 5)

    def no_build(*a, **k):
        raise AssertionError("built again although a saved index matched")

    monkeypatch.setattr(ann_mod, "build_index", no_build)
    second = saved_shard(vectors, tmp_path)
    second.restore_ann()
    assert second.ann.loaded_rows == 400
    got = second.best_chunks(states, [[3], []], 400, 5)
    np.testing.assert_array_equal(got.ids, want.ids)
    append(second, rng.standard_normal((10, 16)).astype(np.float32))  # added on top, not rebuilt
    second.best_chunks(states[:1], [[]], 410, 5)
    assert second.ann.rows == 410

    for other in (saved_shard(vectors, tmp_path, sha="re-embedded"), saved_shard(vectors, tmp_path, uid="another")):
        other.restore_ann()
        assert other.ann.index is None  # not this shard's vectors: built again at the first query
