"""A shard's approximate FAISS index (HNSW for host shards, the candidate stage's IVF of
:mod:`qrag.index.ann`) saved beside its segments and loaded at start.

Building HNSW or training an inverted file over millions of vectors takes minutes; a replica that
restarts, or a second replica of the same corpus, loads the saved index instead. Flat inner-product
indexes are not saved: they are a copy of the vectors the shard has just loaded, rebuilt at memory
speed.

Files: ``<corpus>/faiss/<name>_NNN.index`` (faiss.serialize_index; name ``shard`` for HNSW, ``ann``
for the candidate stage) and ``<name>_NNN.json``, written after it: the corpus uid, the (batch id,
vectors sha256) pairs the index covers, in order, its rows, how it was built (HNSW's M, the
candidate index's kind and sizes) and the index file's sha256. A saved index is used only when all
of that matches what the shard loaded (a prefix of its batches: rows appended since are added on
top); anything else (another corpus with the same name, re-embedded vectors, a torn or corrupt
file) is ignored and the index is built again. The files sit outside ``shard_*/``, so a store's
stray-file cleaning leaves them, and deleting the corpus removes them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from qrag.index.store import write_atomic


def _paths(folder: Path, shard: int, name: str) -> tuple[Path, Path]:
    return folder / f"{name}_{shard:03d}.index", folder / f"{name}_{shard:03d}.json"


def save_index(
    data: bytes,
    rows: int,
    folder: Path,
    shard: int,
    uid: str,
    batches: list[tuple[int, str]],
    build: int | str,
    name: str = "shard",
) -> bool:
    """Write ``data`` (a serialised index of ``rows`` rows, covering ``batches``) for ``shard``: the
    index file first, then its description, each atomically, so a reader never pairs a description
    with another file. Best effort: on a read-only or full disk nothing is saved (False) and the
    shard serves on."""
    path, meta = _paths(folder, shard, name)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data, durable=False)  # a lost index is rebuilt, never wrong: no fsync needed
        write_atomic(
            meta,
            json.dumps(
                {
                    "uid": uid,
                    "batches": [list(b) for b in batches],
                    "rows": int(rows),
                    "build": build,
                    "sha256": hashlib.sha256(data).hexdigest(),
                }
            ).encode(),
            durable=False,
        )
    except OSError:
        return False
    return True


def load_index(
    faiss: Any,
    folder: Path,
    shard: int,
    uid: str,
    loaded: list[tuple[int, str]],
    build: int | str,
    name: str = "shard",
) -> tuple[Any, int, int] | None:
    """The saved index of ``shard``, its rows and how many of the ``loaded`` batches it covers,
    when it belongs to this corpus (``uid``), covers a prefix of ``loaded`` with the same vectors,
    and was built as ``build`` says; else None."""
    path, meta = _paths(folder, shard, name)
    try:
        info = json.loads(meta.read_text())
        covered = [tuple(b) for b in info["batches"]]
        if info["uid"] != uid or info["build"] != build or covered != [tuple(b) for b in loaded[: len(covered)]]:
            return None
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != info["sha256"]:
            return None
        index = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
    except (OSError, ValueError, KeyError, TypeError, RuntimeError):
        return None  # missing, torn or foreign: build it again
    return (index, int(info["rows"]), len(covered)) if index.ntotal == info["rows"] else None
