"""What one shard process holds: some shards of every corpus, loaded lazily from the store,
within a memory budget (least recently used corpora are evicted; a corpus that cannot fit is
refused), freed when the corpus is deleted. Loading one corpus never holds a lock that another
corpus's queries need; a load reserves its memory before it starts, so concurrent loads never
pass the budget together.

The budget defaults to a share of the machine (:func:`machine_budget`): of the memory available
to this process for shards on the host, of the GPU's free memory for shards on a GPU."""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qrag.index.shards import CorpusShards, ShardOptions, row_bytes

from qrag.retrieval.hits import ShardHits
from qrag.index.store import CorpusNotFound, CorpusStore, Manifest, StoreError, shard_rows

# A chunk's text is a few characters per token: what the budget assumes before the texts are read.
CHARS_PER_TOKEN = 6


class ShardOverBudget(StoreError):
    """The corpus's shards do not fit this holder's memory budget even with nothing else loaded."""

    def __init__(self, corpus: str, need: int, budget: int):
        self.corpus, self.need, self.budget = corpus, need, budget
        super().__init__(
            f"corpus {corpus!r} needs about {need / 2**20:.1f} MiB in each index shard; "
            f"the budget is {budget / 2**20:.1f} MiB (shard_memory_bytes)"
        )

    def __reduce__(self):  # picklable across processes (Ray)
        return (ShardOverBudget, (self.corpus, self.need, self.budget))


class ShardBusy(StoreError):
    """The corpus would fit, but loads in flight have reserved the memory it needs: retry."""

    def __init__(self, corpus: str, need: int, waited_s: float):
        self.corpus, self.need, self.waited_s = corpus, need, waited_s
        super().__init__(
            f"corpus {corpus!r} waited {waited_s:g} s for {need / 2**20:.1f} MiB that loads of other corpora hold "
            f"(shard_memory_bytes); retry"
        )

    def __reduce__(self):
        return (ShardBusy, (self.corpus, self.need, self.waited_s))


def _cgroup_room() -> int | None:
    """Bytes this process's cgroup (v2 or v1) may still take, or None without a limit."""
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            cap, used = Path(limit).read_text().strip(), Path(usage).read_text().strip()
        except OSError:
            continue
        if cap.isdigit() and int(cap) < 1 << 60:  # v1 writes a huge number for "no limit"
            return max(0, int(cap) - int(used))
    return None


def host_available_bytes() -> int:
    """Memory the host can still give this process: MemAvailable, within the cgroup's limit."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    room = _cgroup_room()
    return available if room is None else min(available, room)


def device_available_bytes(device: torch.device) -> int:
    """Memory free for shards on ``device``: a GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available_bytes()


def machine_budget(device: torch.device, fraction: float, holders: int = 1) -> int | None:
    """The default budget of one of ``holders`` shard holders sharing ``device`` in a process:
    ``fraction`` of the memory free there when it starts, shared out; None when fraction is 0."""
    if fraction <= 0:
        return None
    return int(device_available_bytes(device) * fraction / max(1, holders))


def estimate_bytes(rows: int, dim: int, tokens_per_row: float) -> int:
    """Memory of ``rows`` loaded rows (vectors in float32, texts, token ids)."""
    per_row = dim * 4 + row_bytes(int(tokens_per_row * CHARS_PER_TOKEN), 16, int(tokens_per_row) + 2)
    return int(rows * per_row)


def holder_rows(slots: range | list[int], shards: int, chunks: int) -> int:
    return sum(shard_rows(s, shards, chunks) for s in slots if s < shards)


def corpus_bytes_per_holder(m: Manifest, holders: int, extra_chunks: int = 0, extra_tokens: int = 0) -> int:
    """The most any one of ``holders`` holders needs for corpus ``m`` (plus a pending append)."""
    chunks, tokens = m.chunks + extra_chunks, m.tokens + extra_tokens
    per_row_tokens = tokens / chunks if chunks else 0.0
    rows = max(holder_rows(range(h, m.shards, holders), m.shards, chunks) for h in range(max(1, holders)))
    return estimate_bytes(rows, m.dim, per_row_tokens)


