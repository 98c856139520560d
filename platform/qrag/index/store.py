"""Corpora on disk: manifest, append batches, shards; atomic commits and integrity checks.

On disk, one directory per corpus under a storage root::

    corpus.json                          the manifest: model fingerprint, positions, counts, and
                                         per append batch the files of every shard + sha256 sums
    docs/batch_000001.jsonl              the batch's documents (id, chunks, tokens)
    shard_000/batch_000001.safetensors   vectors [n, d] (float16|float32), global positions,
                                         chunk token ids (flat + offsets)
    shard_000/batch_000001.jsonl         one line per chunk: position, document id, text

A batch is committed by atomically replacing corpus.json once all its files are written: each
file is fsynced, renamed into place and its directory fsynced, then the manifest is written,
fsynced, renamed and its directory fsynced, and only then is the write acknowledged. A crash
(SIGKILL, or a power loss that drops unsynced writes) at any step leaves the previous version
whole, and the next open or write removes stray files and temp files; :func:`fault_point` marks
every step, so tests stop a process at each one. Global chunk positions follow corpus order
(documents as given, chunks in document order); chunk g lives in shard g % S at row g // S, so a
shard holds every part of the corpus and appends keep the shards balanced.

Every write that started on one corpus names its generation (``Manifest.uid``) and is refused
(:class:`CorpusChanged`) when the corpus was deleted and created again meanwhile, checked under the
corpus lock when it commits. A re-index writes the new vectors of every segment beside the current
ones (``next`` in the manifest, so a crash keeps them and a restarted re-index resumes) and swaps
them all in one manifest commit: the corpus opens at the old model or the new one, never a mix.

JSONL files hold one JSON record per line; strings keep their characters, except the few that JSON
leaves raw but some readers (``str.splitlines()``) end a line at, which are written as escapes, and
readers split lines at newline bytes only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from qrag.config import ModelConfig, from_dict, to_dict
from qrag.file_lock import file_lock
from qrag.data.documents import Document, DocumentChunk, normalize_id

FORMAT_VERSION = 1
PARALLEL_SHARD_WRITES_FROM = 2048  # chunks in a batch; smaller ones (HTTP appends) stay in the calling thread
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # fullmatch: "$" would let "books\n" in
DTYPES = ("float32", "float16")


class StoreError(ValueError):
    """A corpus that cannot be read or written; the message names the corpus and the file."""


class CorpusNotFound(StoreError):
    pass


class CorpusConflict(StoreError):
    """The request contradicts the corpus (exists already, duplicate document, other model)."""


class CorpusChanged(CorpusConflict):
    """The corpus a write started on was deleted and created again before the write committed."""


# ---------------------------------------------------------------------------------------------
# Crash points

FAULT_ENV = "QRAG_FAULT_POINT"  # "N": the process kills itself (SIGKILL) at its N-th fault point
_fault_hook: Callable[[str], None] | None = None


def fault_point(name: str) -> None:
    """A step of a write (before and after each write, fsync, rename and removal) at which a crash
    must leave every corpus and job record whole: crash tests stop the process here."""
    if _fault_hook is not None:
        _fault_hook(name)


def set_fault_hook(hook: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """Call ``hook(point)`` at every fault point from now on (None: nothing); returns the previous hook."""
    global _fault_hook
    previous, _fault_hook = _fault_hook, hook
    return previous


def kill_at(n: int) -> Callable[[str], None]:
    """A hook that SIGKILLs this process at its ``n``-th fault point (1-based)."""
    seen = 0

    def hook(name: str) -> None:
        nonlocal seen
        seen += 1
        if seen == n:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def fault_hook_from_env(environ: Mapping[str, str] = os.environ) -> None:
    """Arm :func:`kill_at` when ``$QRAG_FAULT_POINT`` is set (a crash test's child process)."""
    spec = environ.get(FAULT_ENV, "").strip()
    if not spec:
        return
    if not spec.isdigit() or int(spec) < 1:
        raise ValueError(f"${FAULT_ENV} must be a positive integer (the fault point to die at), got {spec[:40]!r}")
    set_fault_hook(kill_at(int(spec)))


fault_hook_from_env()


# ---------------------------------------------------------------------------------------------
# The manifest


# corpus.json is Manifest.to_json(): the corpus's fields, its batches (Batch), each with one
# segment per shard (SegmentFiles: vectors and texts as FileRef, ``next`` a StagedVectors while a
# re-index has staged it), and ``reindex`` (Reindex) while one is under way. The classes write the
# keys in the order, and with the omissions ("job", "next"), of every manifest written so far.


def _fields(data: object, kind: str, types: dict[str, type]) -> dict[str, Any]:
    """``data`` as a JSON object whose ``types`` keys hold their types; a TypeError says which
    (read() turns it into "corpus.json is unreadable")."""
    if not isinstance(data, dict):
        raise TypeError(f"a {kind} is not a JSON object")
    for key, t in types.items():
        # bool is an int to isinstance, never a count or an id here
        if key not in data or not isinstance(data[key], t) or (isinstance(data[key], bool) and t is int):
            raise TypeError(f"a {kind} has no {key!r} of the right type")
    return data


@dataclass(frozen=True)
class FileRef:
    """A file of the corpus (relative to its directory) and the sha256 of its bytes."""

    file: str
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "sha256": self.sha256}

    @classmethod
    def from_json(cls, data: object) -> FileRef:
        d = _fields(data, "file entry", {"file": str, "sha256": str})
        return cls(d["file"], d["sha256"])


