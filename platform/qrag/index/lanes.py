"""Bulk indexing on the GPUs of one machine: a process per GPU (a *lane*), the corpus committed in
order by the caller.

::

    caller (holds the corpus's writer lock: CorpusStore.hold)
      documents -> groups of whole documents of about ``commit_chars`` characters; each to the next lane
      with room in its inbox
    lane i (a spawned process: its GPU, its model, its own tokenising processes)
      queue group k's tokenising jobs in its workers (blocks of ``block_chars``) and hand the group
      on at once: its blocks are embedded as they come (qrag.index.pipeline.index_groups with
      Group.pending; tokenising, feeding and writing overlap); k's chunk count to the caller once tokenised
      write its files once the caller has said where they start (CorpusStore.write_batch_files)
    caller: first positions handed out in group order as the counts come in; written groups
            committed in group order (CorpusStore.commit_written), one by one at first, then
            several per manifest write as the run grows (COMMIT_SHARE)

Why: one process feeding two GPUs was no faster than one GPU (gathering tokenised chunks, feeding
and handing over the writes share one GIL), and one process did not keep even one GPU busy. A lane
is that single-GPU pipeline in a process of its own; lanes only exchange counts, positions and
manifest entries with the caller. This is the default path of ``qrag index``
(:mod:`qrag.index.bulk`); how fast it goes: docs/benchmarks.md, "Indexing".

The corpus is the one a single process makes from the same documents (same chunks, positions,
vectors); only the batch boundaries differ (they depend on characters here, not on chunk counts).
A crash keeps every group committed before it: at most one group, or 1/COMMIT_SHARE of the groups
the run committed, is lost; a failure commits every group written before it. ``resume=True`` skips
the documents the corpus holds, so a rerun embeds only the rest. Files a lane wrote for a group
that was never committed are strays, removed by the next writer.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qrag.data.documents import Document, unpack_chunks
from qrag.index.pipeline import Group, index_groups
from qrag.data.sample import DataError
from qrag.index.store import Batch, CorpusConflict, CorpusStore, Manifest, StoreError
from qrag.index.tokenise_workers import blocks_of, char_groups, init_worker, prepare_block
from qrag.index.writer_process import picklable_error
from qrag.model.encoder import pick_device

POLL_S = 0.2  # how often a blocked lane or caller looks whether the other side is still there
# Lanes feeding one GPU (qrag index, serve_scale.py --lanes): the best of 2 to 4 lanes on the novels
# benchmark (docs/benchmarks.md, "Indexing").
LANES_PER_GPU = 3
CHARS_PER_TOKEN = 4  # English prose: groups and tokenising jobs are cut by characters, before tokenising
# A lane's defaults where the caller does not choose (qrag index, serve_scale.py --lanes), picked on
# the novels benchmark (docs/benchmarks.md, "Indexing"): small groups, as a lane's groups are
# streamed (small ones cost no device time, and the last groups balance the lanes); large slices a
# forward; the tokenising workers niced below the lane's threads that feed the GPU.
LANE_COMMIT_CHUNKS = 4096
LANE_CHUNK_BATCH = 8192
LANE_ENCODE_TOKENS = 131072
LANE_WORKER_NICE = 5
# A commit rewrites the whole manifest (every batch's entry), so committing each group alone made a
# load's manifest writes grow with the square of its groups. A commit waits until the groups written
# since the last one number at least 1/COMMIT_SHARE of those the run has committed: the first groups
# commit one by one, later commits grow geometrically, every batch's entry is written about
# COMMIT_SHARE times in all (linear in the corpus), and a crash loses at most that share of the run.
COMMIT_SHARE = 16
# Each lane's first group is this many times smaller: a group is one slice on the device, queued
# once all of it is tokenised, and the lanes start together, so full-sized first groups kept the
# GPU idle at the start of a run while the first full groups were tokenised.
FIRST_GROUP_SHRINK = 4


class LaneError(RuntimeError):
    """A lane failed; the message names the lane, its device and the lane's traceback."""


