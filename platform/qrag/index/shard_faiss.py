"""One shard's FAISS index: loaded or built, extended by appended rows, searched, saved off the
request path.

Concurrency. FAISS's ``add`` rewrites the HNSW graph that ``search`` reads, so searches hold a
shared lock and adds an exclusive one (an add that waits holds back new searches, so a steady
stream of queries cannot starve it). Saving an HNSW index serialises it under the shared lock,
so searches go on, and runs on a thread of its own: the first query after an append used to
serialise, hash and write the whole index itself, holding the shard's lock meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from qrag.index.faiss_files import load_index, save_index


class ReadWriteLock:
    """Many readers or one writer; a waiting writer goes before readers that come after it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextmanager
    def read(self) -> Iterator[None]:
        with self._cond:
            while self._writing or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writing or self._readers:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._cond:
                self._writing = False
                self._cond.notify_all()


class ShardFaiss:
    """The FAISS index of one shard's first ``rows`` vectors (inner product: flat, or HNSW when
    ``approximate``). An HNSW index is saved under ``folder`` (None: never) after it grows and
    loaded from there at start (:mod:`qrag.index.faiss_files`). :class:`qrag.index.ann.ShardAnn`
    keeps another kind of index the same way, through the hooks below."""

    FILE_NAME = "shard"  # saved as <folder>/<FILE_NAME>_NNN.index

    def __init__(
        self,
        faiss: Any,
        dim: int,
        shard: int,
        *,
        hnsw_m: int,
        ef_search: int,
        folder: Path | None = None,
        uid: str = "",
    ):
        self.faiss, self.dim, self.shard = faiss, dim, shard
        self.hnsw_m, self.ef_search = hnsw_m, ef_search
        self.folder, self.uid = folder, uid
        self.index: Any = None
        self.rows = 0
        self.batches: list[tuple[int, str]] = []  # the store batches the rows came from (what a saved file records)
        self.loaded_rows = 0  # rows of a saved index loaded at start (0: none)
        self.saves = 0
        self._rw = ReadWriteLock()
        self._save_lock = threading.Lock()
        self._save_wanted = False
        self._saver: threading.Thread | None = None

    def restore(self, batches: list[tuple[int, str]]) -> None:
        """Take the saved HNSW index when it covers a prefix of ``batches`` (the shard's loaded ones)."""
        if self.folder is None:
            return
        found = load_index(self.faiss, self.folder, self.shard, self.uid, batches, self._build_key(), self.FILE_NAME)
        if found is None:
            return
        index, rows, covered = found
        index = self._loaded(index)
        with self._rw.write():
            if self.index is None:
                self.index, self.rows, self.loaded_rows = index, rows, rows
                self.batches = [tuple(b) for b in batches[:covered]]

    def catch_up(
        self, n: int, approximate: bool, rows_from: Callable[[int], tuple[np.ndarray, list[tuple[int, str]]]]
    ) -> None:
        """Hold at least the shard's first ``n`` rows. ``rows_from(start)`` gives the shard's
        vectors from row ``start`` to its end and the batches they complete. A grown HNSW index
        is saved by the saver thread, not here."""
        if self.index is not None and self.rows >= n:
            return  # read without the lock: rechecked under it below when it says otherwise
        with self._rw.write():
            if self.index is not None and self.rows >= n:
                return
            vectors, batches = rows_from(self.rows)
            vectors = np.ascontiguousarray(vectors, dtype=np.float32)
            if self.index is None:
                self.index = self._new_index(vectors, approximate)
            self.index.add(vectors)
            self.rows += len(vectors)
            self.batches = batches
        if self.folder is not None and self._saved_kind():
            self._save_soon()

    @property
    def is_hnsw(self) -> bool:
        return isinstance(self.index, self.faiss.IndexHNSWFlat)

    # -- what another kind of index changes (qrag.index.ann.ShardAnn)

    def _new_index(self, vectors: np.ndarray, approximate: bool) -> Any:
        """An empty index, ready for the first ``vectors`` to be added (trained on them if it must be)."""
        if approximate:
            index = self.faiss.IndexHNSWFlat(self.dim, self.hnsw_m, self.faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efSearch = self.ef_search
            return index
        return self.faiss.IndexFlatIP(self.dim)

    def _loaded(self, index: Any) -> Any:
        """A deserialised saved index, set up to search."""
        index.hnsw.efSearch = self.ef_search
        return index

    def _saved_kind(self) -> bool:
        return self.is_hnsw  # flat indexes are a copy of the vectors: rebuilt, never saved

    def _build_key(self) -> int | str:
        return self.hnsw_m

    def _serialisable(self, index: Any) -> Any:
        return index

    def search(self, states: np.ndarray, k: int, n: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Inner products and rows of the best ``k`` per state; None when the index holds fewer
        than ``n`` rows (an append landed since :meth:`catch_up`: call it again)."""
        with self._rw.read():
            if self.index is None or self.rows < n:
                return None
            return self.index.search(np.ascontiguousarray(states, dtype=np.float32), k)

    # -- saving, on the saver thread

    def _save_soon(self) -> None:
        with self._save_lock:
            self._save_wanted = True
            if self._saver is None:
                self._saver = threading.Thread(
                    target=self._save_loop, name=f"qrag-faiss-save-{self.shard}", daemon=True
                )
                self._saver.start()

    def _save_loop(self) -> None:
        while True:
            with self._save_lock:
                if not self._save_wanted:
                    self._saver = None
                    return
                self._save_wanted = False  # appends from now on ask for another round
            with self._rw.read():  # searches go on; an add waits for the copy
                data = self.faiss.serialize_index(self._serialisable(self.index)).tobytes()
                rows, batches = self.rows, list(self.batches)
            if self._write(data, rows, batches):
                self.saves += 1

    def _write(self, data: bytes, rows: int, batches: list[tuple[int, str]]) -> bool:
        return save_index(data, rows, self.folder, self.shard, self.uid, batches, self._build_key())

    def wait_saved(self, timeout: float | None = None) -> bool:
        """Wait until no save is pending or running (tests, shutdown); False on timeout."""
        while True:
            with self._save_lock:
                saver = self._saver
            if saver is None:
                return True
            saver.join(timeout)
            if saver.is_alive():
                return False