@dataclass(frozen=True)
class StagedVectors:
    """A segment's vectors from a re-index's model, written beside the current ones (``next`` in
    the manifest) until the re-index swaps every segment in at once."""

    fingerprint: str
    vectors: FileRef

    def to_json(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "vectors": self.vectors.to_json()}

    @classmethod
    def from_json(cls, data: object) -> StagedVectors:
        d = _fields(data, "staged segment", {"fingerprint": str})
        return cls(d["fingerprint"], FileRef.from_json(d.get("vectors")))


@dataclass(frozen=True)
class SegmentFiles:
    """One batch's rows in one shard: their vectors (from model ``fingerprint``) and texts."""

    chunks: int
    fingerprint: str
    vectors: FileRef
    texts: FileRef
    next: StagedVectors | None = None  # while a re-index has staged this segment's new vectors

    def to_json(self) -> dict[str, Any]:
        out = {
            "chunks": self.chunks,
            "fingerprint": self.fingerprint,
            "vectors": self.vectors.to_json(),
            "texts": self.texts.to_json(),
        }
        return out if self.next is None else {**out, "next": self.next.to_json()}

    @classmethod
    def from_json(cls, data: object) -> SegmentFiles:
        d = _fields(data, "segment", {"chunks": int, "fingerprint": str})
        staged = d.get("next")
        return cls(
            d["chunks"],
            d["fingerprint"],
            FileRef.from_json(d.get("vectors")),
            FileRef.from_json(d.get("texts")),
            None if staged is None else StagedVectors.from_json(staged),
        )


@dataclass(frozen=True)
class Batch:
    """One committed append: chunks at global positions ``first``... of ``documents`` documents,
    the documents' file, and per shard the segment holding its rows there (shard s: g % S == s)."""

    id: int
    first: int
    chunks: int
    documents: int
    tokens: int
    docs: FileRef
    shards: tuple[SegmentFiles, ...]
    job: str | None = None  # the job that wrote it: a restarted server tells an interrupted job's fate

    def to_json(self) -> dict[str, Any]:
        out = {
            "id": self.id,
            "first": self.first,
            "chunks": self.chunks,
            "documents": self.documents,
            "tokens": self.tokens,
            "docs": self.docs.to_json(),
            "shards": [s.to_json() for s in self.shards],
        }
        return {**out, "job": self.job} if self.job else out  # written only when there is one (as ever)

    @classmethod
    def from_json(cls, data: object) -> Batch:
        d = _fields(
            data, "batch", {"id": int, "first": int, "chunks": int, "documents": int, "tokens": int, "shards": list}
        )
        job = d.get("job")
        if job is not None and not isinstance(job, str):
            raise TypeError("a batch's job is not a string")
        return cls(
            d["id"],
            d["first"],
            d["chunks"],
            d["documents"],
            d["tokens"],
            FileRef.from_json(d.get("docs")),
            tuple(SegmentFiles.from_json(s) for s in d["shards"]),
            job,
        )

    def with_segment(self, shard: int, segment: SegmentFiles) -> Batch:
        """This batch with ``shard``'s segment replaced (new vectors, staged or swapped in)."""
        return replace(self, shards=(*self.shards[:shard], segment, *self.shards[shard + 1 :]))

    def files(self) -> set[str]:
        """Every file this batch names (documents, texts, vectors, staged vectors of a re-index)."""
        out = {self.docs.file}
        for s in self.shards:
            out |= {s.vectors.file, s.texts.file} | ({s.next.vectors.file} if s.next is not None else set())
        return out


@dataclass(frozen=True)
class Reindex:
    """A re-index under way: the model it embeds with (``fingerprint``, ``dim``, the ModelConfig
    as a dict) and ``through``, the last batch it began with (those batches' segments all need
    new vectors; later ones only where they came from another model)."""

    fingerprint: str
    dim: int
    model: dict[str, Any]
    through: int

    def to_json(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "dim": self.dim, "model": self.model, "through": self.through}

    @classmethod
    def from_json(cls, data: object) -> Reindex:
        d = _fields(data, "re-index", {"fingerprint": str, "dim": int, "model": dict, "through": int})
        return cls(d["fingerprint"], d["dim"], d["model"], d["through"])


@dataclass
class Manifest:
    """corpus.json: the corpus's settings and counts, and its committed batches in order."""

    name: str
    uid: str  # a new uid per creation: caches never confuse a deleted corpus with its successor
    fingerprint: str  # of the encoders (and positions config) that made the vectors
    model: dict[str, Any]  # the ModelConfig: positions mode, RoPE base, δ, ℓ
    dim: int
    chunk_tokens: int
    shards: int
    dtype: str = "float32"
    version: int = 0
    documents: int = 0
    chunks: int = 0
    tokens: int = 0
    created: float = 0.0
    updated: float = 0.0
    batches: list[Batch] = field(default_factory=list)
    format_version: int = FORMAT_VERSION
    reindex: Reindex | None = None

    @property
    def model_cfg(self) -> ModelConfig:
        return from_dict(ModelConfig, self.model)

    @property
    def positions(self) -> str:
        return str(self.model.get("positions", "none"))

    @property
    def last_batch_id(self) -> int:
        return max((b.id for b in self.batches), default=0)

    def batch(self, batch_id: int) -> Batch | None:
        return next((b for b in self.batches if b.id == batch_id), None)

    def put_batch(self, batch: Batch) -> None:
        """Replace the batch of ``batch.id`` (its segments changed; not yet written)."""
        self.batches[next(i for i, b in enumerate(self.batches) if b.id == batch.id)] = batch

    def check_settings(self, **asked: Any) -> None:
        """CorpusConflict when a setting asked for (chunk_tokens, shards, dtype; None: any) is not the corpus's."""
        for key, value in asked.items():
            if value is not None and value != getattr(self, key):
                raise CorpusConflict(f"corpus {self.name!r} has {key} {getattr(self, key)}, not {value}")

    def summary(self) -> dict[str, Any]:
        keys = (
            "name",
            "fingerprint",
            "dim",
            "chunk_tokens",
            "shards",
            "dtype",
            "version",
            "documents",
            "chunks",
            "tokens",
            "created",
            "updated",
        )
        return {**{k: getattr(self, k) for k in keys}, "positions": self.positions, "batches": len(self.batches)}

    def to_json(self) -> dict[str, Any]:
        """corpus.json's object: the same keys, in the same order, as every version has written."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["batches"] = [b.to_json() for b in self.batches]
        out["reindex"] = None if self.reindex is None else self.reindex.to_json()
        return out

    @classmethod
    def from_json(cls, data: object) -> Manifest:
        """A TypeError (or ValueError) for anything that is not a manifest's layout."""
        d = _fields(data, "manifest", {"batches": list, "chunks": int, "shards": int})
        reindex = d.get("reindex")
        return cls(
            **{
                **d,
                "batches": [Batch.from_json(b) for b in d["batches"]],
                "reindex": None if reindex is None else Reindex.from_json(reindex),
            }
        )


