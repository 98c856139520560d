"""The store appends of an indexing pipeline in a process of its own.

Indexing on a GPU, the main process's three threads (gathering tokenised input, feeding the GPU,
writing the store) were each busy most of the wall time under one GIL, so they held each other up
(docs/benchmarks.md, "Indexing"). :class:`ChildWriter` does the
writer's work (JSON text lines, safetensors, hashes, fsync) in a child process; the pipeline's
writer thread (:class:`qrag.index.pipeline._Writer`: order, backpressure, no write after a
failure) only pickles each batch onto a pipe, as a few flat objects (:func:`pack_batch`), and
waits for the child's answer.

The child is ``python -m qrag.index.writer_process``: it imports the store alone (no torch, and not
the caller's ``__main__``, which multiprocessing's spawn would run again). Messages are pickles
on its stdin and stdout. A child that dies is an error naming its exit code, never a hang.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, BinaryIO


def picklable_error(exc: BaseException) -> BaseException:
    """``exc`` if it crosses a process boundary intact, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - whatever it was, the caller gets its type and message
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def pack_batch(docs, chunks, ids, vectors) -> tuple:
    """A batch as a few flat objects (:func:`qrag.data.documents.pack_chunks`): pickling a commit
    group's ``DocumentChunk``s and token arrays one by one cost this process about as much as the
    writing it was to take off it; packed, a fraction of that."""
    from qrag.data.documents import pack_chunks

    return docs, pack_chunks(chunks, ids), vectors


def unpack_batch(packed: tuple) -> tuple:
    """:func:`pack_batch`'s input again: (docs, chunks, token id arrays, vectors)."""
    from qrag.data.documents import unpack_chunks

    docs, chunks, vectors = packed
    return (docs, *unpack_chunks(chunks), vectors)


# Sent by ChildWriter.close. End of file alone is not enough: a process forked from the caller
# after the child started (a fork-started ProcessPoolExecutor grows its workers on demand) holds
# the write end of the child's stdin, so the child saw no EOF until the pool shut down, and
# close() waited out its timeout and killed it.
STOP = "stop"


def serve(root: str, name: str, fingerprint: str, inbox: BinaryIO, outbox: BinaryIO) -> None:
    """The child's loop: a packed batch in, ("ok", manifest) or ("error", exception) out;
    :data:`STOP` or end of file ends it."""
    from qrag.index.store import CorpusStore

    store = CorpusStore(root, clean=False)  # the caller's store already cleaned what a crash left
    while True:
        try:
            packed = pickle.load(inbox)
        except EOFError:  # the caller is gone
            return
        if isinstance(packed, str) and packed == STOP:
            return
        try:
            reply = ("ok", store.append(name, *unpack_batch(packed), fingerprint))
        except BaseException as exc:  # noqa: BLE001 - raised in the caller
            reply = ("error", picklable_error(exc))
        pickle.dump(reply, outbox, protocol=pickle.HIGHEST_PROTOCOL)
        outbox.flush()


class ChildWriter:
    """``store.append(name, ...)`` done by a child process, one batch at a time."""

    def __init__(self, store_root: Path, name: str, fingerprint: str):
        env = dict(os.environ)
        here = str(Path(__file__).resolve().parents[2])  # the folder holding the qrag package
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qrag.index.writer_process", str(store_root), name, fingerprint],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )

    def append(self, docs, chunks, ids, vectors) -> Any:
        """The committed manifest; the child's exception if the store refused the batch."""
        packed = pack_batch(docs, chunks, ids, vectors)
        try:
            pickle.dump(packed, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.flush()
            kind, payload = pickle.load(self.proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError):
            raise RuntimeError(
                f"the index writer process exited with code {self.proc.wait()}; "
                "the corpus is committed up to the last whole batch"
            ) from None
        if kind == "error":
            raise payload
        return payload

    def close(self) -> None:
        try:
            pickle.dump(STOP, self.proc.stdin)
            self.proc.stdin.close()
        except OSError:  # the child is gone already
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], sys.argv[3], sys.stdin.buffer, sys.stdout.buffer)
