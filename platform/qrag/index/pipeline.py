"""The library indexing path as a pipeline: three stages that overlap, one commit per group.

::

    prep thread      chunk + tokenise the next documents (or take them from worker processes)
      -> queue (``depth`` groups)
    feeder           a device's embedding, group after group without a pause between them: a
    (per device)     launching thread queues slices of chunk_batch chunks on the device
                     (EmbeddingModel.embed_chunks_start), one slice ahead of the one a collecting
                     thread waits for, across group boundaries; a streamed group (blocks still
                     being tokenised: Group.pending) is embedded block by block as they come; with
                     replicas of the model on more devices, groups go to the devices round robin
      -> queue (``depth`` groups per device), in group order
    writer thread    CorpusStore.append of the previous group (files written, then the manifest
                     committed atomically: the store's one writer, as for the HTTP and Ray paths)

A group is whole documents, about ``commit_chunks`` chunks, in input order; groups are committed
one by one in that order, so positions are those of a sequential run (``pipelined=False`` runs
the same groups one stage after another in the calling thread: the same files, byte for byte).

Failures: an exception in any stage is raised in the caller. A writer failure stops the writer
(nothing after the failed group is written) and the corpus stays committed up to the last whole
group (the failed group's files are strays the next write removes). An embedding or prep failure
lets the writer finish the groups already handed to it (whole groups) before it is raised.
``LocalIndex.add_documents(..., resume=True)`` then skips the committed documents, so they are
not embedded again, and ends with the corpus an uninterrupted run makes (group boundaries only
depend on the documents and ``commit_chunks``).

Numbers: :class:`IndexStats` has each stage's busy seconds and the stalls between them; with the
stages overlapping, busy seconds add up to more than the wall time.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from qrag.data.documents import Document, DocumentChunk
from qrag.model.encoder import FEEDING_SWITCH_S, host_settings_while_feeding
from qrag.index.store import CorpusStore, Manifest
from qrag.index.writer_process import ChildWriter


@dataclass
class Group:
    """Whole documents with their chunks (corpus order) and token ids: one commit.

    ``pending``: the rest of the chunks as (chunks, ids) blocks still being prepared (tokenising
    workers), taken by the feeder as they come (:meth:`id_blocks`): the device starts on a group's
    first block, not once the whole group is tokenised. Its chunks and ids are complete once it is
    embedded."""

    docs: list[Document] = field(default_factory=list)
    chunks: list[DocumentChunk] = field(default_factory=list)
    ids: list[np.ndarray] = field(default_factory=list)
    pending: Iterator[tuple[list[DocumentChunk], list[np.ndarray]]] | None = None

    def id_blocks(self) -> Iterator[list[np.ndarray]]:
        """The group's token ids block by block: those it holds, then each pending block as it
        comes (added to the group's chunks and ids)."""
        if self.ids:
            yield list(self.ids)  # a copy: the pending blocks extend self.ids
        while self.pending is not None:
            block = next(self.pending, None)
            if block is None:
                self.pending = None
                return
            chunks, ids = block
            self.chunks.extend(chunks)
            self.ids.extend(ids)
            yield ids


class GroupBuilder:
    """Documents in input order -> groups of whole documents of at least ``commit_chunks``
    chunks (None: one group of everything). Boundaries depend only on the documents' chunk
    counts, never on how the caller batched its tokenising."""

    def __init__(self, commit_chunks: int | None):
        if commit_chunks is not None and commit_chunks < 1:
            raise ValueError(f"commit_chunks must be at least 1, got {commit_chunks}")
        self.commit_chunks = commit_chunks
        self.group = Group()

    def add(self, doc: Document, chunks: Sequence[DocumentChunk], ids: Sequence[np.ndarray]) -> Group | None:
        self.group.docs.append(doc)
        self.group.chunks.extend(chunks)
        self.group.ids.extend(ids)
        if self.commit_chunks is not None and len(self.group.chunks) >= self.commit_chunks:
            return self.flush()
        return None

    def flush(self) -> Group | None:
        group, self.group = self.group, Group()
        return group if group.docs else None


def document_groups(
    docs: Sequence[Document],
    prepare: Callable[[list[Document]], tuple[list[DocumentChunk], list[np.ndarray]]],
    commit_chunks: int | None,
    block_docs: int = 256,
) -> Iterator[Group]:
    """Chunk + tokenise ``docs`` ``block_docs`` at a time (``prepare``: documents -> their chunks
    in order and the chunks' token ids) and yield commit groups. No documents: one empty group
    (an empty batch, as a single append of nothing makes)."""
    builder = GroupBuilder(commit_chunks)
    for lo in range(0, len(docs), block_docs):
        block = list(docs[lo : lo + block_docs])
        chunks, ids = prepare(block)
        start = 0
        for doc in block:  # chunks come in document order: each document's run of chunks
            end = start
            while end < len(chunks) and chunks[end].doc_id == doc.id:
                end += 1
            group = builder.add(doc, chunks[start:end], ids[start:end])
            start = end
            if group is not None:
                yield group
    group = builder.flush()
    if group is not None:
        yield group
    elif not docs:
        yield Group()


@dataclass
class IndexStats:
    pipelined: bool
    commits: int = 0
    documents: int = 0
    chunks: int = 0
    tokens: int = 0  # text tokens of the chunks
    encoder_tokens: int = 0  # token ids embedded (with [CLS]/[SEP])
    seconds: float = 0.0  # wall, first group asked for to last commit
    prep_seconds: float = (
        0.0  # busy: producing groups (chunking, tokenising or waiting on workers; a streamed group: handing it over)
    )
    embed_seconds: float = 0.0  # busy: queueing forwards and waiting for the device to take more
    write_seconds: float = 0.0  # busy: store appends (files, checksums, fsync, manifest)
    embed_waiting_for_prep: float = 0.0  # the embed stage starved: no group, or a streamed group's next block not ready
    embed_waiting_for_writer: float = 0.0  # the embed stage held back (writer's queue full)
    writer_waiting_for_embed: float = 0.0  # the writer starved (embedding slower)
    devices: int = 1  # feeder threads, one per device the groups were embedded on
    depth: int = 0
    writer: str = "caller"  # who wrote the store: the calling thread (sequential), a "thread" or a "process"
    # A pipelined run's ramp and tail, in seconds from its start: the first block of token ids in
    # hand, the first slice queued on a device, the last slice's vectors back (then: writes).
    first_block_at: float | None = None
    first_slice_at: float | None = None
    last_slice_done_at: float | None = None
    started_at: float = 0.0  # time.perf_counter() at the start: one clock for a machine's processes (lanes)

    def summary(self) -> dict[str, Any]:
        """The figures, rounded; not ``started_at`` (a clock reading, meaningless in a report)."""
        out = asdict(self)
        del out["started_at"]
        for key, value in out.items():
            if isinstance(value, float):
                out[key] = round(value, 3)
        busy = self.prep_seconds + self.embed_seconds + self.write_seconds
        out["overlap"] = round(busy / self.seconds, 3) if self.seconds else 0.0  # > 1: stages ran at once
        return out


_END = object()


class _Prefetch:
    """Runs an iterable in a thread, ``depth`` items ahead; its exception is raised to the reader."""

    def __init__(self, items: Iterable, depth: int, stats: IndexStats):
        self.items, self.stats = items, stats
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="qrag-index-prep", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            it = iter(self.items)
            while not self.stop.is_set():
                t0 = time.perf_counter()
                item = next(it, _END)
                self.stats.prep_seconds += time.perf_counter() - t0
                self._put((None, item))
                if item is _END:
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self._put((exc, None))

    def _put(self, entry) -> None:
        while not self.stop.is_set():
            try:
                self.q.put(entry, timeout=0.05)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator:
        while True:
            exc, item = self.q.get()  # a wait here starves a feeder only once its queue is empty: counted there
            if exc is not None:
                raise exc
            if item is _END:
                return
            yield item

    def close(self, wait: float | None = None) -> None:
        self.stop.set()
        self.thread.join(wait)


class _Writer:
    """One thread committing (group, vectors) items in the order given; vectors may be a future
    (a feeder thread's work), waited for in that order. After a failure (the write's or the
    future's) it writes nothing more; the failure is raised by the next :meth:`put` or by
    :meth:`close`."""

    _STOP = object()

    def __init__(self, write: Callable[[Any], None], depth: int, stats: IndexStats):
        self.write, self.stats = write, stats
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="qrag-index-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is self._STOP:
                return
            if self.error is not None:
                continue  # drained, never written: the batch after a failed one must not commit
            t0 = time.perf_counter()
            try:
                group, vectors = item
                if isinstance(vectors, Future):  # embedded by a feeder thread: wait in group order
                    vectors = vectors.result()
                    t1 = time.perf_counter()
                    self.stats.writer_waiting_for_embed += t1 - t0
                    t0 = t1
                self.write((group, vectors))
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                self.error = exc
            finally:
                self.stats.write_seconds += time.perf_counter() - t0

    def _raise(self) -> None:
        if self.error is not None:
            self.close()
            raise self.error

    def put(self, item) -> None:
        t0 = time.perf_counter()
        try:
            while True:
                self._raise()
                try:
                    self.q.put(item, timeout=0.05)
                    return
                except queue.Full:
                    continue
        finally:
            self.stats.embed_waiting_for_writer += time.perf_counter() - t0

    def close(self) -> None:
        """Write what was handed over (unless a write failed), then stop the thread."""
        if not self.closed:
            self.closed = True
            self.q.put(self._STOP)  # the thread drains the queue, so this never blocks for long
            self.thread.join()

    def finish(self) -> None:
        self.close()
        if self.error is not None:
            raise self.error


def id_slices(blocks: Iterable[Sequence[np.ndarray]], size: int) -> Iterator[list[np.ndarray]]:
    """Consecutive slices of ``size`` sequences (the last may be smaller) across ``blocks``: the
    cuts of their concatenation, however it was blocked (the same encoder calls, the same vectors)."""
    buf: list[np.ndarray] = []
    for block in blocks:
        lo = 0
        while lo < len(block):
            take = min(size - len(buf), len(block) - lo)
            buf.extend(block[lo : lo + take])
            lo += take
            if len(buf) == size:
                yield buf
                buf = []
    if buf:
        yield buf


def _starter(model) -> Callable[[Sequence[np.ndarray]], Callable[[], np.ndarray]]:
    """``model.embed_chunks_start`` (queue the work, wait later), or its blocking ``embed_chunks``
    in that shape."""
    start = getattr(model, "embed_chunks_start", None)
    if start is not None:
        return start

    def start_now(seqs, _embed=model.embed_chunks):
        out = _embed(seqs)
        return lambda: out

    return start_now


def _joined(parts: list[np.ndarray], dim: int) -> np.ndarray:
    if not parts:
        return np.zeros((0, dim), np.float32)
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def embed_group(
    model, ids: Sequence[np.ndarray], chunk_batch: int, dim: int, on_slice: Callable[[int], None] | None = None
) -> np.ndarray:
    """Vectors of a group, ``chunk_batch`` chunks per encoder call; with a model that can start a
    call before the previous one is waited for (``embed_chunks_start``), one call stays queued
    ahead so the device never waits for the host between calls. (A pipelined run's :class:`_Feeder`
    does the same across groups.)"""
    start = _starter(model)
    parts: list[np.ndarray] = []
    queued: list[tuple[Callable[[], np.ndarray], int]] = []  # at most one call ahead of the one waited for

    def wait_oldest() -> None:
        result, n = queued.pop(0)
        parts.append(result())
        if on_slice is not None:
            on_slice(n)

    for part in id_slices([ids], chunk_batch):
        queued.append((start(part), len(part)))
        if len(queued) > 1:
            wait_oldest()
    while queued:
        wait_oldest()
    return _joined(parts, dim)


class _Feeder:
    """One device's embedding in a pipelined run, without a pause between groups: a launching
    thread queues each group's slices of ``chunk_batch`` chunks (a streamed group's blocks as they
    come), at most one beyond the slice a collecting thread waits for, whatever group it belongs to;
    the collector completes each group's future with its vectors, in order. Embedding group by
    group instead (one call ahead within a group, none across) left the device idle at every
    group's end and made every group wait until all of it was tokenised."""

    _END = object()

    def __init__(
        self,
        model,
        chunk_batch: int,
        dim: int,
        stats: IndexStats,
        counting: threading.Lock,
        on_block: Callable[[Sequence[np.ndarray]], None],
        on_slice: Callable[[int], None],
        name: str,
    ):
        self.model, self.chunk_batch, self.dim, self.stats, self.counting = model, chunk_batch, dim, stats, counting
        self.on_block, self.on_slice = on_block, on_slice
        self.inbox: queue.Queue = queue.Queue()
        self.launched: queue.Queue = queue.Queue()
        self.room = threading.Semaphore(2)  # slices on the device: the one waited for and one queued behind it
        self.closed = False
        self.threads = [
            threading.Thread(target=self._launch, name=f"{name}-launch", daemon=True),
            threading.Thread(target=self._collect, name=f"{name}-collect", daemon=True),
        ]
        for t in self.threads:
            t.start()

    def submit(self, group: Group) -> Future:
        future: Future = Future()
        self.inbox.put((group, future))
        return future

    def _blocks(self, group: Group) -> Iterator[Sequence[np.ndarray]]:
        """The group's blocks, the wait for each counted as the feeder starving."""
        blocks = group.id_blocks()
        while True:
            t0 = time.perf_counter()
            block = next(blocks, None)
            with self.counting:
                self.stats.embed_waiting_for_prep += time.perf_counter() - t0
            if block is None:
                return
            self._stamp("first_block_at")
            self.on_block(block)
            yield block

    def _stamp(self, what: str, last: bool = False) -> None:
        """Seconds since the run's start into ``stats.<what>``: the first time only, or (``last``) every time."""
        with self.counting:
            if last or getattr(self.stats, what) is None:
                setattr(self.stats, what, time.perf_counter() - self.stats.started_at)

    def _launch(self) -> None:
        _on_device(getattr(self.model, "device", "cpu"))()
        start = _starter(self.model)
        while True:
            t0 = time.perf_counter()
            item = self.inbox.get()
            with self.counting:
                self.stats.embed_waiting_for_prep += time.perf_counter() - t0
            if item is self._END:
                self.launched.put(self._END)
                return
            group, future = item
            try:
                for ids in id_slices(self._blocks(group), self.chunk_batch):
                    t0 = time.perf_counter()
                    self.room.acquire()
                    try:
                        wait = start(ids)
                    except BaseException:
                        self.room.release()
                        raise
                    finally:
                        with self.counting:
                            self.stats.embed_seconds += time.perf_counter() - t0
                    self._stamp("first_slice_at")
                    self.launched.put((future, wait, len(ids)))
                self.launched.put((future, None, 0))  # the group's last slice is queued
            except BaseException as exc:  # noqa: BLE001 - the group's future carries it to the writer
                self.launched.put((future, exc, 0))

    def _collect(self) -> None:
        parts: list[np.ndarray] = []
        error: BaseException | None = None
        while True:
            item = self.launched.get()
            if item is self._END:
                return
            future, wait, n = item
            if not callable(wait):  # the group's end: None, or what stopped its launching
                error = error or wait
                if error is None:
                    future.set_result(_joined(parts, self.dim))
                else:
                    future.set_exception(error)
                parts, error = [], None
                continue
            try:
                if error is None:  # after a failed slice the group's other slices are only waited out
                    parts.append(wait())
                    self._stamp("last_slice_done_at", last=True)
                    self.on_slice(n)
            except BaseException as exc:  # noqa: BLE001 - the group's future carries it
                error = exc
            finally:
                self.room.release()

    def close(self, cancel: bool = False) -> None:
        """Embed what was submitted (``cancel``: only the group in hand), then stop both threads."""
        if not self.closed:
            self.closed = True
            while cancel:
                try:
                    self.inbox.get_nowait()[1].cancel()
                except queue.Empty:
                    break
            self.inbox.put(self._END)
            for t in self.threads:
                t.join()


def _on_device(device) -> Callable[[], None]:
    """A feeder thread's initializer: CUDA work of the thread (graph captures, events, streams)
    goes to its model's device, not to device 0."""

    def init() -> None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is not None:
            torch.cuda.set_device(dev)

    return init


def index_groups(
    store: CorpusStore,
    name: str,
    model,
    groups: Iterable[Group],
    *,
    chunk_batch: int,
    pipelined: bool = True,
    depth: int = 2,
    progress: Callable[[int, int], None] | None = None,
    on_commit: Callable[[Manifest], None] | None = None,
    host_threads: int | None = 1,
    switch_s: float | None = FEEDING_SWITCH_S,
    writer: str = "thread",
    replicas: Sequence = (),
    append: Callable[[Group, np.ndarray], Manifest | None] | None = None,
) -> tuple[Manifest, IndexStats]:
    """Embed and commit ``groups`` (in order, one ``store.append`` each) into corpus ``name``.

    ``progress(done, known)`` after every encoder call: chunks embedded and chunks prepared so far.
    ``on_commit(manifest)`` after every commit (on the writer thread when pipelined).
    ``host_threads`` and ``switch_s``: torch's CPU threads and the GIL's switch interval in this
    process meanwhile when the model is on a GPU (:func:`qrag.model.encoder.host_settings_while_feeding`;
    None: unchanged). ``writer``: where a pipelined run writes the store, "thread" (a thread of this
    process) or "process" (a child process: :mod:`qrag.index.writer_process`; the same files).
    ``replicas``: the same model on more devices (``EmbeddingModel.replica``); a pipelined run embeds
    groups on ``model`` and each replica round robin, one feeder thread per device, and commits
    them in order (the same files as one device).
    ``append(group, vectors)``: what the writer does with each embedded group instead of
    ``store.append``, returning the committed manifest or None (a lane of :mod:`qrag.index.lanes`
    writes the files and leaves the commit to its caller); in group order, on the writer thread.
    Returns the last manifest and the stage timings."""
    if chunk_batch < 1:
        raise ValueError(f"chunk_batch must be at least 1, got {chunk_batch}")
    if writer not in ("thread", "process"):
        raise ValueError(f"writer must be 'thread' or 'process', got {writer!r}")
    models = [model, *replicas]
    if any(m.fingerprint != model.fingerprint for m in models):
        raise ValueError("replicas must be the same model (same fingerprint) on other devices")
    if replicas and not pipelined:
        raise ValueError("replicas embed groups side by side: they need pipelined=True")
    if append is not None and writer != "thread":
        raise ValueError("a custom append runs on the writer thread: it needs writer='thread'")
    with host_settings_while_feeding(getattr(model, "device", "cpu"), host_threads, switch_s):
        return _index_groups(
            store, name, models, groups, chunk_batch, pipelined, depth, progress, on_commit, writer, append
        )


def _index_groups(
    store: CorpusStore,
    name: str,
    models: Sequence,
    groups: Iterable[Group],
    chunk_batch: int,
    pipelined: bool,
    depth: int,
    progress: Callable[[int, int], None] | None,
    on_commit: Callable[[Manifest], None] | None,
    writer_kind: str = "thread",
    append: Callable[[Group, np.ndarray], Manifest | None] | None = None,
) -> tuple[Manifest, IndexStats]:
    stats = IndexStats(
        pipelined=pipelined,
        depth=depth if pipelined else 0,
        writer=writer_kind if pipelined else "caller",
        devices=len(models),
    )
    dim = store.read(name).dim
    fingerprint = models[0].fingerprint
    last: list[Manifest] = []
    counts = {"embedded": 0, "known": 0}
    counting = threading.Lock()  # feeder threads add to the counts and the embed seconds

    def committed(group: Group, m: Manifest | None) -> None:
        if m is not None:
            last[:] = [m]
        stats.commits += 1
        stats.documents += len(group.docs)
        stats.chunks += len(group.chunks)
        stats.tokens += sum(c.tokens for c in group.chunks)
        if on_commit is not None and m is not None:
            on_commit(m)

    # Where a batch is appended: the caller's function (files only: a lane), here, or (pipelined,
    # writer "process") by a child process. Each gives the committed manifest, or None.
    child = ChildWriter(store.root, name, fingerprint) if pipelined and writer_kind == "process" else None
    if append is None and child is not None:

        def append(group: Group, vectors: np.ndarray) -> Manifest:
            return child.append(group.docs, group.chunks, group.ids, vectors)
    elif append is None:

        def append(group: Group, vectors: np.ndarray) -> Manifest:
            return store.append(name, group.docs, group.chunks, group.ids, vectors, fingerprint)

    def write(item: tuple[Group, np.ndarray]) -> None:
        group, vectors = item
        committed(group, append(group, vectors))

    def on_slice(n: int) -> None:
        with counting:
            counts["embedded"] += n
            done, known = counts["embedded"], counts["known"]
        if progress is not None:
            progress(done, known)

    def known(block: Sequence[np.ndarray]) -> None:
        with counting:
            counts["known"] += len(block)
            stats.encoder_tokens += sum(len(x) for x in block)

    t_start = stats.started_at = time.perf_counter()
    if not pipelined:
        it = iter(groups)
        while True:
            t0 = time.perf_counter()
            group = next(it, None)
            stats.prep_seconds += time.perf_counter() - t0
            if group is None:
                break
            for block in group.id_blocks():  # a streamed group whole (nothing overlaps here)
                known(block)
            t0 = time.perf_counter()
            vectors = embed_group(models[0], group.ids, chunk_batch, dim, on_slice)
            stats.embed_seconds += time.perf_counter() - t0
            t0 = time.perf_counter()
            write((group, vectors))
            stats.write_seconds += time.perf_counter() - t0
    else:
        prep = _Prefetch(groups, depth, stats)
        writer = _Writer(write, depth * len(models), stats)
        feeders = [
            _Feeder(m, chunk_batch, dim, stats, counting, known, on_slice, f"qrag-index-feed-{i}")
            for i, m in enumerate(models)
        ]
        failed = True
        try:
            for k, group in enumerate(prep):
                writer.put((group, feeders[k % len(models)].submit(group)))
            writer.finish()
            failed = False
        except BaseException:
            prep.close(wait=5.0)  # a prep step in progress finishes on its own (daemon thread)
            writer.close()  # whole groups already handed over are committed, nothing else
            raise
        finally:
            for feeder in feeders:
                feeder.close(cancel=failed)
            if child is not None:
                child.close()
        prep.close()
    stats.seconds = time.perf_counter() - t_start
    return (last[0] if last else store.read(name)), stats