def segment_positions(m: Manifest, shard: int, batch: Batch) -> np.ndarray:
    """The global positions of ``batch``'s rows in ``shard``, ascending."""
    positions = np.arange(batch.first, batch.first + batch.chunks, dtype=np.int64)
    return positions[positions % m.shards == shard]


def listed_files(m: Manifest) -> set[str]:
    """Every file the manifest names (documents, texts, vectors, staged vectors of a re-index)."""
    return set().union(*(b.files() for b in m.batches))


def shard_rows(shard: int, n_shards: int, n_total: int) -> int:
    """How many of the first ``n_total`` global positions fall in ``shard`` (g % S == shard)."""
    return max(0, -(-(n_total - shard) // n_shards))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def valid_name(name: object) -> bool:
    return isinstance(name, str) and NAME_PATTERN.fullmatch(name) is not None


def _where(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable, not only the files' bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fault_point(f"synced directory {_where(path)}")


def make_dir(path: Path) -> None:
    """mkdir that survives a crash: the parent's entry is fsynced too."""
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True)
        fault_point(f"made directory {_where(path)}")
        fsync_dir(path.parent)


def remove_file(path: Path) -> None:
    """Unlink ``path`` if it is there (a file no manifest or record lists any more)."""
    path.unlink(missing_ok=True)
    fault_point(f"removed {_where(path)}")


TMP_SUFFIX = ".tmp"


def write_atomic(path: Path, data: bytes, durable: bool = True) -> None:
    """Write to a temp file, then rename over ``path``; with ``durable`` the file's bytes are
    fsynced before the rename and the directory after it, so both are on disk before this returns
    (the write may then be acknowledged)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    where = _where(path)
    try:
        fault_point(f"writing {where}")
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            fault_point(f"written {where}")
            if durable:
                os.fsync(fh.fileno())
                fault_point(f"synced {where}")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fault_point(f"renamed {where}")
    if durable:
        fsync_dir(path.parent)


# ---------------------------------------------------------------------------------------------
# JSON lines

# JSON leaves these three raw inside strings (ensure_ascii=False), but str.splitlines() ends a line
# at each: written as \uXXXX escapes, no reader can split a record. (UTF-8 never holds these byte
# runs inside another character.)
_RAW_LINE_ENDS = re.compile("\x85|\u2028|\u2029".encode())


def _one_record_per_line(data: bytes) -> bytes:
    """JSON lines (UTF-8) with the raw line ends of :data:`_RAW_LINE_ENDS` escaped; same records."""
    return _RAW_LINE_ENDS.sub(lambda hit: b"\\u%04x" % ord(hit.group().decode()), data)


def _records(data: bytes, fields: dict[str, type]) -> list[dict[str, Any]]:
    """The records of a JSONL file, split at "\\n" only (JSON escapes every newline inside a
    string, and files written before the escaping above may hold raw U+2028), each an object whose
    ``fields`` have their types. A ValueError names the line of the first bad one."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 (byte {exc.start})") from None
    rows = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line:
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError) as exc:  # a JSONDecodeError, or nesting too deep
            raise ValueError(f"line {n} is not a JSON record ({getattr(exc, 'msg', type(exc).__name__)})") from None
        if not isinstance(rec, dict) or any(not isinstance(rec.get(k), t) for k, t in fields.items()):
            raise ValueError(f"line {n} is not a record of {', '.join(fields)}")
        rows.append(rec)
    return rows


_TEXT_FIELDS = {"position": int, "doc": str, "text": str}
_DOC_FIELDS = {"id": str}

# ---------------------------------------------------------------------------------------------
# Reading one shard's segment (a batch's rows in one shard)


@dataclass
class Segment:
    batch: int
    positions: np.ndarray  # int64 global positions, ascending
    vectors: np.ndarray  # [n, d]
    tokens: list[np.ndarray]
    doc_ids: list[str]
    texts: list[str]


@dataclass
class SegmentProblem:
    """A shard file that is missing, corrupt or stale; ``repairable`` when its texts are intact
    (the vectors can be re-embedded from them)."""

    corpus: str
    shard: int
    batch: int
    file: str
    reason: str
    repairable: bool

    def __str__(self) -> str:
        return f"corpus {self.corpus!r} shard {self.shard}: {self.file}: {self.reason}"