class ShardHolder:
    """Shards ``slot, slot + holders, ...`` of every corpus (what one shard deployment replica
    holds), kept in step with the store."""

    def __init__(
        self,
        store: CorpusStore,
        slot: int,
        holders: int,
        device: torch.device,
        options: ShardOptions | None = None,
        memory_bytes: int | None = None,
        sweep_s: float = 2.0,
        reserve_wait_s: float = 60.0,
    ):
        """``memory_bytes``: the budget (None: none). A load kept out only by other loads in
        flight waits for them, ``reserve_wait_s`` at most."""
        self.store, self.slot, self.holders, self.device = store, slot, holders, device
        self.options = options or ShardOptions()
        self.memory_bytes = memory_bytes
        self.corpora: OrderedDict[str, CorpusShards] = OrderedDict()  # least recently used first
        self.evictions = 0
        self._lock = threading.Lock()  # the dicts only: never held while a corpus loads
        self._loads_done = threading.Condition(self._lock)
        self._reserved: dict[str, list[int]] = {}  # corpus -> [bytes, loads in flight] of the loads under way
        self._sweep_s, self._swept = sweep_s, 0.0
        self.reserve_wait_s = reserve_wait_s

    def _slots(self, shards: int) -> range:
        return range(self.slot, shards, self.holders)

    def loaded(self, corpus: str, uid: str, version: int) -> CorpusShards | None:
        """The corpus if it is in memory and current (no I/O: callers answer from here at once)."""
        with self._lock:
            cs = self.corpora.get(corpus)
            if cs is None or cs.uid != uid or cs.version < version or cs.problems:
                return None
            self.corpora.move_to_end(corpus)
            return cs

    def ensure(self, corpus: str, uid: str, version: int) -> CorpusShards:
        """The corpus loaded up to ``version`` (the caller's manifest), within the budget."""
        self._sweep()
        cs = self.loaded(corpus, uid, version)
        if cs is not None:
            return cs
        try:
            m = self.store.read(corpus)
            self._reserve(corpus, self._need(m))
            try:
                cs = self._load(corpus, uid, version, m)
            finally:
                self._release(corpus)
        except CorpusNotFound:
            self.forget(corpus)
            raise
        self._fit(corpus, cs)
        return cs

    def _load(self, corpus: str, uid: str, version: int, m: Manifest) -> CorpusShards:
        with self._lock:
            cs = self.corpora.get(corpus)
            if cs is not None and cs.uid is not None and cs.uid != uid:
                del self.corpora[corpus]
                cs = None
            if cs is None:
                cs = self.corpora[corpus] = CorpusShards(
                    self.store, corpus, self._slots(m.shards), self.device, self.options
                )
        cs.sync(version, uid)  # loads outside self._lock: other corpora keep answering
        return cs

    def _fit(self, corpus: str, cs: CorpusShards) -> None:
        """After a load: the corpus is the most recently used; if it outgrew its estimate, others
        make way, or it goes."""
        budget = self.memory_bytes
        with self._lock:
            if corpus in self.corpora:
                self.corpora.move_to_end(corpus)
            over = budget is not None and cs.nbytes() > budget
            if budget is not None and not over:
                self._evict_for(corpus, cs.nbytes())
        if over:
            self.forget(corpus)
            raise ShardOverBudget(corpus, cs.nbytes(), budget)

    def _need(self, m: Manifest) -> int:
        rows = holder_rows(self._slots(m.shards), m.shards, m.chunks)
        return estimate_bytes(rows, m.dim, m.tokens / m.chunks if m.chunks else 0.0)

    def _used_by_others(self, corpus: str) -> int:
        """Bytes of every other corpus: loaded, or reserved by its load in flight (caller holds the lock)."""
        names = (set(self.corpora) | set(self._reserved)) - {corpus}
        return sum(
            max(self.corpora[n].nbytes() if n in self.corpora else 0, self._reserved.get(n, [0])[0]) for n in names
        )

    def _evict_for(self, corpus: str, need: int) -> bool:
        """Evict loaded corpora, least recently used first (never one that is loading), until
        ``need`` fits beside the rest; whether it fits (caller holds the lock)."""
        used = self._used_by_others(corpus)
        for name in [n for n in self.corpora if n != corpus and n not in self._reserved]:
            if used + need <= self.memory_bytes:
                break
            used -= self.corpora.pop(name).nbytes()
            self.evictions += 1
        return used + need <= self.memory_bytes

    def _reserve(self, corpus: str, need: int) -> None:
        """Hold ``need`` bytes of the budget for a load of ``corpus`` before it starts: evict what
        must go, or wait while only other loads in flight are in the way."""
        budget = self.memory_bytes
        if budget is not None and need > budget:
            self.forget(corpus)
            raise ShardOverBudget(corpus, need, budget)
        deadline = time.monotonic() + self.reserve_wait_s
        with self._lock:
            while budget is not None and not self._evict_for(corpus, need):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ShardBusy(corpus, need, self.reserve_wait_s)
                self._loads_done.wait(left)
            entry = self._reserved.setdefault(corpus, [0, 0])
            entry[0], entry[1] = max(entry[0], need), entry[1] + 1

    def _release(self, corpus: str) -> None:
        with self._lock:
            entry = self._reserved.get(corpus)
            if entry is not None:
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._reserved[corpus]
            self._loads_done.notify_all()

    def _sweep(self) -> None:
        """Drop corpora deleted on disk (by another replica, or while this one was idle)."""
        now = time.monotonic()
        if now - self._swept < self._sweep_s:
            return
        self._swept = now
        with self._lock:
            names = list(self.corpora)
        for name in names:
            if not (self.store.root / name / "corpus.json").is_file():
                self.forget(name)

    def forget(self, corpus: str) -> bool:
        """Free a corpus's memory (it was deleted); queries in flight keep their references."""
        with self._lock:
            gone = self.corpora.pop(corpus, None) is not None
            self._loads_done.notify_all()
            return gone

    def best_chunks(
        self, corpus: str, uid: str, version: int, states: np.ndarray, selected: list[list[int]], n_total: int, k: int
    ) -> ShardHits:
        """:meth:`CorpusShards.best_chunks` of corpus version (``corpus``, ``uid``, ``version``), loaded first
        if need be."""
        return self.ensure(corpus, uid, version).best_chunks(states, selected, n_total, k)

    def preload(self, fingerprint: str | None = None) -> list[str]:
        """Load every stored corpus (of the model ``fingerprint``, when given), most recently
        written last, within the budget; the names loaded. A corpus that cannot load now is left
        for its first query to report."""
        loaded = []
        for name in self.store.names():
            try:
                m = self.store.read(name)
                if m.chunks == 0 or (fingerprint is not None and m.fingerprint != fingerprint):
                    continue
                self.ensure(name, m.uid, m.version)
                loaded.append(name)
            except StoreError:
                continue
        return loaded

    @torch.no_grad()
    def warm_scoring(self, corpus: str, max_rows: int, max_selected: int, k: int) -> int:
        """Run the scoring step of ``corpus`` once for every batch bucket up to ``max_rows`` and
        every selected-set size up to ``max_selected`` (GPU: its CUDA graphs are captured now,
        not on the first queries of each shape). Shapes run."""
        from qrag.model.state_graphs import BATCH_BUCKETS  # noqa: PLC0415

        with self._lock:
            cs = self.corpora.get(corpus)
        if cs is None or not cs.shards:
            return 0
        m = self.store.read(corpus)
        n_total = m.chunks
        runs = 0
        for rows in [b for b in BATCH_BUCKETS if b <= max_rows]:
            states = np.zeros((rows, m.dim), np.float32)
            for width in range(0, max(0, min(max_selected, n_total - 1)) + 1):
                cs.best_chunks(states, [list(range(width))] * rows, n_total, min(k, n_total))
                runs += 1
        return runs

    def nbytes(self) -> int:
        with self._lock:
            return sum(cs.nbytes() for cs in self.corpora.values())

    def stats(self, corpus: str | None = None) -> dict[str, Any]:
        with self._lock:
            held = {name: cs for name, cs in self.corpora.items() if corpus is None or name == corpus}
        return {
            "slot": self.slot,
            "device": str(self.device),
            "corpora": len(held),
            "rows": sum(s.n for cs in held.values() for s in cs.shards.values()),
            "bytes": sum(cs.nbytes() for cs in held.values()),
            "budget_bytes": self.memory_bytes,
            "reserved_bytes": sum(b for b, _ in self._reserved.values()),
            "evictions": self.evictions,
            "loaded_rows": sum(cs.loaded_rows for cs in held.values()),
            "problems": [str(p) for cs in held.values() for p in cs.problems],
        }


__all__ = ["ShardBusy", "ShardHolder", "ShardOverBudget", "corpus_bytes_per_holder", "estimate_bytes", "machine_budget"]