@dataclass
class LaneConfig:
    """What every lane is given (pickled into each spawned lane process)."""

    store_root: str
    name: str
    make_model: Callable[
        [str], Any
    ]  # device -> the embedding model on it (picklable: a module-level function or partial)
    tokenizer_dir: str
    layout: Any  # the model's TokenLayout: the tokenising workers start before the model loads
    chunk_tokens: int
    workers: int = 4  # tokenising processes per lane
    chunk_batch: int = LANE_CHUNK_BATCH
    block_chars: int = 128 << 10  # text per tokenising job (~32K tokens of English prose)
    depth: int = 2
    worker_nice: int = LANE_WORKER_NICE


@dataclass
class LaneStats:
    lanes: int = 0
    devices: list[str] = field(default_factory=list)
    commits: int = 0
    documents: int = 0
    chunks: int = 0
    tokens: int = 0
    encoder_tokens: int = 0
    startup_seconds: float = 0.0  # lanes spawned to every lane ready (models loaded, workers up)
    # Each lane's start: seconds from spawn to ready, of which model_seconds forking the workers and
    # loading the model, warm_up_seconds making its chunk encoder ready (warm_shapes captured), then
    # workers_after_model_seconds waiting for the workers (the rest: the process's start and imports).
    lane_startup: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0  # every lane ready (groups sent from then) to the last commit
    total_seconds: float = 0.0  # lanes spawned to the last commit: what the caller waits
    commit_seconds: float = 0.0  # the caller's manifest writes
    per_lane: list[dict[str, Any]] = field(default_factory=list)  # each lane's IndexStats summary

    def summary(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def lanes_on(devices: Sequence[str], per_device: int | None = None) -> list[str]:
    """One device name per lane: ``per_device`` lanes on each (None: LANES_PER_GPU on a GPU, 1 on
    the CPU)."""

    def count(device: str) -> int:
        return per_device or (LANES_PER_GPU if device.startswith("cuda") else 1)

    return [d for d in devices for _ in range(count(d))]


def commit_chars_for(commit_chunks: int, chunk_tokens: int) -> int:
    """A lane's group size in characters for groups of about ``commit_chunks`` full chunks (lanes
    cut groups before tokenising, so by characters)."""
    return commit_chunks * chunk_tokens * CHARS_PER_TOKEN


# ---------------------------------------------------------------------------------------------
# The lane process


def _worker_context():
    """Fork where there is fork: the workers inherit the lane's imports (and all of them start at
    the pool's first submit, before the lane starts CUDA); elsewhere the platform's default."""
    return mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None


class _Stopped(Exception):
    """The caller stopped the run (another lane failed, or the input did)."""


def _get(q, parent: int):
    """``q.get()`` that gives up when the caller is gone (a lane must never outlive it)."""
    while True:
        try:
            return q.get(timeout=POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
                raise _Stopped("the indexing process is gone") from None


def _tokenised_groups(pool, inbox, cfg: LaneConfig, parent: int, keys: deque, report, first) -> Iterator[Group]:
    """The lane's groups (``first``: the first message, already read), each handed on as soon as its
    tokenising jobs are queued in the lane's workers: the feeder embeds its blocks as they come
    (Group.pending). Handing on whole tokenised groups made every group wait for its last block, the
    device idle meanwhile. The group's chunk count goes to the caller once its workers are done."""
    msg = first
    while msg is not None:
        k, docs = msg
        futures = [
            pool.submit(prepare_block, [(d.id, d.text) for d in b], cfg.chunk_tokens)
            for b in blocks_of(docs, cfg.block_chars)
        ]
        report_count_when_done(futures, lambda n, k=k: report(("count", k, n)))
        keys.append(k)
        yield Group(
            docs=[Document(d.id, "") for d in docs], pending=_gathered(futures)
        )  # the texts live on in the chunks
        msg = _get(inbox, parent)


def report_count_when_done(futures: Sequence[Future], report: Callable[[int], None]) -> None:
    """``report(chunks)`` once every one of a group's tokenising jobs has succeeded (from the thread
    that completes the last; never after a failure or a cancel: the group's feeder raises those).
    Counted when the lane's feeder took the group's last block, a lane's writes could wait for
    other lanes' GPU work (a group's files are written once the counts of every group before it
    are in), tying every lane to the slowest."""
    left = [len(futures), 0]  # jobs not done, chunks so far
    lock = threading.Lock()

    def done(f: Future) -> None:
        if f.cancelled() or f.exception() is not None:
            return
        with lock:
            left[0] -= 1
            left[1] += len(f.result()[4])  # pack_chunks's lengths: one per chunk
            finished = left[0] == 0
        if finished:
            report(left[1])

    if not futures:
        report(0)
    for f in futures:
        f.add_done_callback(done)


def _gathered(futures: Sequence[Future]) -> Iterator[tuple[list, list[np.ndarray]]]:
    """A group's blocks from the workers, in order."""
    for f in futures:
        yield unpack_chunks(f.result())


def _lane(i: int, device: str, cfg: LaneConfig, inbox, control, outbox, parent: int) -> None:
    """A lane's process: tokenise, embed and write the groups it is sent (see the module doc)."""
    import importlib

    import torch

    importlib.import_module("qrag.retrieval.embedder")  # what a worker's tokenizer needs: imported once here, inherited

    def report(msg: tuple) -> None:
        outbox.put((msg[0], i, *msg[1:]))

    try:
        # The workers fork before this process touches its GPU (a forked CUDA context is unusable),
        # all of them at the first submit (the fork start method), with the modules imported above:
        # each worker importing torch and transformers itself, then the model loading only once
        # every worker was up, made a lane's start many times longer.
        t_fork = time.perf_counter()
        pool = ProcessPoolExecutor(
            cfg.workers,
            mp_context=_worker_context(),
            initializer=init_worker,
            initargs=(cfg.tokenizer_dir, cfg.layout, 64, cfg.worker_nice, os.getpid()),  # die with the lane
        )
        workers_up = [pool.submit(int, 0) for _ in range(cfg.workers)]
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(pick_device(device))
        model = cfg.make_model(device)  # while the workers load their tokenizers
        t_model = time.perf_counter()
        # The chunk encoder made ready now, not inside the indexing (GraphedEncoder.warm_up_sorted).
        warm = getattr(model, "warm_up_chunks", None)
        shapes = warm(cfg.chunk_tokens) if warm is not None else 0
        t_warm = time.perf_counter()
        for f in workers_up:
            f.result()
        store = CorpusStore(cfg.store_root, clean=False)  # the caller holds the lock and cleaned already
        fixed = store.read(cfg.name)  # name, shards, dim, dtype: what writing a batch needs
        t_ready = time.perf_counter()
        report(
            (
                "ready",
                model.fingerprint,
                {
                    "model_seconds": round(t_model - t_fork, 3),
                    "warm_up_seconds": round(t_warm - t_model, 3),
                    "warm_shapes": shapes,
                    "workers_after_model_seconds": round(t_ready - t_warm, 3),
                },
            )
        )
        keys: deque = deque()
        starts: dict[int, tuple[int, int]] = {}

        def append(group: Group, vectors: np.ndarray) -> None:
            k = keys.popleft()
            while k not in starts:
                msg = _get(control, parent)
                if msg is None:
                    raise _Stopped("stopped by the indexing process")
                starts[msg[0]] = (msg[1], msg[2])
            batch_id, first = starts.pop(k)
            batch = store.write_batch_files(
                fixed, batch_id, first, group.docs, group.chunks, group.ids, vectors, fingerprint=model.fingerprint
            )
            report(("written", k, batch, sum(len(x) for x in group.ids)))

        # The lane's figures start with its first group, not while the other lanes are starting.
        first = _get(inbox, parent)
        try:
            _, stats = index_groups(
                store,
                cfg.name,
                model,
                _tokenised_groups(pool, inbox, cfg, parent, keys, report, first),
                chunk_batch=cfg.chunk_batch,
                depth=cfg.depth,
                append=append,
            )
        finally:  # after a failure: the groups queued ahead are not tokenised for nothing
            pool.shutdown(wait=True, cancel_futures=True)
        graphed = getattr(model, "chunk_encoder", None)  # CUDA-graph replays of the chunk encoder, where it has them
        graphs = (
            {"graph_replays": graphed.replays, "eager_calls": graphed.eager_calls}
            if hasattr(graphed, "replays")
            else {}
        )
        if torch.device(device).type == "cuda":  # several lanes share a GPU's memory
            graphs["max_memory_reserved_gib"] = round(torch.cuda.max_memory_reserved(torch.device(device)) / 2**30, 2)
        report(("done", {**stats.summary(), **graphs}, stats.started_at))
    except _Stopped:
        report(("stopped",))
    except BaseException as exc:  # noqa: BLE001 - raised in the caller
        report(("error", picklable_error(exc), traceback.format_exc()))


# ---------------------------------------------------------------------------------------------
# The caller


class _Run:
    """The caller's side of one run: positions in group order, commits in group order."""

    def __init__(
        self, store: CorpusStore, m: Manifest, devices: Sequence[str], on_commit: Callable[[Manifest], None] | None
    ):
        self.store, self.m, self.on_commit = store, m, on_commit
        self.counts: dict[int, tuple[int, int]] = {}  # group -> (chunks, its lane)
        self.written: dict[int, tuple[Batch, int]] = {}  # group -> (its written batch, encoder tokens)
        self.ready: list[tuple[Batch, int]] = []  # written groups next in order, not committed yet
        self.next_start = 0  # the next group to be told where it starts
        self.next_commit = 0
        self.first = m.chunks
        self.base_id = m.last_batch_id
        self.last_commit: float | None = None
        self.stats = LaneStats(lanes=len(devices), devices=[str(d) for d in devices])

    def count(self, k: int, n: int, lane: int, control: Sequence) -> None:
        """Group ``k`` (sent to ``lane``) holds ``n`` chunks: tell it where it starts once every
        group before it is counted."""
        self.counts[k] = (n, lane)
        while self.next_start in self.counts:
            k0 = self.next_start
            n0, lane0 = self.counts.pop(k0)
            control[lane0].put((k0, self.base_id + 1 + k0, self.first))
            self.first += n0
            self.next_start += 1

    def wrote(self, k: int, batch: Batch, encoder_tokens: int) -> None:
        """Group ``k``'s files are written: commit it, in group order, once enough are ready (COMMIT_SHARE)."""
        self.written[k] = (batch, encoder_tokens)
        while self.next_commit in self.written:
            self.ready.append(self.written.pop(self.next_commit))
            self.next_commit += 1
            if len(self.ready) * COMMIT_SHARE >= self.next_commit - len(self.ready):
                self.flush()

    def flush(self) -> None:
        """Commit the written groups that are next in order, in one manifest write (at the end of a
        run, and after a failure: the groups before it are whole)."""
        if not self.ready:
            return
        t0 = time.perf_counter()
        self.store.commit_written(self.m, *(batch for batch, _ in self.ready))
        self.stats.commit_seconds += time.perf_counter() - t0
        self.stats.commits += 1
        for batch, enc in self.ready:
            self.stats.documents += batch.documents
            self.stats.chunks += batch.chunks
            self.stats.tokens += batch.tokens
            self.stats.encoder_tokens += enc
        self.ready.clear()
        self.last_commit = time.perf_counter()
        if self.on_commit is not None:
            self.on_commit(self.m)


def index_in_lanes(
    store: CorpusStore,
    name: str,
    docs: Iterable[Document],
    cfg: LaneConfig,
    devices: Sequence[str],
    *,
    commit_chars: int = 4 << 20,
    resume: bool = False,
    on_commit: Callable[[Manifest], None] | None = None,
) -> tuple[Manifest, LaneStats]:
    """Embed and commit ``docs`` into corpus ``name`` with one lane per device (see the module
    doc). ``resume``: documents the corpus holds are skipped (else they are an error, as for
    ``CorpusStore.append``). ``on_commit(manifest)`` after every commit. Returns the last
    manifest and the run's figures."""
    if not devices:
        raise ValueError("index_in_lanes needs at least one device")
    ctx = mp.get_context("spawn")  # a lane starts CUDA itself; fork would copy the caller's
    n = len(devices)
    with store.hold(name) as m:
        existing = set(store.doc_ids(m))
        run = _Run(store, m, devices, on_commit)
        outbox = ctx.Queue()
        inboxes = [ctx.Queue(maxsize=cfg.depth) for _ in range(n)]
        controls = [ctx.Queue() for _ in range(n)]
        procs = [
            ctx.Process(
                target=_lane, args=(i, str(d), cfg, inboxes[i], controls[i], outbox, os.getpid()), name=f"qrag-lane-{i}"
            )
            for i, d in enumerate(devices)
        ]  # not daemonic: a lane has worker processes
        t_spawn = time.perf_counter()
        for p in procs:
            p.start()
        stop = threading.Event()
        failure: list[BaseException] = []
        sender = threading.Thread(
            target=_send,
            args=(docs, existing, resume, name, commit_chars, inboxes, stop, failure),
            name="qrag-lanes-send",
            daemon=True,
        )
        finished: set[int] = set()
        ready = 0
        t_ready = None
        try:
            while len(finished) < n:
                try:
                    msg = outbox.get(timeout=POLL_S)
                except queue.Empty:
                    dead = [i for i, p in enumerate(procs) if i not in finished and not p.is_alive()]
                    if dead:
                        i = dead[0]
                        raise LaneError(
                            f"lane {i} ({devices[i]}) exited with code {procs[i].exitcode} without a word"
                        ) from None
                    continue  # a failure of the input ends the inboxes itself: the groups before it are committed
                kind, i = msg[0], msg[1]
                if kind == "ready":
                    if msg[2] != m.fingerprint:
                        raise CorpusConflict(
                            f"corpus {name!r} was indexed with model {m.fingerprint}; lane {i} has {msg[2]}"
                        )
                    ready += 1
                    run.stats.lane_startup.append(
                        {"lane": i, "seconds": round(time.perf_counter() - t_spawn, 3), **msg[3]}
                    )
                    if ready == n:
                        # Groups go out once every lane is ready: a lane ready earlier would index
                        # alone meanwhile, and the run's rate would mix that in.
                        t_ready = time.perf_counter()
                        run.stats.startup_seconds = t_ready - t_spawn
                        sender.start()
                elif kind == "count":
                    run.count(msg[2], msg[3], i, controls)
                elif kind == "written":
                    run.wrote(msg[2], msg[3], msg[4])
                elif kind == "done":
                    finished.add(i)
                    # When the lane began its first group, from the moment groups went out
                    # (perf_counter: one clock for the machine)
                    begun = round(msg[3] - t_ready, 3) if t_ready is not None else None
                    run.stats.per_lane.append(
                        {"lane": i, "device": str(devices[i]), "started_after_ready": begun, **msg[2]}
                    )
                elif kind == "stopped":
                    finished.add(i)
                elif kind == "error":
                    finished.add(i)
                    if not failure:  # bad input or a refusal of the store names its record itself
                        user = isinstance(msg[2], (DataError, StoreError))
                        failure.append(
                            msg[2]
                            if user
                            else LaneError(
                                f"lane {i} ({devices[i]}) failed: {msg[2]}\n--- the lane's traceback ---\n{msg[3]}"
                            )
                        )
                    _stop(stop, inboxes, controls)
            # The run's last groups; after a failure, the whole groups written before it.
            if failure:
                with contextlib.suppress(Exception):  # the failure is the error to raise
                    run.flush()
            else:
                run.flush()
        except BaseException:
            _stop(stop, inboxes, controls)
            with contextlib.suppress(Exception):  # the error to raise is the one that got here
                run.flush()
            _end(procs)
            raise
        _end(procs)
        if failure:
            raise failure[0]
        run.stats.per_lane.sort(key=lambda row: row["lane"])
        # To the last commit, not to the lanes' exit: tearing down a process's CUDA context and
        # workers takes seconds, which is no indexing.
        end = run.last_commit or time.perf_counter()
        run.stats.seconds = end - (t_ready or t_spawn)
        run.stats.total_seconds = end - t_spawn
        return m, run.stats


def _send(
    docs: Iterable[Document],
    existing: set[str],
    resume: bool,
    name: str,
    commit_chars: int,
    inboxes: Sequence,
    stop: threading.Event,
    failure: list[BaseException],
) -> None:
    """The sender thread: each group to the next lane with room in its inbox (round robin while the
    lanes keep pace; a lane that falls behind gets fewer), then an end mark to each."""
    seen = set(existing)

    def fresh() -> Iterator[Document]:
        for doc in docs:
            if doc.id in seen:
                if resume and doc.id in existing:
                    continue
                raise CorpusConflict(f"document id {doc.id!r} is already in corpus {name!r}")
            seen.add(doc.id)
            yield doc

    try:
        lane = -1
        first_chars = max(1, commit_chars // FIRST_GROUP_SHRINK)
        for k, group in enumerate(
            char_groups(fresh(), commit_chars, first_groups=len(inboxes), first_chars=first_chars)
        ):
            lane = put_where_room(inboxes, (k, group), lane + 1, stop)
            if lane is None:
                return
    except BaseException as exc:  # noqa: BLE001 - raised by the caller's loop
        failure.append(exc)
    finally:
        for box in inboxes:
            while True:  # a full inbox empties unless its lane is gone (then stop is set)
                try:
                    box.put(None, timeout=POLL_S)
                    break
                except queue.Full:
                    if stop.is_set():
                        break


def put_where_room(boxes: Sequence, item: Any, first: int, stop: threading.Event, poll_s: float = 0.005) -> int | None:
    """Put ``item`` in the first of ``boxes`` with room, looking from ``first`` round; wait while
    all are full. Returns the box's index, or None once ``stop`` is set. Dealt strictly round
    robin, the sender blocked on one full inbox while the other lanes could run dry (lanes on one
    GPU get its time unevenly; two GPUs' lanes start apart)."""
    n = len(boxes)
    while not stop.is_set():
        for j in range(n):
            i = (first + j) % n
            try:
                boxes[i].put_nowait(item)
                return i
            except queue.Full:
                continue
        time.sleep(poll_s)
    return None


def _stop(stop: threading.Event, inboxes: Sequence, controls: Sequence) -> None:
    """No more groups, no more positions: lanes end after the groups they hold (never committed).
    Groups still on their way to a lane that has ended are dropped: this process must not wait at
    its exit for a pipe nobody reads (a group is larger than a pipe's buffer; after a lane failed
    on a GPU machine the benchmark's process hung there for minutes)."""
    if stop.is_set():
        return
    stop.set()
    for box in (*inboxes, *controls):
        box.cancel_join_thread()
        try:
            box.put_nowait(None)
        except queue.Full:
            pass


def _end(procs: Sequence) -> None:
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.terminate()
            p.join()