def _encode_segment(positions: np.ndarray, vectors: np.ndarray, tokens: Sequence[np.ndarray], dtype: str) -> bytes:
    lengths = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
    offsets = np.zeros(len(tokens) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(tokens).astype(np.int32) if len(tokens) else np.zeros(0, np.int32)
    return st_save(
        {
            "vectors": np.ascontiguousarray(vectors, dtype=np.dtype(dtype)),
            "positions": np.ascontiguousarray(positions, dtype=np.int64),
            "tokens": flat,
            "offsets": offsets,
        }
    )


_encode_str = json.encoder.encode_basestring  # what json.dumps(..., ensure_ascii=False) uses for a str (the C version)


def _text_line(p, d, t) -> str:
    """``json.dumps({"position": p, "doc": d, "text": t}, ensure_ascii=False)``, the same
    characters, without building an encoder per line (the writer's hot loop while indexing)."""
    if type(d) is str and type(t) is str:
        return (
            '{"position": ' + int.__repr__(int(p)) + ', "doc": ' + _encode_str(d) + ', "text": ' + _encode_str(t) + "}"
        )
    return json.dumps({"position": int(p), "doc": d, "text": t}, ensure_ascii=False)


def _encode_texts(positions: np.ndarray, doc_ids: Sequence[str], texts: Sequence[str]) -> bytes:
    lines = [_text_line(p, d, t) for p, d, t in zip(positions.tolist(), doc_ids, texts)]
    return ("\n".join(lines) + "\n").encode("utf-8") if lines else b""


# ---------------------------------------------------------------------------------------------
# The store


class CorpusStore:
    """Corpora under one storage root. Writers serialise on a per-corpus file lock, so several
    processes (Serve replicas) may share the root; readers need no lock (manifest-first)."""

    def __init__(self, root: str | Path, clean: bool = True):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        if clean:  # leftovers of a crash (SIGKILL mid-append) go when the storage is opened
            self.clean_all()

    # -- names, locks, manifests

    def path(self, name: str) -> Path:
        if not valid_name(name):
            shown = name[:80] if isinstance(name, str) else name
            raise StoreError(
                f"invalid corpus name {shown!r}: "
                "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        return self.root / name

    @contextmanager
    def lock(self, name: str, blocking: bool = True) -> Iterator[bool]:
        """The corpus's writer lock (shared by processes on this storage). Non-blocking: yields
        False when another writer holds it."""
        self.path(name)
        locks = self.root / ".locks"
        locks.mkdir(exist_ok=True)
        with file_lock(locks / f"{name}.lock", blocking) as held:
            yield held

    def names(self) -> list[str]:
        return sorted(
            p.name for p in self.root.iterdir() if valid_name(p.name) and p.is_dir() and (p / "corpus.json").is_file()
        )

    def read(self, name: str) -> Manifest:
        path = self.path(name) / "corpus.json"
        try:
            raw = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            raise CorpusNotFound(f"unknown corpus {name!r}") from None
        except OSError as exc:
            raise StoreError(f"corpus {name!r}: corpus.json cannot be read ({exc.strerror})") from None
        try:
            data = json.loads(raw.decode("utf-8"))
            manifest = Manifest.from_json(data)
        except (ValueError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise StoreError(
                f"corpus {name!r}: corpus.json is unreadable ({type(exc).__name__}); restore it or delete the corpus"
            ) from None
        if manifest.format_version != FORMAT_VERSION:
            raise StoreError(f"corpus {name!r}: unsupported index format {manifest.format_version!r}")
        return manifest

    def clean(self, name: str) -> int:
        """Remove temp files of interrupted writes and files no manifest lists, unless a writer
        is busy with the corpus (its files are then in use). Returns how many were removed."""
        removed = 0
        with self.lock(name, blocking=False) as held:
            if not held:
                return 0
            root = self.path(name)
            for tmp in [*root.glob(f".*{TMP_SUFFIX}"), *root.glob(f"*/.*{TMP_SUFFIX}")]:
                tmp.unlink(missing_ok=True)
                removed += 1
            try:
                removed += self._remove_strays(self.read(name))
            except StoreError:
                pass  # unreadable or gone: nothing can say which files are stray
        return removed

    def clean_all(self) -> int:
        """What opening the storage does: every corpus's leftovers of crashed writes go."""
        return sum(self.clean(p.name) for p in self.root.iterdir() if valid_name(p.name) and p.is_dir())

    def _write_manifest(self, m: Manifest) -> None:
        m.updated = time.time()
        write_atomic(self.path(m.name) / "corpus.json", json.dumps(m.to_json(), indent=1).encode("utf-8"))

    def create(
        self,
        name: str,
        *,
        fingerprint: str,
        model: ModelConfig,
        dim: int,
        chunk_tokens: int,
        shards: int,
        dtype: str = "float32",
        first: tuple[Sequence[Document], Sequence[DocumentChunk], Sequence[np.ndarray], np.ndarray] | None = None,
        job: str | None = None,
    ) -> Manifest:
        """A new corpus; with ``first`` (docs, chunks, token ids, vectors) it appears already
        holding them, so a failed create leaves nothing behind (no empty corpus, no 409 on retry)."""
        if shards < 1:
            raise StoreError(f"shards must be at least 1, got {shards}")
        if dtype not in DTYPES:
            raise StoreError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        with self.lock(name):
            path = self.path(name)
            if (path / "corpus.json").exists():
                raise CorpusConflict(f"corpus {name!r} already exists")
            if path.exists():  # debris of a crashed create or delete
                shutil.rmtree(path)
            make_dir(path)
            now = time.time()
            m = Manifest(
                name=name,
                uid=secrets.token_hex(8),
                fingerprint=fingerprint,
                model=to_dict(model),
                dim=int(dim),
                chunk_tokens=int(chunk_tokens),
                shards=int(shards),
                dtype=dtype,
                created=now,
            )
            if first is not None:  # indexed, then visible: the manifest is written last
                self._add_batch(m, *first, fingerprint=fingerprint, job=job)
            self._write_manifest(m)
            return m

    def delete(self, name: str) -> None:
        with self.lock(name):
            path = self.path(name)
            if not (path / "corpus.json").exists():
                raise CorpusNotFound(f"unknown corpus {name!r}")
            # The manifest goes first: a crash part-way leaves debris, never a half corpus.
            remove_file(path / "corpus.json")
            fsync_dir(path)
            shutil.rmtree(path, ignore_errors=True)
            fault_point(f"removed directory {name}")
            fsync_dir(self.root)

    def disk_bytes(self, name: str) -> int:
        return sum(p.stat().st_size for p in self.path(name).rglob("*") if p.is_file())

    # -- documents

    def doc_ids(self, m: Manifest) -> list[str]:
        """The corpus's document ids as stored (ids written before :func:`normalize_id` may be in
        another normal form). A StoreError names the file and line that cannot be read."""
        ids: list[str] = []
        for batch in m.batches:
            ids.extend(r["id"] for r in self._read_records(m, batch.docs, _DOC_FIELDS))
        return ids

    def _read_records(self, m: Manifest, ref: FileRef, fields: dict[str, type]) -> list[dict[str, Any]]:
        """The checked records of one of the manifest's JSONL files."""
        data = self._read_checked(self.path(m.name) / ref.file, ref.sha256)
        if data is None:
            self.current(m)  # a corpus deleted or created again meanwhile explains it
            raise StoreError(f"corpus {m.name!r}: {ref.file} is missing or corrupt")
        try:
            return _records(data, fields)
        except ValueError as exc:
            raise StoreError(f"corpus {m.name!r}: {ref.file}: {exc}; restore the file or delete the corpus") from None

    def current(self, m: Manifest, what: str = "request") -> Manifest:
        """The manifest now of ``m``'s corpus generation; CorpusNotFound or :class:`CorpusChanged`
        when the corpus is gone or was created again."""
        now = self.read(m.name)
        self._check_uid(now, m.uid, what)
        return now

    @staticmethod
    def _check_uid(m: Manifest, uid: str | None, what: str) -> None:
        """The generation check of every write that started on corpus ``uid`` (None: no check)."""
        if uid is not None and m.uid != uid:
            raise CorpusChanged(
                f"corpus {m.name!r} was deleted and created again while this {what} ran (generation {uid}, now "
                f"{m.uid}); nothing of it was stored in the new corpus"
            )

    @staticmethod
    def _read_checked(path: Path, sha: str) -> bytes | None:
        try:
            data = path.read_bytes()
        except OSError:
            return None
        return data if _sha256(data) == sha else None

    # -- appending

    def check_new(
        self, m: Manifest, docs: Sequence[Document], fingerprint: str, existing: set[str] | None = None
    ) -> None:
        """What :meth:`append` refuses (CorpusConflict): vectors of another model, or a document id
        the corpus holds (``existing``: its ids, when the caller has read them already)."""
        if fingerprint != m.fingerprint and (m.reindex is None or fingerprint != m.reindex.fingerprint):
            raise CorpusConflict(
                f"corpus {m.name!r} was indexed with model {m.fingerprint}; these vectors come from {fingerprint}"
            )
        held = {normalize_id(i) for i in (self.doc_ids(m) if existing is None else existing)}
        dup = next((d.id for d in docs if normalize_id(d.id) in held), None)
        if dup is not None:
            raise CorpusConflict(f"document id {dup!r} is already in corpus {m.name!r}")

    def append(
        self,
        name: str,
        docs: Sequence[Document],
        chunks: Sequence[DocumentChunk],
        token_ids: Sequence[np.ndarray],
        vectors: np.ndarray,
        fingerprint: str,
        job: str | None = None,
        uid: str | None = None,
    ) -> Manifest:
        """Add documents (their chunks in corpus order, token ids and vectors) as one batch;
        durable when this returns. ``job`` is recorded with the batch (a restarted server can
        tell whether an interrupted job's documents made it); ``uid``: the corpus generation the
        documents were chunked for (:class:`CorpusChanged` when it is another one now)."""
        with self.hold(name, uid, "append") as m:
            self.check_new(m, docs, fingerprint)
            self._add_batch(m, docs, chunks, token_ids, vectors, fingerprint=fingerprint, job=job)
            self._write_manifest(m)
            return m

    def _add_batch(
        self, m: Manifest, docs, chunks, token_ids, vectors: np.ndarray, *, fingerprint: str, job: str | None
    ) -> None:
        """Write one batch's files (each durable) and add it to ``m`` (not yet written)."""
        batch_id = m.last_batch_id + 1
        self.add_written(
            m,
            self.write_batch_files(
                m, batch_id, m.chunks, docs, chunks, token_ids, vectors, fingerprint=fingerprint, job=job
            ),
        )

    def write_batch_files(
        self,
        m: Manifest,
        batch_id: int,
        first: int,
        docs,
        chunks,
        token_ids,
        vectors: np.ndarray,
        *,
        fingerprint: str,
        job: str | None = None,
    ) -> Batch:
        """The files of batch ``batch_id`` whose chunks take the global positions ``first``...
        (each file durable), and its manifest entry, which :meth:`add_written` commits. ``m``
        gives only the corpus's fixed fields (name, shards, dim, dtype): several processes may
        write batches of one corpus side by side while the process that holds the writer lock
        (:meth:`hold`) commits them in order (:mod:`qrag.index.lanes`)."""
        name = m.name
        if not (len(chunks) == len(token_ids) == len(vectors)):
            raise StoreError(
                f"corpus {name!r}: {len(chunks)} chunks, {len(token_ids)} token arrays and {len(vectors)} vectors"
            )
        if vectors.ndim != 2 or vectors.shape[1] != m.dim:
            raise StoreError(f"corpus {name!r}: vectors of shape {tuple(vectors.shape)}, expected [n, {m.dim}]")
        positions = np.arange(first, first + len(chunks), dtype=np.int64)
        root = self.path(name)
        tag = f"batch_{batch_id:06d}"
        per_doc: dict[str, list[int]] = {d.id: [0, 0] for d in docs}
        for c in chunks:
            per_doc[c.doc_id][0] += 1
            per_doc[c.doc_id][1] += c.tokens
        docs_bytes = _one_record_per_line(
            "".join(
                json.dumps({"id": d, "chunks": n, "tokens": t}, ensure_ascii=False) + "\n"
                for d, (n, t) in per_doc.items()
            ).encode()
        )
        make_dir(root / "docs")
        write_atomic(root / "docs" / f"{tag}.jsonl", docs_bytes)

        def write_shard(s: int) -> SegmentFiles:
            rows = np.nonzero(positions % m.shards == s)[0]
            return self._write_segment(
                m,
                s,
                tag,
                positions[rows],
                vectors[rows],
                [token_ids[i] for i in rows],
                [chunks[i].doc_id for i in rows],
                [chunks[i].text for i in rows],
                fingerprint,
            )

        # The shards' files side by side: serialising, hashing, writing and fsync release the GIL,
        # and the store's one writer was a serial stage of bulk indexing (docs/benchmarks.md,
        # "Indexing"). The manifest is committed only after every shard's files.
        if m.shards > 1 and len(chunks) >= PARALLEL_SHARD_WRITES_FROM:
            with ThreadPoolExecutor(min(m.shards, 8), thread_name_prefix="qrag-store-shard") as pool:
                shard_entries = list(pool.map(write_shard, range(m.shards)))
        else:
            shard_entries = [write_shard(s) for s in range(m.shards)]
        return Batch(
            id=batch_id,
            first=first,
            chunks=len(chunks),
            documents=len(docs),
            tokens=int(sum(c.tokens for c in chunks)),
            docs=FileRef(f"docs/{tag}.jsonl", _sha256(docs_bytes)),
            shards=tuple(shard_entries),
            job=job or None,
        )

    @staticmethod
    def add_written(m: Manifest, batch: Batch) -> None:
        """Add a batch written by :meth:`write_batch_files` to ``m`` (not yet written). It must be
        the next batch: its id after the last and its first position the corpus's chunk count."""
        last_id = m.last_batch_id
        if batch.id <= last_id or batch.first != m.chunks:
            raise StoreError(
                f"corpus {m.name!r}: batch {batch.id} at position {batch.first} does not follow "
                f"batch {last_id} ending at {m.chunks}"
            )
        m.batches.append(batch)
        m.version += 1
        m.documents += batch.documents
        m.chunks += batch.chunks
        m.tokens += batch.tokens

    @contextmanager
    def hold(self, name: str, uid: str | None = None, what: str = "write") -> Iterator[Manifest]:
        """The writer lock for a run of many batches, with the manifest at its start (debris of
        crashed writes removed; :class:`CorpusChanged` if it is no longer generation ``uid``).
        While it is held, other processes may write batch files (:meth:`write_batch_files`) that
        the holder commits with :meth:`commit_written`: no other writer can remove them as strays
        meanwhile, and a crash leaves them as strays."""
        with self.lock(name):
            m = self.read(name)
            self._check_uid(m, uid, what)
            self._remove_strays(m)
            for tmp in self.path(name).glob(f"*/.*{TMP_SUFFIX}"):
                tmp.unlink(missing_ok=True)
            yield m

    def commit_written(self, m: Manifest, *batches: Batch) -> Manifest:
        """Commit written batches, in order, in one manifest write (the caller holds :meth:`hold`):
        ``m`` updated and durable. A manifest write rewrites every batch's entry, so a bulk load
        commits several at once as its corpus grows (:mod:`qrag.index.lanes`)."""
        for batch in batches:
            self.add_written(m, batch)
        self._write_manifest(m)
        return m

    def _write_segment(
        self, m: Manifest, shard: int, tag: str, positions, vectors, tokens, doc_ids, texts, fingerprint: str
    ) -> SegmentFiles:
        txt_bytes = _one_record_per_line(_encode_texts(positions, doc_ids, texts))
        vec = self._write_vectors(m, shard, tag, positions, vectors, tokens)
        txt_name = f"{tag}.jsonl"
        folder = self.path(m.name) / f"shard_{shard:03d}"
        if not (folder / txt_name).exists() or _sha256((folder / txt_name).read_bytes()) != _sha256(txt_bytes):
            write_atomic(folder / txt_name, txt_bytes)
        else:  # written by an earlier attempt, perhaps before its directory was synced
            fsync_dir(folder)
        return SegmentFiles(
            len(positions), fingerprint, vec, FileRef(f"shard_{shard:03d}/{txt_name}", _sha256(txt_bytes))
        )

    def _write_vectors(self, m: Manifest, shard: int, tag: str, positions, vectors, tokens) -> FileRef:
        """One segment's vectors file, durable."""
        folder = self.path(m.name) / f"shard_{shard:03d}"
        make_dir(folder)
        data = _encode_segment(positions, vectors, tokens, m.dtype)
        # A fresh file name per write: a reader holding the old manifest still finds its files.
        name = f"{tag}.{secrets.token_hex(3)}.safetensors"
        write_atomic(folder / name, data)
        return FileRef(f"shard_{shard:03d}/{name}", _sha256(data))

    def _rewrite_vectors(
        self, m: Manifest, shard: int, batch: Batch, vectors: np.ndarray, token_ids: Sequence[np.ndarray], dim: int
    ) -> FileRef:
        """New vectors for a segment whose texts stay as they are (repair, re-index)."""
        positions = segment_positions(m, shard, batch)
        if vectors.ndim != 2 or vectors.shape != (len(positions), dim) or len(token_ids) != len(positions):
            raise StoreError(
                f"corpus {m.name!r} shard {shard} batch {batch.id}: vectors of shape {tuple(vectors.shape)} and "
                f"{len(token_ids)} token arrays for {len(positions)} chunks of dimension {dim}"
            )
        return self._write_vectors(m, shard, f"batch_{batch.id:06d}", positions, vectors, token_ids)

    def _remove_strays(self, m: Manifest) -> int:
        """Files of crashed writes: anything in docs/ or shard_*/ that the manifest does not list
        (temp files of a write in progress are left to their writer)."""
        keep = listed_files(m)
        root = self.path(m.name)
        removed = 0
        for folder in [root / "docs", *root.glob("shard_*")]:
            for file in folder.glob("*") if folder.is_dir() else []:
                rel = f"{folder.name}/{file.name}"
                if rel not in keep and file.is_file() and not file.name.endswith(TMP_SUFFIX):
                    file.unlink()
                    removed += 1
        return removed

    @staticmethod
    def job_batch(m: Manifest, job: str) -> Batch | None:
        return next((b for b in m.batches if b.job == job), None)

    # -- reading and repairing shards

    def read_segment(self, m: Manifest, shard: int, batch: Batch) -> tuple[Segment | None, SegmentProblem | None]:
        """One batch's rows of one shard, checked against the manifest; never wrong rows."""
        entry = batch.shards[shard]
        root = self.path(m.name)
        expected = segment_positions(m, shard, batch)

        def problem(file: str, reason: str, repairable: bool) -> tuple[None, SegmentProblem]:
            return None, SegmentProblem(m.name, shard, batch.id, file, reason, repairable)

        texts = self._read_checked(root / entry.texts.file, entry.texts.sha256)
        if texts is None:
            reason = "missing" if not (root / entry.texts.file).exists() else "checksum mismatch"
            return problem(entry.texts.file, f"{reason}; the chunk texts are lost, re-create the corpus", False)
        try:
            rows = _records(texts, _TEXT_FIELDS)
        except ValueError as exc:
            return problem(
                entry.texts.file,
                f"{exc}; the chunk texts are unreadable, restore the file or re-create the corpus",
                False,
            )
        if len(rows) != len(expected) or any(r["position"] != p for r, p in zip(rows, expected)):
            return problem(entry.texts.file, "rows do not match the manifest", False)
        if entry.fingerprint != m.fingerprint:
            return problem(
                entry.vectors.file, f"vectors from model {entry.fingerprint}, corpus model {m.fingerprint}", True
            )
        data = self._read_checked(root / entry.vectors.file, entry.vectors.sha256)
        if data is None:
            reason = "missing" if not (root / entry.vectors.file).exists() else "checksum mismatch"
            return problem(entry.vectors.file, reason, True)
        try:
            arrays = st_load(data)
            vectors, positions, flat, offsets = (
                arrays["vectors"],
                arrays["positions"],
                arrays["tokens"],
                arrays["offsets"],
            )
        except Exception as exc:  # safetensors raises its own error types
            return problem(entry.vectors.file, f"unreadable ({exc})", True)
        if (
            vectors.shape != (len(expected), m.dim)
            or not np.array_equal(positions, expected)
            or len(offsets) != len(expected) + 1
        ):
            return problem(entry.vectors.file, "arrays do not match the manifest", True)
        tokens = [flat[offsets[i] : offsets[i + 1]] for i in range(len(expected))]
        return Segment(batch.id, positions, vectors, tokens, [r["doc"] for r in rows], [r["text"] for r in rows]), None

    def replace_vectors(
        self,
        name: str,
        shard: int,
        batch_id: int,
        vectors: np.ndarray,
        token_ids: Sequence[np.ndarray],
        fingerprint: str,
        uid: str | None = None,
    ) -> Manifest:
        """Re-embedded vectors for one segment whose texts are intact (repair), of the corpus
        generation ``uid`` the texts were read from (:class:`CorpusChanged` otherwise)."""
        with self.lock(name):
            m = self.read(name)
            self._check_uid(m, uid, "repair")
            if fingerprint != m.fingerprint:
                raise CorpusConflict(f"corpus {name!r} is for model {m.fingerprint}, not {fingerprint}")
            batch = self._batch(m, batch_id)
            entry = batch.shards[shard]
            old = entry.vectors.file
            vec = self._rewrite_vectors(m, shard, batch, vectors, token_ids, m.dim)
            m.put_batch(batch.with_segment(shard, replace(entry, vectors=vec, fingerprint=fingerprint)))
            m.version += 1
            self._write_manifest(m)
            self._remove_unlisted(m, [old])
            return m

    @staticmethod
    def _batch(m: Manifest, batch_id: int) -> Batch:
        batch = m.batch(batch_id)
        if batch is None:
            raise StoreError(f"corpus {m.name!r} has no batch {batch_id}")
        return batch

    def _remove_unlisted(self, m: Manifest, files: Sequence[str]) -> None:
        """Remove files the committed manifest ``m`` no longer lists (a crash first leaves them as strays)."""
        listed = listed_files(m)
        for file in files:
            if file not in listed:
                remove_file(self.path(m.name) / file)

    def read_texts(self, m: Manifest, shard: int, batch: Batch) -> list[tuple[int, str, str]]:
        """(position, doc id, text) of a segment, checked; a StoreError when they are lost."""
        rows = self._read_records(m, batch.shards[shard].texts, _TEXT_FIELDS)
        return [(r["position"], r["doc"], r["text"]) for r in rows]

    # -- re-indexing: new vectors for every segment beside the current ones, swapped in at once

    def begin_reindex(self, name: str, uid: str, fingerprint: str, dim: int, model: ModelConfig) -> Manifest:
        """Record a re-index to ``fingerprint`` in the manifest, or keep the one under way to it (an
        interrupted re-index resumes from the segments it staged). The corpus serves its current
        vectors until :meth:`finish_reindex`."""
        with self.lock(name):
            m = self.read(name)
            self._check_uid(m, uid, "re-index")
            target = Reindex(fingerprint, int(dim), to_dict(model), m.last_batch_id)
            if m.reindex is not None and replace(m.reindex, through=target.through) == target:
                return m
            staged = [s.next.vectors.file for b in m.batches for s in b.shards if s.next is not None]
            m.batches = [replace(b, shards=tuple(replace(s, next=None) for s in b.shards)) for b in m.batches]
            m.reindex = target
            self._write_manifest(m)
            self._remove_unlisted(m, staged)
            return m

    @staticmethod
    def reindex_todo(m: Manifest) -> list[tuple[Batch, int]]:
        """The (batch, shard) segments the re-index under way has still to re-embed: those of the
        batches it began with that have no staged vectors, and later ones of another model."""
        if m.reindex is None:
            return []
        target, through = m.reindex.fingerprint, m.reindex.through
        return [
            (b, s)
            for b in m.batches
            for s, entry in enumerate(b.shards)
            if (entry.next is None or entry.next.fingerprint != target)
            and (b.id <= through or entry.fingerprint != target)
        ]

    def _reindexing(self, name: str, uid: str, fingerprint: str) -> Manifest:
        """The manifest (the caller holds the lock) of generation ``uid`` under a re-index to ``fingerprint``."""
        m = self.read(name)
        self._check_uid(m, uid, "re-index")
        if m.reindex is None or m.reindex.fingerprint != fingerprint:
            raise CorpusConflict(
                f"corpus {name!r}: the re-index to model {fingerprint} was finished or replaced by another one"
            )
        return m

    def stage_vectors(
        self,
        name: str,
        uid: str,
        fingerprint: str,
        shard: int,
        batch_id: int,
        vectors: np.ndarray,
        token_ids: Sequence[np.ndarray],
    ) -> Manifest:
        """One segment's vectors from the re-index's model, durable beside the current ones."""
        with self.lock(name):
            m = self._reindexing(name, uid, fingerprint)
            batch = self._batch(m, batch_id)
            entry = batch.shards[shard]
            old = entry.next.vectors.file if entry.next is not None else None
            vec = self._rewrite_vectors(m, shard, batch, vectors, token_ids, m.reindex.dim)
            m.put_batch(batch.with_segment(shard, replace(entry, next=StagedVectors(fingerprint, vec))))
            self._write_manifest(m)
            self._remove_unlisted(m, [old] if old else [])
            return m

    def finish_reindex(self, name: str, uid: str, fingerprint: str) -> tuple[Manifest, list[tuple[Batch, int]]]:
        """Swap every staged segment in, with the model, in one manifest commit, once none is left
        to re-embed. Returns the manifest and the segments still to do (then nothing changed)."""
        with self.lock(name):
            m = self._reindexing(name, uid, fingerprint)
            todo = self.reindex_todo(m)
            if todo:
                return m, todo
            replaced = [s.vectors.file for b in m.batches for s in b.shards if s.next is not None]
            m.batches = [
                replace(
                    b,
                    shards=tuple(
                        s
                        if s.next is None
                        else replace(s, vectors=s.next.vectors, fingerprint=s.next.fingerprint, next=None)
                        for s in b.shards
                    ),
                )
                for b in m.batches
            ]
            target, m.reindex = m.reindex, None
            m.fingerprint, m.dim, m.model = target.fingerprint, target.dim, target.model
            m.version += 1
            self._write_manifest(m)
            self._remove_unlisted(m, replaced)
            return m, []


class ManifestCache:
    """A reader's manifests, each re-read only when its corpus.json changed (one stat a call;
    writers replace the file, so a new inode or mtime means a new manifest). The manifests it
    returns are shared between calls: readers only, never to be changed."""

    def __init__(self, store: CorpusStore):
        self.store = store
        self._cached: dict[str, tuple[tuple[int, int, int], Manifest]] = {}

    def read(self, name: str) -> Manifest:
        try:
            st = (self.store.path(name) / "corpus.json").stat()
        except (FileNotFoundError, NotADirectoryError):
            self._cached.pop(name, None)
            raise CorpusNotFound(f"unknown corpus {name!r}") from None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        hit = self._cached.get(name)
        if hit is None or hit[0] != key:
            hit = self._cached[name] = (key, self.store.read(name))
        return hit[1]

    def forget(self, name: str) -> None:
        self._cached.pop(name, None)
