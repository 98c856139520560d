"""The store writer of an indexing pipeline in a process of its own.

Indexing 10M tokens on one H100, the main process's three threads (gathering tokenised input,
feeding the GPU, writing the store) were busy 4.4, 3.8 and 3.5 s within 5.3 s of wall time, under
one GIL (bench/results/README.md, "Indexing 10M tokens, rounds 2-5"). Here the writer's work
(JSON text lines, safetensors, hashes, fsync) runs in a child process; the main process only
pickles each batch onto a pipe, as a few flat objects (:func:`pack_batch`).

The child is ``python -m qrag.index.writer_process``: it imports the store alone (no torch, and not
the caller's ``__main__``, which multiprocessing's spawn would run again). Messages are pickles
on its stdin and stdout. It appends batches in the order given, as the writer thread does; after a
failure it writes nothing more (later batches are answered "skipped"), and the failure is raised
in the caller. If the child dies, the caller gets an error naming its exit code, never a hang.
"""

from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

_STOP = None


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.dumps(exc)
        return exc
    except Exception:  # noqa: BLE001 - whatever it was, the caller gets its type and message
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def pack_batch(docs, chunks, ids, vectors) -> tuple:
    """A batch as a few flat objects. Pickling ~16K ``DocumentChunk``s and token arrays one by one
    took 226 ms per commit group on this VM (2.9 s per 10M tokens: as long as the writing it was to
    take off this process); texts, document ids, counts and one flat id array take 33 ms."""
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    flat = np.concatenate([np.asarray(x).reshape(-1) for x in ids]) if len(ids) else np.zeros(0, np.int32)
    return (docs, [c.doc_id for c in chunks], [c.text for c in chunks], np.fromiter((c.tokens for c in chunks), dtype=np.int64, count=len(chunks)),
            flat, lengths, vectors)


def unpack_batch(packed: tuple) -> tuple:
    """:func:`pack_batch`'s input again: (docs, chunks, token id arrays, vectors)."""
    from qrag.data.documents import DocumentChunk

    docs, doc_ids, texts, counts, flat, lengths, vectors = packed
    chunks = [DocumentChunk(d, t, n) for d, t, n in zip(doc_ids, texts, counts.tolist())]
    ids = np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else []
    return docs, chunks, ids, vectors


def serve(root: str, name: str, fingerprint: str, inbox: BinaryIO, outbox: BinaryIO) -> None:
    """The child's loop: (docs, chunks, token ids, vectors) in, ("ok", manifest, seconds) or
    ("error", exception, seconds) or ("skipped", None, 0) out, ("done", None, 0) at the end."""
    from qrag.index.store import CorpusStore

    store = CorpusStore(root, clean=False)  # the caller's store already cleaned what a crash left
    failed = False

    def reply(*message: Any) -> None:
        pickle.dump(message, outbox, protocol=pickle.HIGHEST_PROTOCOL)
        outbox.flush()

    while True:
        try:
            item = pickle.load(inbox)
        except EOFError:  # the caller went away
            return
        if item is _STOP:
            reply("done", None, 0.0)
            return
        if failed:
            reply("skipped", None, 0.0)
            continue
        t0 = time.perf_counter()
        try:
            manifest = store.append(name, *unpack_batch(item), fingerprint)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller
            failed = True
            reply("error", _picklable(exc), time.perf_counter() - t0)
        else:
            reply("ok", manifest, time.perf_counter() - t0)


class ProcessWriter:
    """The pipeline's writer stage (:class:`qrag.index.pipeline._Writer`'s interface) with the
    appends done by a child process. ``committed(group, manifest)`` runs in this process, on a
    receiving thread, in order; ``stats`` gets ``write_seconds`` (the child's append time) and
    ``embed_waiting_for_writer`` (time :meth:`put` was held back)."""

    def __init__(self, store_root: Path, name: str, fingerprint: str, committed: Callable[[Any, Any], None], depth: int, stats):
        self.committed, self.stats = committed, stats
        env = dict(os.environ)
        here = str(Path(__file__).resolve().parents[2])  # the folder holding the qrag package
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen([sys.executable, "-m", "qrag.index.writer_process", str(store_root), name, fingerprint],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.outgoing: queue.Queue = queue.Queue(maxsize=depth)
        self.pending: deque = deque()  # groups sent, not yet answered
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.closed = False
        self.sender = threading.Thread(target=self._send, name="qrag-index-writer-send", daemon=True)
        self.receiver = threading.Thread(target=self._receive, name="qrag-index-writer-receive", daemon=True)
        self.sender.start()
        self.receiver.start()

    def _send(self) -> None:
        while True:
            item = self.outgoing.get()
            try:
                pickle.dump(item, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):  # the child died: the receiver reports it
                return
            if item is _STOP:
                return

    def _receive(self) -> None:
        while True:
            try:
                kind, payload, seconds = pickle.load(self.proc.stdout)
            except (EOFError, OSError, pickle.UnpicklingError):
                code = self.proc.wait()
                with self.lock:
                    if self.error is None and (self.pending or not self.closed):
                        self.error = RuntimeError(f"the index writer process exited with code {code}, "
                                                  f"{len(self.pending)} batch(es) unwritten; the corpus is committed up to the last whole batch")
                return
            if kind == "done":
                return
            with self.lock:
                group = self.pending.popleft()
            self.stats.write_seconds += seconds
            if kind == "ok":
                try:
                    self.committed(group, payload)
                except BaseException as exc:  # noqa: BLE001 - an on_commit callback's failure, raised in the caller
                    with self.lock:
                        self.error = self.error or exc
            elif kind == "error":
                with self.lock:
                    self.error = self.error or payload

    def _raise(self) -> None:
        if self.error is not None:
            self.close()
            raise self.error

    def put(self, item) -> None:
        group, vectors = item
        packed = pack_batch(group.docs, group.chunks, group.ids, vectors)
        t0 = time.perf_counter()
        try:
            while True:
                self._raise()
                try:
                    with self.lock:
                        self.pending.append(group)
                    self.outgoing.put(packed, timeout=0.05)
                    return
                except queue.Full:
                    with self.lock:
                        self.pending.pop()
                    if not self.receiver.is_alive():  # the child is gone: _raise has its error next round
                        continue
        finally:
            self.stats.embed_waiting_for_writer += time.perf_counter() - t0

    def close(self) -> None:
        """Write what was handed over (unless a write failed), then stop the child."""
        if self.closed:
            return
        self.closed = True
        while self.receiver.is_alive():
            try:
                self.outgoing.put(_STOP, timeout=0.05)
                break
            except queue.Full:
                continue
        self.receiver.join()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def finish(self) -> None:
        self.close()
        if self.error is not None:
            raise self.error


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], sys.argv[3], sys.stdin.buffer, sys.stdout.buffer)
