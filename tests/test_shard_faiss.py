"""A shard's FAISS index: searches never overlap an add, and saving runs off the request path."""

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

import qrag.index.shard_faiss as shard_faiss
from qrag.index.shard_faiss import ReadWriteLock, ShardFaiss


class FakeHNSW:
    """Records whether a search ever ran while an add was rewriting the graph."""

    overlaps = 0

    def __init__(self, dim, m, metric):
        self.hnsw = SimpleNamespace(efSearch=0)
        self.ntotal = 0
        self.adding = False
        self.searching = 0

    def add(self, x):
        self.adding = True
        if self.searching:
            FakeHNSW.overlaps += 1
        time.sleep(0.002)
        self.ntotal += len(x)
        self.adding = False

    def search(self, x, k):
        self.searching += 1
        if self.adding:
            FakeHNSW.overlaps += 1
        time.sleep(0.001)
        self.searching -= 1
        return np.zeros((len(x), k), np.float32), np.zeros((len(x), k), np.int64)


def fake_faiss():
    return SimpleNamespace(
        IndexHNSWFlat=FakeHNSW,
        IndexFlatIP=None,
        METRIC_INNER_PRODUCT=0,
        serialize_index=lambda index: np.frombuffer(b"x" * index.ntotal, np.uint8),
    )


def rows_from_table(table: list[np.ndarray]):
    def rows_from(start):
        return np.concatenate(table)[start:], [(i + 1, "sha") for i in range(len(table))]

    return rows_from


def test_searches_never_overlap_an_add():
    FakeHNSW.overlaps = 0
    index = ShardFaiss(fake_faiss(), 4, 0, hnsw_m=8, ef_search=16)
    table = [np.ones((3, 4), np.float32)]
    lock = threading.Lock()
    errors = []

    def query(n_rows):
        try:
            for _ in range(20):
                index.catch_up(n_rows, True, rows_from_table(table))
                assert index.search(np.ones((1, 4), np.float32), 2, n_rows) is not None
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def append():
        for _ in range(20):
            with lock:
                table.append(np.ones((2, 4), np.float32))
            index.catch_up(3 + 2 * (len(table) - 1), True, rows_from_table(table))

    threads = [threading.Thread(target=query, args=(3,)) for _ in range(4)] + [threading.Thread(target=append)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and FakeHNSW.overlaps == 0
    assert index.rows == 3 + 2 * 20


def test_a_save_runs_off_the_request_path_and_later_appends_are_saved_after_it(monkeypatch, tmp_path):
    release, started = threading.Event(), threading.Event()
    saved = []

    def slow_save(data, rows, folder, shard, uid, batches, hnsw_m):
        started.set()
        assert release.wait(10)
        saved.append((rows, len(batches)))
        return True

    monkeypatch.setattr(shard_faiss, "save_index", slow_save)
    index = ShardFaiss(fake_faiss(), 4, 0, hnsw_m=8, ef_search=16, folder=tmp_path, uid="u")
    table = [np.ones((3, 4), np.float32)]
    t0 = time.perf_counter()
    index.catch_up(3, True, rows_from_table(table))
    assert index.search(np.ones((1, 4), np.float32), 2, 3) is not None  # answered while the save waits
    assert started.wait(10) and time.perf_counter() - t0 < 5 and saved == []
    for _ in range(3):  # appends meanwhile: one more save, of everything, after the first
        table.append(np.ones((2, 4), np.float32))
        index.catch_up(3 + 2 * (len(table) - 1), True, rows_from_table(table))
    release.set()
    assert index.wait_saved(10)
    assert saved == [(3, 1), (9, 4)] and index.saves == 2


def test_an_index_behind_the_rows_asked_for_is_not_searched():
    index = ShardFaiss(fake_faiss(), 4, 0, hnsw_m=8, ef_search=16)
    index.catch_up(3, True, rows_from_table([np.ones((3, 4), np.float32)]))
    assert index.search(np.ones((1, 4), np.float32), 2, 5) is None


def test_a_waiting_writer_goes_before_later_readers():
    lock = ReadWriteLock()
    order = []
    first_in, writer_waiting = threading.Event(), threading.Event()

    def first_reader():
        with lock.read():
            first_in.set()
            assert writer_waiting.wait(5)
            time.sleep(0.05)
            order.append("reader 1")

    def writer():
        assert first_in.wait(5)
        writer_waiting.set()
        with lock.write():
            order.append("writer")

    def later_reader():
        assert writer_waiting.wait(5)
        time.sleep(0.01)  # after the writer queued
        with lock.read():
            order.append("reader 2")

    threads = [threading.Thread(target=f) for f in (first_reader, writer, later_reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert order == ["reader 1", "writer", "reader 2"]


@pytest.mark.parametrize("rows", [0, 5])
def test_restore_takes_only_a_saved_index_of_this_corpus(tmp_path, rows):
    faiss = pytest.importorskip("faiss")
    built = faiss.IndexHNSWFlat(4, 8, faiss.METRIC_INNER_PRODUCT)
    if rows:
        built.add(np.random.default_rng(0).normal(size=(rows, 4)).astype(np.float32))
    data = faiss.serialize_index(built).tobytes()
    assert shard_faiss.save_index(data, rows, tmp_path, 0, "u", [(1, "a")], 8)
    mine = ShardFaiss(faiss, 4, 0, hnsw_m=8, ef_search=16, folder=tmp_path, uid="u")
    mine.restore([(1, "a"), (2, "b")])
    assert mine.loaded_rows == rows and mine.batches == [(1, "a")]
    other = ShardFaiss(faiss, 4, 0, hnsw_m=8, ef_search=16, folder=tmp_path, uid="another corpus")
    other.restore([(1, "a")])
    assert other.index is None and other.loaded_rows == 0
