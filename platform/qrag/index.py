"""Chunk-embedding store: sharded corpora on disk, exact (rotated) scoring, FAISS candidates, and
the multi-step search over shards.

On disk, one directory per corpus under a storage root::

    corpus.json                          the manifest: model fingerprint, positions, counts, and
                                         per append batch the files of every shard + sha256 sums
    docs/batch_000001.jsonl              the batch's documents (id, chunks, tokens)
    shard_000/batch_000001.safetensors   vectors [n, d] (float16|float32), global positions,
                                         chunk token ids (flat + offsets)
    shard_000/batch_000001.jsonl         one line per chunk: position, document id, text

A batch is committed by atomically replacing corpus.json once all its files are written: a
crash mid-append leaves the previous version whole, and stray files are removed by the next
write. Global chunk positions follow corpus order (documents as given, chunks in document
order); chunk g lives in shard g % S at row g // S, so a shard holds every part of the corpus
and appends keep the shards balanced.

A query step sends the state vector to every shard; each returns its top-k for the *global*
selected set (relative RoPE positions depend on it) and the caller merges. The merged top-k
feeds the beam logic of :class:`qrag.search.Retriever`, so greedy, beam and threshold stopping
give the answers of the offline search over the corpus read as one long context.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from .config import ModelConfig, SearchConfig, from_dict, to_dict
from .data.documents import Document, DocumentChunk
from .positions import rotate
from .qnet import QNetwork
from .search import Retrieval, Retriever, _Beam
from .tokens import TokenLayout

FORMAT_VERSION = 1
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
DTYPES = ("float32", "float16")


class StoreError(ValueError):
    """A corpus that cannot be read or written; the message names the corpus and the file."""


class CorpusNotFound(StoreError):
    pass


class CorpusConflict(StoreError):
    """The request contradicts the corpus (exists already, duplicate document, other model)."""


# ---------------------------------------------------------------------------------------------
# The manifest


@dataclass
class Manifest:
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
    # [{"id", "first", "chunks", "documents", "tokens", "docs": {file, sha256},
    #   "shards": [{"chunks", "fingerprint", "vectors": {file, sha256}, "texts": {file, sha256}}]}]
    batches: list[dict[str, Any]] = field(default_factory=list)
    format_version: int = FORMAT_VERSION

    @property
    def model_cfg(self) -> ModelConfig:
        return from_dict(ModelConfig, self.model)

    @property
    def positions(self) -> str:
        return str(self.model.get("positions", "none"))

    def summary(self) -> dict[str, Any]:
        keys = ("name", "fingerprint", "dim", "chunk_tokens", "shards", "dtype", "version", "documents", "chunks", "tokens", "created", "updated")
        return {**{k: getattr(self, k) for k in keys}, "positions": self.positions, "batches": len(self.batches)}


def shard_rows(shard: int, n_shards: int, n_total: int) -> int:
    """How many of the first ``n_total`` global positions fall in ``shard`` (g % S == shard)."""
    return max(0, -(-(n_total - shard) // n_shards))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Reading one shard's segment (a batch's rows in one shard)


@dataclass
class ChunkRecord:
    """What a caller needs of a chosen chunk: to show it and to put it into the next state."""

    doc_id: str
    text: str
    tokens: np.ndarray  # [CLS] chunk [SEP], int32


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
    return st_save({
        "vectors": np.ascontiguousarray(vectors, dtype=np.dtype(dtype)),
        "positions": np.ascontiguousarray(positions, dtype=np.int64),
        "tokens": flat,
        "offsets": offsets,
    })


def _encode_texts(positions: np.ndarray, doc_ids: Sequence[str], texts: Sequence[str]) -> bytes:
    lines = [json.dumps({"position": int(p), "doc": d, "text": t}, ensure_ascii=False) for p, d, t in zip(positions, doc_ids, texts)]
    return ("\n".join(lines) + "\n").encode("utf-8") if lines else b""


# ---------------------------------------------------------------------------------------------
# The store


class CorpusStore:
    """Corpora under one storage root. Writers serialise on a per-corpus file lock, so several
    processes (Serve replicas) may share the root; readers need no lock (manifest-first)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    # -- names, locks, manifests

    def path(self, name: str) -> Path:
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise StoreError(f"invalid corpus name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return self.root / name

    @contextmanager
    def lock(self, name: str) -> Iterator[None]:
        self.path(name)
        locks = self.root / ".locks"
        locks.mkdir(exist_ok=True)
        with open(locks / f"{name}.lock", "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and (p / "corpus.json").is_file() and NAME_PATTERN.match(p.name))

    def manifest_mtime(self, name: str) -> float | None:
        try:
            return (self.path(name) / "corpus.json").stat().st_mtime_ns
        except FileNotFoundError:
            return None

    def read(self, name: str) -> Manifest:
        path = self.path(name) / "corpus.json"
        if not path.is_file():
            raise CorpusNotFound(f"unknown corpus {name!r}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            manifest = Manifest(**data)
        except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as exc:
            raise StoreError(f"{path}: unreadable manifest ({exc})") from None
        if manifest.format_version != FORMAT_VERSION:
            raise StoreError(f"{path}: unsupported index format {manifest.format_version!r}")
        return manifest

    def _write_manifest(self, m: Manifest) -> None:
        m.updated = time.time()
        _write_atomic(self.path(m.name) / "corpus.json", json.dumps(asdict(m), indent=1).encode("utf-8"))

    def create(self, name: str, *, fingerprint: str, model: ModelConfig, dim: int, chunk_tokens: int, shards: int, dtype: str = "float32") -> Manifest:
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
            path.mkdir(parents=True)
            now = time.time()
            m = Manifest(name=name, uid=secrets.token_hex(8), fingerprint=fingerprint, model=to_dict(model), dim=int(dim),
                         chunk_tokens=int(chunk_tokens), shards=int(shards), dtype=dtype, created=now)
            self._write_manifest(m)
            return m

    def delete(self, name: str) -> None:
        with self.lock(name):
            path = self.path(name)
            if not (path / "corpus.json").exists():
                raise CorpusNotFound(f"unknown corpus {name!r}")
            # The manifest goes first: a crash part-way leaves debris, never a half corpus.
            (path / "corpus.json").unlink()
            shutil.rmtree(path, ignore_errors=True)

    def disk_bytes(self, name: str) -> int:
        return sum(p.stat().st_size for p in self.path(name).rglob("*") if p.is_file())

    # -- documents

    def doc_ids(self, m: Manifest) -> list[str]:
        ids: list[str] = []
        for batch in m.batches:
            path = self.path(m.name) / batch["docs"]["file"]
            data = self._read_checked(path, batch["docs"]["sha256"])
            if data is None:
                raise StoreError(f"corpus {m.name!r}: {batch['docs']['file']} is missing or corrupt")
            ids.extend(json.loads(line)["id"] for line in data.decode("utf-8").splitlines() if line)
        return ids

    @staticmethod
    def _read_checked(path: Path, sha: str) -> bytes | None:
        try:
            data = path.read_bytes()
        except OSError:
            return None
        return data if _sha256(data) == sha else None

    # -- appending

    def append(
        self,
        name: str,
        docs: Sequence[Document],
        chunks: Sequence[DocumentChunk],
        token_ids: Sequence[np.ndarray],
        vectors: np.ndarray,
        fingerprint: str,
    ) -> Manifest:
        """Add documents (their chunks in corpus order, token ids and vectors) as one batch."""
        if not (len(chunks) == len(token_ids) == len(vectors)):
            raise StoreError(f"corpus {name!r}: {len(chunks)} chunks, {len(token_ids)} token arrays and {len(vectors)} vectors")
        with self.lock(name):
            m = self.read(name)
            if fingerprint != m.fingerprint:
                raise CorpusConflict(f"corpus {name!r} was indexed with model {m.fingerprint}; these vectors come from {fingerprint}")
            if vectors.ndim != 2 or vectors.shape[1] != m.dim:
                raise StoreError(f"corpus {name!r}: vectors of shape {tuple(vectors.shape)}, expected [n, {m.dim}]")
            existing = set(self.doc_ids(m))
            dup = next((d.id for d in docs if d.id in existing), None)
            if dup is not None:
                raise CorpusConflict(f"document id {dup!r} is already in corpus {name!r}")
            self._remove_strays(m)
            batch_id = max((b["id"] for b in m.batches), default=0) + 1
            first = m.chunks
            positions = np.arange(first, first + len(chunks), dtype=np.int64)
            root = self.path(name)
            tag = f"batch_{batch_id:06d}"
            per_doc: dict[str, list[int]] = {d.id: [0, 0] for d in docs}
            for c in chunks:
                per_doc[c.doc_id][0] += 1
                per_doc[c.doc_id][1] += c.tokens
            docs_bytes = "".join(json.dumps({"id": d, "chunks": n, "tokens": t}, ensure_ascii=False) + "\n" for d, (n, t) in per_doc.items()).encode()
            (root / "docs").mkdir(exist_ok=True)
            _write_atomic(root / "docs" / f"{tag}.jsonl", docs_bytes)
            shard_entries = []
            for s in range(m.shards):
                rows = np.nonzero(positions % m.shards == s)[0]
                entry = self._write_segment(m, s, tag, positions[rows], vectors[rows], [token_ids[i] for i in rows],
                                            [chunks[i].doc_id for i in rows], [chunks[i].text for i in rows], fingerprint)
                shard_entries.append(entry)
            m.batches.append({
                "id": batch_id, "first": first, "chunks": len(chunks), "documents": len(docs),
                "tokens": int(sum(c.tokens for c in chunks)),
                "docs": {"file": f"docs/{tag}.jsonl", "sha256": _sha256(docs_bytes)},
                "shards": shard_entries,
            })
            m.version += 1
            m.documents += len(docs)
            m.chunks += len(chunks)
            m.tokens += int(sum(c.tokens for c in chunks))
            self._write_manifest(m)
            return m

    def _write_segment(self, m: Manifest, shard: int, tag: str, positions, vectors, tokens, doc_ids, texts, fingerprint: str) -> dict[str, Any]:
        folder = self.path(m.name) / f"shard_{shard:03d}"
        folder.mkdir(exist_ok=True)
        vec_bytes = _encode_segment(positions, vectors, tokens, m.dtype)
        txt_bytes = _encode_texts(positions, doc_ids, texts)
        # A fresh file name per write: a reader holding the old manifest still finds its files.
        suffix = secrets.token_hex(3)
        vec_name, txt_name = f"{tag}.{suffix}.safetensors", f"{tag}.jsonl"
        _write_atomic(folder / vec_name, vec_bytes)
        if not (folder / txt_name).exists() or _sha256((folder / txt_name).read_bytes()) != _sha256(txt_bytes):
            _write_atomic(folder / txt_name, txt_bytes)
        return {
            "chunks": int(len(positions)), "fingerprint": fingerprint,
            "vectors": {"file": f"shard_{shard:03d}/{vec_name}", "sha256": _sha256(vec_bytes)},
            "texts": {"file": f"shard_{shard:03d}/{txt_name}", "sha256": _sha256(txt_bytes)},
        }

    def _remove_strays(self, m: Manifest) -> None:
        """Files of crashed writes: anything in docs/ or shard_*/ that the manifest does not list."""
        keep = {b["docs"]["file"] for b in m.batches}
        keep |= {s[k]["file"] for b in m.batches for s in b["shards"] for k in ("vectors", "texts")}
        root = self.path(m.name)
        for folder in [root / "docs", *root.glob("shard_*")]:
            for file in folder.glob("*") if folder.is_dir() else []:
                rel = f"{folder.name}/{file.name}"
                if rel not in keep and file.is_file():
                    file.unlink()

    # -- reading and repairing shards

    def read_segment(self, m: Manifest, shard: int, batch: dict[str, Any]) -> tuple[Segment | None, SegmentProblem | None]:
        """One batch's rows of one shard, checked against the manifest; never wrong rows."""
        entry = batch["shards"][shard]
        root = self.path(m.name)
        expected = np.arange(batch["first"], batch["first"] + batch["chunks"], dtype=np.int64)
        expected = expected[expected % m.shards == shard]

        def problem(file: str, reason: str, repairable: bool) -> tuple[None, SegmentProblem]:
            return None, SegmentProblem(m.name, shard, batch["id"], file, reason, repairable)

        texts = self._read_checked(root / entry["texts"]["file"], entry["texts"]["sha256"])
        if texts is None:
            reason = "missing" if not (root / entry["texts"]["file"]).exists() else "checksum mismatch"
            return problem(entry["texts"]["file"], f"{reason}; the chunk texts are lost, re-create the corpus", False)
        rows = [json.loads(line) for line in texts.decode("utf-8").splitlines() if line]
        if len(rows) != len(expected) or any(r["position"] != p for r, p in zip(rows, expected)):
            return problem(entry["texts"]["file"], "rows do not match the manifest", False)
        if entry.get("fingerprint") != m.fingerprint:
            return problem(entry["vectors"]["file"], f"vectors from model {entry.get('fingerprint')}, corpus model {m.fingerprint}", True)
        data = self._read_checked(root / entry["vectors"]["file"], entry["vectors"]["sha256"])
        if data is None:
            reason = "missing" if not (root / entry["vectors"]["file"]).exists() else "checksum mismatch"
            return problem(entry["vectors"]["file"], reason, True)
        try:
            arrays = st_load(data)
            vectors, positions, flat, offsets = arrays["vectors"], arrays["positions"], arrays["tokens"], arrays["offsets"]
        except Exception as exc:  # safetensors raises its own error types
            return problem(entry["vectors"]["file"], f"unreadable ({exc})", True)
        if vectors.shape != (len(expected), m.dim) or not np.array_equal(positions, expected) or len(offsets) != len(expected) + 1:
            return problem(entry["vectors"]["file"], "arrays do not match the manifest", True)
        tokens = [flat[offsets[i] : offsets[i + 1]] for i in range(len(expected))]
        return Segment(batch["id"], positions, vectors, tokens, [r["doc"] for r in rows], [r["text"] for r in rows]), None

    def replace_vectors(self, name: str, shard: int, batch_id: int, vectors: np.ndarray, token_ids: Sequence[np.ndarray], fingerprint: str) -> Manifest:
        """Re-embedded vectors for one segment whose texts are intact (repair / reindex)."""
        with self.lock(name):
            m = self.read(name)
            if fingerprint != m.fingerprint:
                raise CorpusConflict(f"corpus {name!r} is for model {m.fingerprint}, not {fingerprint}")
            batch = next((b for b in m.batches if b["id"] == batch_id), None)
            if batch is None:
                raise StoreError(f"corpus {name!r} has no batch {batch_id}")
            segment_texts = self.read_texts(m, shard, batch)
            if len(segment_texts) != len(vectors):
                raise StoreError(f"corpus {name!r} shard {shard} batch {batch_id}: {len(vectors)} vectors for {len(segment_texts)} chunks")
            positions = np.asarray([p for p, _, _ in segment_texts], dtype=np.int64)
            old = batch["shards"][shard]
            new = self._write_segment(m, shard, f"batch_{batch_id:06d}", positions, vectors, token_ids,
                                      [d for _, d, _ in segment_texts], [t for _, _, t in segment_texts], fingerprint)
            batch["shards"][shard] = new
            m.version += 1
            self._write_manifest(m)
            old_file = self.path(name) / old["vectors"]["file"]
            if old["vectors"]["file"] != new["vectors"]["file"] and old_file.exists():
                old_file.unlink()
            return m

    def read_texts(self, m: Manifest, shard: int, batch: dict[str, Any]) -> list[tuple[int, str, str]]:
        """(position, doc id, text) of a segment, checked; a StoreError when they are lost."""
        entry = batch["shards"][shard]
        data = self._read_checked(self.path(m.name) / entry["texts"]["file"], entry["texts"]["sha256"])
        if data is None:
            raise StoreError(f"corpus {m.name!r} shard {shard}: {entry['texts']['file']} is missing or corrupt")
        rows = [json.loads(line) for line in data.decode("utf-8").splitlines() if line]
        return [(r["position"], r["doc"], r["text"]) for r in rows]

    def set_fingerprint(self, name: str, fingerprint: str, dim: int, model: ModelConfig) -> Manifest:
        """Start a re-index with another model: every segment turns stale until re-embedded."""
        with self.lock(name):
            m = self.read(name)
            m.fingerprint, m.dim, m.model = fingerprint, int(dim), to_dict(model)
            m.version += 1
            self._write_manifest(m)
            return m


# ---------------------------------------------------------------------------------------------
# Scoring one shard


def positions_at(mode: str, gpos: torch.Tensor, selected: torch.Tensor, n_total: int, delta: float, ell: float) -> torch.Tensor | None:
    """Positions of the chunks at global indices ``gpos`` [n] for each row of ``selected``
    [B, k] (sorted global indices; pad with ``n_total``), as :func:`qrag.positions.chunk_positions`
    computes them over the whole context — the same float32 arithmetic, for a subset of columns."""
    b = selected.shape[0]
    if mode == "none":
        return None
    if mode == "absolute":
        return gpos.to(torch.float32).expand(b, -1)
    if mode != "relative":
        raise ValueError(f"unknown positions mode {mode!r}")
    m = torch.full((b, 1), n_total, dtype=torch.long, device=gpos.device)
    bounds = torch.cat([selected.to(torch.long), m], dim=1)  # b_1..b_k, then m
    idx = gpos.expand(b, -1).contiguous()
    j = torch.searchsorted(bounds, idx, right=True)  # selected indices <= i
    prev = torch.where(j > 0, bounds.gather(1, (j - 1).clamp(min=0)), torch.zeros_like(idx))
    nxt = torch.minimum(bounds.gather(1, j), m)
    width = (nxt - prev).clamp(min=1).to(torch.float32)
    return j.to(torch.float32) * delta + ell * (idx - prev).to(torch.float32) / width


@dataclass
class ShardHits:
    """Top-k of one shard (or of several, merged) for each state row."""

    q: np.ndarray  # [B, k] float32, best first; -inf pads rows with fewer candidates
    ids: np.ndarray  # [B, k] int64 global positions (-1 for pads)
    pos: np.ndarray | None  # [B, k] float32 positions used in the rotation (None: positions off)
    records: dict[int, ChunkRecord] = field(default_factory=dict)

    def rows(self, lo: int, hi: int) -> ShardHits:
        """The hits of state rows [lo, hi) (records are shared, not filtered)."""
        return ShardHits(self.q[lo:hi], self.ids[lo:hi], None if self.pos is None else self.pos[lo:hi], self.records)

    @classmethod
    def empty(cls, rows: int, with_pos: bool) -> ShardHits:
        return cls(np.zeros((rows, 0), np.float32), np.zeros((rows, 0), np.int64), np.zeros((rows, 0), np.float32) if with_pos else None)


def merge_hits(hits: Sequence[ShardHits], k: int) -> ShardHits:
    """The best ``k`` of every row over all shards (ties broken by position), padded with -inf."""
    q = np.concatenate([h.q for h in hits], axis=1)
    ids = np.concatenate([h.ids for h in hits], axis=1)
    with_pos = hits[0].pos is not None
    pos = np.concatenate([h.pos for h in hits], axis=1) if with_pos else None
    rows = q.shape[0]
    out_q = np.full((rows, k), -np.inf, np.float32)
    out_i = np.full((rows, k), -1, np.int64)
    out_p = np.zeros((rows, k), np.float32) if with_pos else None
    for r in range(rows):
        order = np.lexsort((ids[r], -q[r]))[:k]
        order = order[np.isfinite(q[r][order])]
        out_q[r, : len(order)] = q[r][order]
        out_i[r, : len(order)] = ids[r][order]
        if with_pos:
            out_p[r, : len(order)] = pos[r][order]
    records: dict[int, ChunkRecord] = {}
    keep = set(out_i[out_i >= 0].tolist())
    for h in hits:
        records.update({g: rec for g, rec in h.records.items() if g in keep})
    return ShardHits(out_q, out_i, out_p, records)


@dataclass
class ShardOptions:
    """How a shard scores: exact torch (always with RoPE positions) or FAISS (positions off)."""

    faiss: str = "auto"  # auto: FAISS on CPU shards when positions are off | always | never
    approx_above: int = 2_000_000  # chunks per shard above which FAISS uses HNSW instead of flat IP
    hnsw_m: int = 32
    hnsw_ef_search: int = 128
    score_block: int = 1 << 18  # (state row x chunk) pairs rotated at once: bounds temporary memory


class ShardIndex:
    """One shard of one corpus in memory.

    Vectors live on ``device`` in float32 and grow by appends (capacity doubles). Scores are
    Q = mean of the twin halves of <s, R(pos) a>, computed exactly in torch in column blocks; with
    positions off and ``faiss`` allowed, an inner-product FAISS index gives the candidates instead.
    """

    def __init__(self, corpus: str, shard: int, n_shards: int, model: ModelConfig, dim: int, device: torch.device, options: ShardOptions | None = None):
        self.corpus, self.shard, self.n_shards = corpus, shard, n_shards
        self.model, self.dim, self.device = model, dim, device
        self.options = options or ShardOptions()
        self._buf = torch.zeros(0, dim, device=device)
        self.n = 0
        self.doc_ids: list[str] = []
        self.texts: list[str] = []
        self.tokens: list[np.ndarray] = []
        self.loaded: dict[int, str] = {}  # batch id -> sha256 of the vectors file loaded
        self._faiss = None
        self._faiss_n = 0
        self._lock = threading.Lock()

    @property
    def vectors(self) -> torch.Tensor:
        return self._buf[: self.n]

    @property
    def uses_faiss(self) -> bool:
        o = self.options.faiss
        if self.model.positions != "none" or o == "never":
            return False
        if o == "always":
            return _faiss() is not None
        return self.device.type == "cpu" and _faiss() is not None

    def nbytes(self) -> int:
        return self.n * self.dim * 4

    def add(self, segment: Segment) -> None:
        n_new = len(segment.positions)
        expected = self.shard + self.n_shards * np.arange(self.n, self.n + n_new)
        if not np.array_equal(segment.positions, expected):
            raise StoreError(f"corpus {self.corpus!r} shard {self.shard}: batch {segment.batch} rows out of order")
        with self._lock:
            need = self.n + n_new
            if need > len(self._buf):
                grown = torch.zeros(max(need, 2 * len(self._buf), 1024), self.dim, device=self.device)
                grown[: self.n] = self._buf[: self.n]
                self._buf = grown
            self._buf[self.n : need] = torch.from_numpy(np.asarray(segment.vectors, dtype=np.float32)).to(self.device)
            self.doc_ids.extend(segment.doc_ids)
            self.texts.extend(segment.texts)
            self.tokens.extend(segment.tokens)
            self.n = need

    def record(self, g: int) -> ChunkRecord:
        r = g // self.n_shards
        return ChunkRecord(self.doc_ids[r], self.texts[r], self.tokens[r])

    def _faiss_index(self):
        faiss = _faiss()
        with self._lock:
            if self._faiss is None:
                o = self.options
                if self.n > o.approx_above:
                    index = faiss.IndexHNSWFlat(self.dim, o.hnsw_m, faiss.METRIC_INNER_PRODUCT)
                    index.hnsw.efSearch = o.hnsw_ef_search
                else:
                    index = faiss.IndexFlatIP(self.dim)
                self._faiss, self._faiss_n = index, 0
            if self._faiss_n < self.n:
                self._faiss.add(np.ascontiguousarray(self.vectors[self._faiss_n : self.n].cpu().numpy()))
                self._faiss_n = self.n
            return self._faiss

    @torch.no_grad()
    def topk(self, states: torch.Tensor | np.ndarray, selected: Sequence[Sequence[int]], n_total: int, k: int) -> ShardHits:
        """Each state row's best ``k`` chunks of this shard among the first ``n_total`` global
        positions, the row's ``selected`` (global) chunks excluded."""
        n = min(self.n, shard_rows(self.shard, self.n_shards, n_total))
        states = (states if torch.is_tensor(states) else torch.tensor(np.asarray(states))).to(self.device, torch.float32)
        rows = len(states)
        with_pos = self.model.positions != "none"
        if n == 0 or k <= 0:
            return ShardHits.empty(rows, with_pos)
        mine = [[g // self.n_shards for g in sel if g % self.n_shards == self.shard and g < n_total] for sel in selected]
        if self.uses_faiss:
            q, local = self._faiss_topk(states, mine, n, k)
            pos = None
        else:
            q, local, pos = self._exact_topk(states, selected, mine, n, n_total, k)
        ids = np.where(local >= 0, self.shard + self.n_shards * local, -1)
        records = {int(g): self.record(int(g)) for g in np.unique(ids[ids >= 0])}
        return ShardHits(q, ids.astype(np.int64), pos, records)

    def _exact_topk(self, states, selected, mine, n, n_total, k):
        dev = self.device
        vectors = self.vectors[:n]
        gpos = self.shard + self.n_shards * torch.arange(n, device=dev)
        width = max(1, max((len(s) for s in selected), default=0))
        sel = torch.full((len(states), width), n_total, dtype=torch.long, device=dev)
        for r, s in enumerate(selected):
            if len(s):
                sel[r, : len(s)] = torch.as_tensor(sorted(s), dtype=torch.long, device=dev)
        c = self.model
        pos = positions_at(c.positions, gpos, sel, n_total, c.relative_delta, c.relative_ell)
        q = torch.empty(len(states), n, device=dev, dtype=torch.float32)
        block = max(1, self.options.score_block // max(1, len(states)))
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            vecs = vectors[lo:hi].unsqueeze(0).expand(len(states), -1, -1)
            placed = vecs if pos is None else rotate(vecs, pos[:, lo:hi], c.rope_base)
            q[:, lo:hi] = QNetwork.twin_scores(states, placed).mean(-1)
        for r, rows in enumerate(mine):
            if rows:
                q[r, rows] = float("-inf")
        kk = min(k, n)
        top_q, top_i = q.topk(kk, dim=1)
        top_pos = None if pos is None else pos.gather(1, top_i).cpu().numpy()
        top_q, top_i = top_q.cpu().numpy(), top_i.cpu().numpy()
        top_i = np.where(np.isfinite(top_q), top_i, -1)
        return top_q, top_i, top_pos

    def _faiss_topk(self, states, mine, n, k):
        index = self._faiss_index()
        extra = max((len(m) for m in mine), default=0) + (self.n - n)  # rows to filter out afterwards
        kk = min(self.n, k + extra)
        dist, local = index.search(np.ascontiguousarray(states.cpu().numpy()), kk)
        out_q = np.full((len(states), min(k, n)), -np.inf, np.float32)
        out_i = np.full(out_q.shape, -1, np.int64)
        for r in range(len(states)):
            banned = set(mine[r])
            keep = [(float(d) / 2.0, int(i)) for d, i in zip(dist[r], local[r]) if 0 <= i < n and int(i) not in banned]
            keep = keep[: out_q.shape[1]]
            out_q[r, : len(keep)] = [d for d, _ in keep]  # Q = mean of the twin halves = <s, a> / 2
            out_i[r, : len(keep)] = [i for _, i in keep]
        return out_q, out_i


_FAISS: Any = None


def _faiss():
    """faiss when installed (the GPU bench machine may lack it: shards then score in torch)."""
    global _FAISS
    if _FAISS is None:
        try:
            import faiss  # noqa: PLC0415

            _FAISS = faiss
        except ImportError:
            _FAISS = False
    return _FAISS or None


class ShardUnhealthy(StoreError):
    def __init__(self, problems: Sequence[SegmentProblem]):
        self.problems = list(problems)
        super().__init__("; ".join(str(p) for p in self.problems))

    def __reduce__(self):  # picklable across processes (Ray)
        return (ShardUnhealthy, (self.problems,))


class CorpusShards:
    """The shards ``slots`` of one corpus held by one process, kept in step with the store."""

    def __init__(self, store: CorpusStore, name: str, slots: Sequence[int], device: torch.device, options: ShardOptions | None = None):
        self.store, self.name, self.slots, self.device = store, name, list(slots), device
        self.options = options or ShardOptions()
        self.uid: str | None = None
        self.version = -1
        self.shards: dict[int, ShardIndex] = {}
        self.problems: list[SegmentProblem] = []
        self.loaded_rows = 0  # rows read from disk since start (the durability test reads it)
        self._sync_lock = threading.Lock()

    def sync(self, min_version: int = 0, uid: str | None = None) -> None:
        """Load what the manifest has and this process has not; reload a shard whose loaded
        segment was replaced. Raises :class:`ShardUnhealthy` rather than serve a bad shard."""
        if self.version >= min_version and (uid is None or uid == self.uid) and not self.problems:
            return
        with self._sync_lock:
            m = self.store.read(self.name)
            if uid is not None and m.uid != uid:
                raise CorpusNotFound(f"corpus {self.name!r} was deleted and re-created; retry")
            if m.uid != self.uid:
                self.shards, self.uid = {}, m.uid
            problems: list[SegmentProblem] = []
            for slot in self.slots:
                if slot >= m.shards:
                    continue
                shard = self.shards.get(slot)
                replaced = shard is not None and any(
                    b["id"] in shard.loaded and shard.loaded[b["id"]] != b["shards"][slot]["vectors"]["sha256"] for b in m.batches
                )
                if shard is None or replaced:
                    shard = ShardIndex(m.name, slot, m.shards, m.model_cfg, m.dim, self.device, self.options)
                new = [b for b in m.batches if b["id"] not in shard.loaded]
                slot_problems = []
                for b in new:
                    segment, problem = self.store.read_segment(m, slot, b)
                    if problem is not None:
                        slot_problems.append(problem)
                        break  # later rows would land at the wrong positions
                    shard.add(segment)
                    shard.loaded[b["id"]] = b["shards"][slot]["vectors"]["sha256"]
                    self.loaded_rows += len(segment.positions)
                self.shards[slot] = shard
                problems.extend(slot_problems)
            self.problems = problems
            self.version = m.version
            if problems:
                raise ShardUnhealthy(problems)

    def topk(self, states, selected: Sequence[Sequence[int]], n_total: int, k: int) -> ShardHits:
        hits = [self.shards[s].topk(states, selected, n_total, k) for s in self.slots if s in self.shards]
        if not hits:
            return ShardHits.empty(len(states), False)
        return merge_hits(hits, k) if len(hits) > 1 else hits[0]

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.shards.values())


# ---------------------------------------------------------------------------------------------
# The multi-step search over shards


class SearchRun:
    """One question's search over sharded chunks: the beam logic of :class:`Retriever` fed by
    merged shard hits. Drive it with any transport (in-process shards, Serve handles)::

        while live := run.live():
            states = embed_states(run.states(live))
            run.advance(live, [shard.topk(states, run.selected(live), run.n_total, run.k) ...])
    """

    def __init__(self, question: np.ndarray, layout: TokenLayout, cfg: SearchConfig, n_total: int):
        if n_total < 1:
            raise StoreError("the corpus has no chunks")
        self.question, self.layout, self.cfg, self.n_total = question, layout, cfg, n_total
        self.width = max(1, cfg.beam_width)
        self.k = min(n_total, max(self.width, cfg.alternatives + 1))
        self.beams: list[_Beam] = [_Beam(0)]
        self.records: dict[int, ChunkRecord] = {}
        self.steps_done = 0

    def live(self) -> list[_Beam]:
        if self.steps_done >= self.cfg.max_steps:
            return []
        return [b for b in self.beams if not b.finished]

    def states(self, live: Sequence[_Beam]) -> list[np.ndarray]:
        return [self.layout.state(self.question, [self.records[i].tokens for i in sorted(b.chosen)]) for b in live]

    @staticmethod
    def selected(live: Sequence[_Beam]) -> list[list[int]]:
        return [sorted(b.chosen) for b in live]

    def advance(self, live: Sequence[_Beam], hits: Sequence[ShardHits]) -> None:
        merged = merge_hits(hits, self.k)
        self.records.update(merged.records)
        self.beams = Retriever._advance(self.beams, list(live), merged.q, merged.ids, merged.pos, self.cfg, self.width)
        self.steps_done += 1

    def result(self, sample_id: str = "", seconds: float = 0.0) -> Retrieval:
        best = max(self.beams, key=lambda b: b.score)
        stopped = best.finished and len(best.steps) < min(self.cfg.max_steps, self.n_total)
        return Retrieval(sample_id, best.steps, stopped_early=stopped, seconds=seconds)


# ---------------------------------------------------------------------------------------------
# In-process indexing and search (library path: tests, benchmarks, no Ray)


class Embedder(Protocol):
    """What indexing and search need of a model (see :class:`qrag.embedder.EmbeddingModel`)."""

    fingerprint: str
    model_cfg: ModelConfig
    dim: int
    layout: TokenLayout

    def count_tokens(self, texts: list[str]) -> list[int]: ...
    def tokenize_chunks(self, texts: Sequence[str], chunk_tokens: int) -> list[np.ndarray]: ...
    def tokenize_question(self, text: str) -> np.ndarray: ...
    def embed_chunks(self, seqs: Sequence[np.ndarray]) -> np.ndarray: ...
    def embed_states(self, seqs: Sequence[np.ndarray]) -> np.ndarray: ...


@dataclass
class Timings:
    """Seconds per stage of one retrieval."""

    tokenize: float = 0.0
    encode: float = 0.0
    score: float = 0.0
    merge: float = 0.0
    total: float = 0.0

    def as_ms(self) -> dict[str, float]:
        return {f"{k}_ms": round(v * 1000.0, 3) for k, v in asdict(self).items()}


class LocalIndex:
    """Index documents and search corpora in one process, every shard in memory."""

    def __init__(self, store: CorpusStore, model: Embedder, device: torch.device | str = "cpu", options: ShardOptions | None = None, chunk_batch: int = 4096):
        self.store, self.model = store, model
        self.device = torch.device(device)
        self.options = options or ShardOptions()
        self.chunk_batch = chunk_batch
        self._open: dict[str, CorpusShards] = {}

    def create(self, name: str, chunk_tokens: int, shards: int, dtype: str = "float32") -> Manifest:
        return self.store.create(name, fingerprint=self.model.fingerprint, model=self.model.model_cfg, dim=self.model.dim,
                                 chunk_tokens=chunk_tokens, shards=shards, dtype=dtype)

    def add_documents(self, name: str, docs: Sequence[Document], progress=None) -> Manifest:
        from .data.documents import chunk_documents

        m = self.store.read(name)
        chunks = chunk_documents(docs, self.model.count_tokens, m.chunk_tokens)
        ids = self.model.tokenize_chunks([c.text for c in chunks], m.chunk_tokens)
        parts = []
        for lo in range(0, len(ids), self.chunk_batch):
            parts.append(self.model.embed_chunks(ids[lo : lo + self.chunk_batch]))
            if progress is not None:
                progress(min(len(ids), lo + self.chunk_batch), len(ids))
        vectors = np.concatenate(parts) if parts else np.zeros((0, m.dim), np.float32)
        return self.store.append(name, docs, chunks, ids, vectors, self.model.fingerprint)

    def shards(self, name: str) -> CorpusShards:
        m = self.store.read(name)
        cs = self._open.get(name)
        if cs is None or cs.uid != m.uid:
            cs = self._open[name] = CorpusShards(self.store, name, range(m.shards), self.device, self.options)
        cs.sync(m.version, m.uid)
        return cs

    def retrieve(self, name: str, question: str, cfg: SearchConfig) -> tuple[Retrieval, dict[int, ChunkRecord], Timings]:
        t0 = time.perf_counter()
        timings = Timings()
        m = self.store.read(name)
        if m.fingerprint != self.model.fingerprint:
            raise CorpusConflict(f"corpus {name!r} was indexed with model {m.fingerprint}, not {self.model.fingerprint}")
        cs = self.shards(name)
        q_ids = self.model.tokenize_question(question)
        timings.tokenize = time.perf_counter() - t0
        run = SearchRun(q_ids, self.model.layout, cfg, m.chunks)
        while live := run.live():
            t = time.perf_counter()
            states = self.model.embed_states(run.states(live))
            t1 = time.perf_counter()
            hits = [cs.shards[s].topk(states, run.selected(live), m.chunks, run.k) for s in range(m.shards)]
            t2 = time.perf_counter()
            run.advance(live, hits)
            t3 = time.perf_counter()
            timings.encode += t1 - t
            timings.score += t2 - t1
            timings.merge += t3 - t2
        timings.total = time.perf_counter() - t0
        return run.result(seconds=timings.total), run.records, timings

    def retrieve_many(self, name: str, questions: Sequence[str], cfg: SearchConfig) -> list[Retrieval]:
        """Search several questions in lockstep: one state-encoder call and one scoring pass per
        shard per step for all of them (what batching concurrent requests buys)."""
        t0 = time.perf_counter()
        m = self.store.read(name)
        cs = self.shards(name)
        runs = [SearchRun(self.model.tokenize_question(q), self.model.layout, cfg, m.chunks) for q in questions]
        while True:
            live = [(run, run.live()) for run in runs]
            live = [(run, beams) for run, beams in live if beams]
            if not live:
                break
            seqs = [s for run, beams in live for s in run.states(beams)]
            selected = [sel for run, beams in live for sel in run.selected(beams)]
            states = self.model.embed_states(seqs)
            hits = [cs.shards[s].topk(states, selected, m.chunks, max(run.k for run, _ in live)) for s in range(m.shards)]
            lo = 0
            for run, beams in live:
                run.advance(beams, [h.rows(lo, lo + len(beams)) for h in hits])
                lo += len(beams)
        seconds = (time.perf_counter() - t0) / max(1, len(runs))
        return [run.result(seconds=seconds) for run in runs]
