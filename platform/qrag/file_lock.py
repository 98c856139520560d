"""An exclusive lock on a file, shared by the processes of one machine (POSIX ``flock``): the
corpus writer lock, indexing-job admission and the first opening of a SQLite MLflow store."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def file_lock(path: str | Path, blocking: bool = True) -> Iterator[bool]:
    """Hold ``path``'s lock (the file is created if missing) for the block. Non-blocking: yields
    False at once when another process holds it."""
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
