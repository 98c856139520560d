"""Bulk indexing as a Ray Data pipeline: files -> documents -> chunks + token ids -> vectors -> store.

::

    input files (JSONL / text / parquet; local paths, globs, folders or any fsspec URL)
      -> map_batches (an autoscaling pool of CPU actors, one input row = one part of a file:
         a whole file, or ``file_part_bytes`` of a large uncompressed JSONL file (whole lines) or
         of a parquet file's row groups, so one big file keeps every tokeniser busy): read
         records, skip the documents the corpus holds already, chunk them (sentence-aligned,
         token budget) and tokenise
      -> map_batches (actor pool, ``encoder_actors`` actors with a GPU each when the cluster has
         one): the chunk encoder, loaded once per actor, embeds length-bucketed batches (bf16
         autocast on GPU; qrag.model.encoder.encode sorts a batch by length and pads per bucket)
      -> the driver streams the rows (iter_batches) and appends whole documents to the corpus in
         committed groups of about ``commit_chunks`` chunks with CorpusStore.append, the one
         writer the HTTP path uses too (same files, same atomic manifest commit).

A crash or interrupt loses at most the uncommitted group: the next run with the same input reads
the corpus's document ids first and skips those documents before tokenising, so nothing already
committed is read into the pipeline or embedded again. With ``preserve_order`` (the default)
documents are committed in input order, so an interrupted-then-resumed run ends with the same
corpus (same global chunk positions) as one uninterrupted run, or as LocalIndex.add_documents.

Formats: ``jsonl`` (one ``{"id", "text"}`` object per line; other fields are ignored),
``parquet`` (columns ``id`` and ``text``), ``text`` (one document per file, its id the file name
without .txt/.md/.gz). Errors name the file and the record (line or row; in the parts of a
split JSONL file after the first, the line by its byte offset).
"""

from __future__ import annotations

import glob as globlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from qrag.model.checkpoint import CheckpointError
from qrag.data.documents import Document, DocumentChunk, parse_document
from qrag.data.sample import DataError
from qrag.model.encoder import host_settings_while_feeding
from qrag.retrieval.embedder import load_embedding_model, resolve_source, source_identity
from qrag.index.store import CorpusConflict, CorpusNotFound, CorpusStore, Manifest, StoreError

FORMATS = ("jsonl", "text", "parquet")
SUFFIXES = {
    "jsonl": (".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz", ".json", ".json.gz"),
    "text": (".txt", ".txt.gz", ".md", ".md.gz"),
    "parquet": (".parquet",),
}
USER_ERRORS = (DataError, StoreError, CheckpointError)


@dataclass
class BulkIndexConfig:
    corpus: str
    inputs: list[str]  # paths, globs, folders or fsspec URLs (s3://..., gs://..., memory://...)
    format: str = "auto"  # jsonl | text | parquet | auto (by file suffix)
    checkpoint: str | None = None  # checkpoint dir or MLflow URI; None = the untrained encoder
    encoder: str = "minilm"
    model_cache: str = ".qrag_models"
    mlflow_tracking_uri: str | None = None
    storage: str = "qrag_indexes"
    chunk_tokens: int | None = None  # None: the corpus's own, 64 for a new corpus
    shards: int | None = None  # None: the corpus's own, 2 for a new corpus
    dtype: str | None = None  # None: the corpus's own, float32 for a new corpus
    encoder_actors: int = 1
    encoder_gpus: float | None = None  # per actor; None = 1 when the cluster has a GPU, else 0
    encoder_cpus: float = 1.0
    tokenize_cpus: float = 1.0
    tokenize_actors: int | None = None  # most read+tokenise actors; None = the CPUs the encoder actors leave (autoscaled from 1)
    docs_per_block: int = 256  # documents chunked and tokenised per tokenizer call (one file part's blocks)
    file_part_bytes: int = 16 << 20  # large uncompressed JSONL and parquet files are read as parts of about this size (one task each)
    encode_batch: int = 4096  # chunks per encoder-actor call
    encode_tokens: int = 32768  # padded tokens per forward pass
    commit_chunks: int = 65536  # chunks per committed group (whole documents)
    preserve_order: bool = True
    block_bytes: int | None = None  # Ray Data's target block size for this run (default 128 MiB: ~100K chunk rows per block)
    max_files: int | None = None  # bench/tests: only the first N files

    def __post_init__(self) -> None:
        if isinstance(self.inputs, str):
            self.inputs = [self.inputs]
        if self.format not in (*FORMATS, "auto"):
            raise DataError(f"format must be one of {', '.join(FORMATS)} or auto, got {self.format!r}")
        for key in ("encoder_actors", "docs_per_block", "encode_batch", "encode_tokens", "commit_chunks", "file_part_bytes"):
            if getattr(self, key) < 1:
                raise DataError(f"{key} must be at least 1, got {getattr(self, key)}")

    def model_spec(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "encoder": self.encoder, "model_cache": self.model_cache,
                "mlflow_tracking_uri": self.mlflow_tracking_uri}


# ---------------------------------------------------------------------------------------------
# Inputs


def format_of(path: str) -> str | None:
    name = path.lower()
    return next((f for f, ends in SUFFIXES.items() if name.endswith(ends)), None)


def expand_inputs(inputs: Sequence[str], fmt: str = "auto") -> list[tuple[str, str]]:
    """(path or URL, format) of every input file, in a stable order; a clear error for a missing
    file, a glob that matches nothing, or a file whose format cannot be told."""
    from fsspec.core import url_to_fs
    from fsspec.implementations.local import LocalFileSystem

    out: list[tuple[str, str]] = []
    for spec in inputs:
        try:
            fs, path = url_to_fs(spec)
        except (ImportError, ValueError) as exc:  # an unknown protocol, a missing fsspec backend
            raise DataError(f"{spec}: cannot open: {exc}") from None
        local = isinstance(fs, LocalFileSystem)
        if globlib.has_magic(path):
            found = sorted(p for p in fs.glob(path) if fs.isfile(p))
            if not found:
                raise DataError(f"{spec}: no file matches")
        elif fs.isdir(path):
            found = sorted(p for p in fs.find(path) if (format_of(p) == fmt if fmt != "auto" else format_of(p)))
            if not found:
                raise DataError(f"{spec}: a folder without {fmt if fmt != 'auto' else 'jsonl, text or parquet'} files")
        elif fs.isfile(path):
            found = [path]
        else:
            raise DataError(f"{spec}: no such file or directory")
        for p in found:
            kind = fmt if fmt != "auto" else format_of(p)
            if kind is None:
                raise DataError(f"{p}: cannot tell the format from the name; pass --format jsonl|text|parquet")
            out.append((p if local else fs.unstrip_protocol(p), kind))
    seen: set[str] = set()
    return [x for x in out if not (x[0] in seen or seen.add(x[0]))]


def text_doc_id(path: str) -> str:
    name = path.rstrip("/").rsplit("/", 1)[-1]
    for end in (".gz", ".txt", ".md"):
        if name.lower().endswith(end):
            name = name[: -len(end)]
    return name


WHOLE = -1  # a part's end: to the end of the file


def plan_parts(files: Sequence[tuple[str, str]], part_bytes: int) -> list[tuple[str, str, int, int]]:
    """(path, format, start, end) of every read task, in corpus order. An uncompressed JSONL file
    over ``part_bytes`` is cut into byte ranges (a range holds the lines that start in it); a
    parquet file over it into runs of row groups of about that size; anything else is one part
    (0, WHOLE). Parts of one file follow each other, so the documents keep their order."""
    import fsspec
    from fsspec.utils import infer_compression

    parts: list[tuple[str, str, int, int]] = []
    for path, fmt in files:
        try:
            fs, local = fsspec.core.url_to_fs(path)
            size = fs.size(local) if fmt in ("jsonl", "parquet") else 0
        except (OSError, ValueError):
            size = 0  # read_records names the problem when the file is read
        if fmt == "jsonl" and size > part_bytes and infer_compression(path) is None:
            parts.extend((path, fmt, start, min(start + part_bytes, size)) for start in range(0, size, part_bytes))
        elif fmt == "parquet" and size > part_bytes:
            parts.extend((path, fmt, g0, g1) for g0, g1 in _row_group_runs(path, part_bytes))
        else:
            parts.append((path, fmt, 0, WHOLE))
    return parts


def _row_group_runs(path: str, part_bytes: int) -> list[tuple[int, int]]:
    """[first, end) row-group ranges of about ``part_bytes`` (uncompressed) each."""
    import fsspec
    import pyarrow.parquet as pq

    try:
        with fsspec.open(path, "rb") as fh:
            md = pq.ParquetFile(fh).metadata
    except Exception:  # noqa: BLE001 - read_records names what is wrong with the file
        return [(0, WHOLE)]
    runs, first, size = [], 0, 0
    for g in range(md.num_row_groups):
        size += md.row_group(g).total_byte_size
        if size >= part_bytes:
            runs.append((first, g + 1))
            first, size = g + 1, 0
    if first < md.num_row_groups or not runs:
        runs.append((first, WHOLE))
    return runs


def _jsonl_lines(path: str, start: int, end: int) -> Iterator[tuple[str, str]]:
    """(record label, line) of a JSONL file, or of the lines that start in [start, end) of an
    uncompressed one (labelled by line number in the first part, by byte offset after it)."""
    import fsspec

    if start == 0 and end == WHOLE:
        with fsspec.open(path, "rt", encoding="utf-8", compression="infer") as fh:
            for lineno, line in enumerate(fh, 1):
                yield f"line {lineno}", line
        return
    with fsspec.open(path, "rb") as fh:
        if start > 0:
            fh.seek(start - 1)
            fh.readline()  # the line holding byte start - 1 started in the part before
        lineno = 0
        while True:
            pos = fh.tell()
            if end != WHOLE and pos >= end:
                return
            raw = fh.readline()
            if not raw:
                return
            lineno += 1
            yield (f"line {lineno}" if start == 0 else f"line at byte {pos}"), raw.decode("utf-8")


def read_records(path: str, fmt: str, start: int = 0, end: int = WHOLE) -> Iterator[tuple[str, Document]]:
    """(record label, document) of one file, or of one part of it (:func:`plan_parts`: a JSONL
    byte range or a parquet row-group range); DataError names the file and the record."""
    import fsspec

    try:
        if fmt == "jsonl":
            for label, line in _jsonl_lines(path, start, end):
                if not line.strip():
                    continue
                at = f"{path}: {label}"
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{at}: not JSON ({exc.msg} at column {exc.colno})") from None
                yield label, parse_document(rec, at, extra_fields=True)
        elif fmt == "text":
            with fsspec.open(path, "rt", encoding="utf-8", compression="infer") as fh:
                text = fh.read().lstrip("\ufeff")
            yield "file", parse_document({"id": text_doc_id(path), "text": text}, path)
        elif fmt == "parquet":
            import pyarrow.parquet as pq

            with fsspec.open(path, "rb") as fh:
                pf = pq.ParquetFile(fh)
                missing = {"id", "text"} - set(pf.schema_arrow.names)
                if missing:
                    raise DataError(f"{path}: no column {sorted(missing)[0]!r} (a document has 'id' and 'text')")
                groups = range(start, pf.metadata.num_row_groups if end == WHOLE else end)
                row = sum(pf.metadata.row_group(g).num_rows for g in range(start))
                for batch in pf.iter_batches(columns=["id", "text"], batch_size=1024, row_groups=list(groups)):
                    for rec in batch.to_pylist():
                        yield f"row {row}", parse_document(rec, f"{path}: row {row}")
                        row += 1
        else:
            raise DataError(f"{path}: unknown format {fmt!r}")
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except (OSError, EOFError) as exc:
        raise DataError(f"{path}: cannot read: {exc}") from None
    except Exception as exc:  # pyarrow's errors (a file that is no parquet)
        if isinstance(exc, DataError):
            raise
        raise DataError(f"{path}: cannot read as {fmt}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# Stage 1 (CPU tasks): files -> chunk rows

def chunk_rows(path: str, docs: Sequence[tuple[str, Document]], tok, chunk_tokens: int) -> dict[str, np.ndarray]:
    """Documents of one file -> one row per chunk (corpus order), with what the driver needs to
    put whole documents together again and to name the record in errors."""
    try:
        chunks, ids = tok.chunk_documents([d for _, d in docs], chunk_tokens)
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from None
    per_doc: dict[str, int] = {}
    for c in chunks:
        per_doc[c.doc_id] = per_doc.get(c.doc_id, 0) + 1
    record_of = {d.id: rec for rec, d in docs}
    index, seen = [], {}
    for c in chunks:
        index.append(seen.get(c.doc_id, 0))
        seen[c.doc_id] = index[-1] + 1
    tokens = np.empty(len(ids), dtype=object)
    tokens[:] = [np.asarray(x, dtype=np.int32) for x in ids]
    return {
        "doc_id": np.asarray([c.doc_id for c in chunks], dtype=object),
        "source": np.asarray([path] * len(chunks), dtype=object),
        "record": np.asarray([record_of[c.doc_id] for c in chunks], dtype=object),
        "chunk": np.asarray(index, dtype=np.int32),
        "n_chunks": np.asarray([per_doc[c.doc_id] for c in chunks], dtype=np.int32),
        "text": np.asarray([c.text for c in chunks], dtype=object),
        "ntok": np.asarray([c.tokens for c in chunks], dtype=np.int32),
        "tokens": tokens,
    }


class DocumentChunker:
    """Stage 1, an autoscaling pool of CPU actors (the tokenizer loaded once per actor): one
    input row per file part (:func:`plan_parts`) -> its documents, minus the committed ones, as
    chunk rows in blocks of ``docs_per_block`` documents. ``prep_s`` carries a block's seconds on its first row."""

    def __init__(self, model: dict[str, Any], chunk_tokens: int, skip, docs_per_block: int):
        import ray

        from qrag.retrieval.embedder import Tokenization

        source = resolve_source(model["checkpoint"], model["encoder"], model["model_cache"], model["mlflow_tracking_uri"])
        _, _, tokenizer, layout = source_identity(source)
        self.tok = Tokenization(tokenizer, layout)
        self.chunk_tokens, self.docs_per_block = chunk_tokens, docs_per_block
        self.committed = ray.get(skip) if skip is not None else frozenset()

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        for path, fmt, start, end in zip(batch["path"], batch["format"], batch["start"], batch["end"]):
            t0 = time.perf_counter()
            docs: list[tuple[str, Document]] = []
            ids: dict[str, str] = {}
            for record, doc in read_records(str(path), str(fmt), int(start), int(end)):
                if doc.id in ids:
                    raise DataError(f"{path}: {record}: duplicate document id {doc.id!r} (also at {ids[doc.id]})")
                ids[doc.id] = record
                if doc.id in self.committed:
                    continue
                docs.append((record, doc))
                if len(docs) >= self.docs_per_block:
                    yield _timed(chunk_rows(str(path), docs, self.tok, self.chunk_tokens), t0)
                    docs, t0 = [], time.perf_counter()
            if docs:
                yield _timed(chunk_rows(str(path), docs, self.tok, self.chunk_tokens), t0)


def _timed(rows: dict[str, np.ndarray], t0: float) -> dict[str, np.ndarray]:
    n = len(rows["doc_id"])
    seconds = np.zeros(n, dtype=np.float64)
    if n:
        seconds[0] = time.perf_counter() - t0
    rows["prep_s"] = seconds
    return rows


# ---------------------------------------------------------------------------------------------
# Stage 2 (actor pool): chunk rows -> vectors


class ChunkEncoder:
    """One encoder per actor, loaded once; ``__call__`` embeds a batch of chunk rows."""

    def __init__(self, model: dict[str, Any], fingerprint: str, device: str, encode_tokens: int, encode_batch: int):
        source = resolve_source(model["checkpoint"], model["encoder"], model["model_cache"], model["mlflow_tracking_uri"])
        self.model = load_embedding_model(source, device, encode_tokens=encode_tokens, chunk_batch=encode_batch)
        if self.model.fingerprint != fingerprint:
            raise CorpusConflict(f"the encoder actor loaded model {self.model.fingerprint}, the driver expected {fingerprint}")

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        t0 = time.perf_counter()
        with host_settings_while_feeding(self.model.device):  # one torch thread, a short GIL interval (see there)
            vectors = self.model.embed_chunks(list(batch["tokens"])) if len(batch["tokens"]) else np.zeros((0, self.model.dim), np.float32)
        seconds = np.zeros(len(vectors), dtype=np.float64)
        if len(vectors):
            seconds[0] = time.perf_counter() - t0
        return {**batch, "vector": np.ascontiguousarray(vectors, dtype=np.float32), "embed_s": seconds}


# ---------------------------------------------------------------------------------------------
# The driver: stream, regroup whole documents, commit


@dataclass
class _PendingDoc:
    doc_id: str
    where: str
    n_chunks: int
    parts: dict[int, tuple[str, int, np.ndarray, np.ndarray]] = field(default_factory=dict)


@dataclass
class BulkStats:
    corpus: str
    files: int = 0
    parts: int = 0  # read tasks: files, large ones cut into parts (plan_parts)
    documents: int = 0  # committed by this run
    already_committed: int = 0  # documents in the corpus before this run (skipped where the input has them)
    chunks: int = 0
    tokens: int = 0  # text tokens of the chunks (no special tokens)
    encoder_tokens: int = 0  # token ids embedded ([CLS] chunk [SEP])
    chunks_embedded: int = 0
    commits: int = 0
    seconds: float = 0.0
    prep_seconds: float = 0.0  # summed over read+tokenise tasks (CPU seconds, they overlap)
    embed_seconds: float = 0.0  # summed over encoder actors
    write_seconds: float = 0.0  # the driver's store appends (checksummed, fsynced files)
    wait_seconds: float = 0.0  # the driver waiting for the pipeline
    encoder_actors: int = 0
    encoder_gpus: float = 0.0
    corpus_documents: int = 0
    corpus_chunks: int = 0

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out["tokens_per_s"] = round(self.tokens / self.seconds, 1) if self.seconds else 0.0
        out["encoder_tokens_per_s"] = round(self.encoder_tokens / self.seconds, 1) if self.seconds else 0.0
        for key in ("seconds", "prep_seconds", "embed_seconds", "write_seconds", "wait_seconds"):
            out[key] = round(out[key], 3)
        return out


def _user_error(exc: BaseException) -> BaseException | None:
    """The DataError/StoreError/... a Ray task raised, found in the wrapping exceptions."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, USER_ERRORS):
            return type(e)(str(e).strip().splitlines()[-1] if "Traceback" in str(e) else str(e))
        todo += [getattr(e, "cause", None), e.__cause__, e.__context__]
    return None


def ensure_ray(address: str | None = None) -> None:
    """Join the cluster of ``address``/$RAY_ADDRESS (``ray job submit`` sets it), else start a
    local Ray bound to loopback."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, configure_logging=False)
    else:
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, configure_logging=False)


def bulk_index(cfg: BulkIndexConfig, progress: Callable[[dict[str, Any]], None] | None = None,
               on_commit: Callable[[Manifest], None] | None = None) -> dict[str, Any]:
    """Index ``cfg.inputs`` into corpus ``cfg.corpus`` (created when missing) on the running Ray
    (started by :func:`ensure_ray` when there is none). Returns the run's figures (:class:`BulkStats`). ``progress`` gets
    them after every commit; ``on_commit`` gets the manifest (tests interrupt the run there)."""
    import ray
    from ray.data import ActorPoolStrategy, DataContext

    t_start = time.perf_counter()
    files = expand_inputs(cfg.inputs, cfg.format)
    if cfg.max_files is not None:
        files = files[: cfg.max_files]
    source = resolve_source(cfg.checkpoint, cfg.encoder, cfg.model_cache, cfg.mlflow_tracking_uri)
    fingerprint, model_cfg, _, _ = source_identity(source)
    store = CorpusStore(cfg.storage)
    stats = BulkStats(cfg.corpus, files=len(files))
    try:
        manifest: Manifest | None = store.read(cfg.corpus)
    except CorpusNotFound:
        manifest = None
    if manifest is not None:
        if manifest.fingerprint != fingerprint:
            raise CorpusConflict(f"corpus {cfg.corpus!r} was indexed with model {manifest.fingerprint}; {source.describe()} is {fingerprint}")
        manifest.check_settings(chunk_tokens=cfg.chunk_tokens, shards=cfg.shards, dtype=cfg.dtype)
        committed = frozenset(store.doc_ids(manifest))
        chunk_tokens = manifest.chunk_tokens
    else:
        store.path(cfg.corpus)  # a bad name fails before any work
        committed = frozenset()
        chunk_tokens = cfg.chunk_tokens or 64
    stats.already_committed = len(committed)

    ensure_ray()  # after the checks above: a bad input or corpus fails before Ray starts
    gpus = cfg.encoder_gpus if cfg.encoder_gpus is not None else (1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0)
    stats.encoder_actors, stats.encoder_gpus = cfg.encoder_actors, gpus
    model = cfg.model_spec()
    spare = ray.cluster_resources().get("CPU", 1) - cfg.encoder_actors * cfg.encoder_cpus
    parts = plan_parts(files, cfg.file_part_bytes)
    stats.parts = len(parts)
    tokenizers = cfg.tokenize_actors or max(1, min(len(parts), int(spare // max(cfg.tokenize_cpus, 1e-3))))
    ctx = DataContext.get_current()
    saved = ctx.execution_options.preserve_order, ctx.target_max_block_size
    ctx.execution_options.preserve_order = cfg.preserve_order
    if cfg.block_bytes:
        ctx.target_max_block_size = cfg.block_bytes
    try:
        ds = ray.data.from_items([{"path": p, "format": f, "start": a, "end": b} for p, f, a, b in parts],
                                 override_num_blocks=max(1, len(parts)))
        # Two actor pools: Ray Data never fuses them (a task stage would be fused into the encoder
        # actors on a CPU-only cluster, which would then read files one at a time between forwards).
        ds = ds.map_batches(DocumentChunker, batch_size=1, batch_format="numpy", num_cpus=cfg.tokenize_cpus,
                            compute=ActorPoolStrategy(min_size=1, max_size=tokenizers),
                            fn_constructor_kwargs={"model": model, "chunk_tokens": chunk_tokens, "docs_per_block": cfg.docs_per_block,
                                                   "skip": ray.put(committed) if committed else None})
        ds = ds.map_batches(ChunkEncoder, batch_size=cfg.encode_batch, batch_format="numpy", compute=ActorPoolStrategy(size=cfg.encoder_actors),
                            num_gpus=gpus, num_cpus=cfg.encoder_cpus,
                            fn_constructor_kwargs={"model": model, "fingerprint": fingerprint, "device": "cuda" if gpus > 0 else "cpu",
                                                   "encode_tokens": cfg.encode_tokens, "encode_batch": cfg.encode_batch})
        manifest = _drain(ds, store, cfg, manifest, fingerprint, model_cfg, chunk_tokens, stats, t_start, progress, on_commit)
    except Exception as exc:
        user = _user_error(exc)
        if user is not None and user is not exc:
            raise user from None
        raise
    finally:
        ctx.execution_options.preserve_order, ctx.target_max_block_size = saved
    if manifest is None:
        raise DataError(f"{', '.join(cfg.inputs)}: no documents to index")
    stats.corpus_documents, stats.corpus_chunks = manifest.documents, manifest.chunks
    stats.seconds = time.perf_counter() - t_start
    return stats.summary()


def _drain(ds, store: CorpusStore, cfg: BulkIndexConfig, manifest: Manifest | None, fingerprint: str, model_cfg, chunk_tokens: int,
           stats: BulkStats, t_start: float, progress, on_commit) -> Manifest | None:
    pending: dict[tuple[str, str], _PendingDoc] = {}
    ready: list[_PendingDoc] = []
    ready_chunks = 0
    where_of: dict[str, str] = {}  # doc id -> "file: record" of documents seen this run

    def commit() -> None:
        nonlocal manifest, ready, ready_chunks
        if not ready:
            return
        t0 = time.perf_counter()
        docs = [Document(d.doc_id, "") for d in ready]
        chunks, token_ids, vectors = [], [], []
        for d in ready:
            for i in range(d.n_chunks):
                text, ntok, ids, vec = d.parts[i]
                chunks.append(DocumentChunk(d.doc_id, text, ntok))
                token_ids.append(ids)
                vectors.append(vec)
        vecs = np.stack(vectors).astype(np.float32, copy=False)
        if manifest is None:
            manifest = store.create(cfg.corpus, fingerprint=fingerprint, model=model_cfg, dim=vecs.shape[1], chunk_tokens=chunk_tokens,
                                    shards=cfg.shards or 2, dtype=cfg.dtype or "float32", first=(docs, chunks, token_ids, vecs))
        else:
            manifest = store.append(cfg.corpus, docs, chunks, token_ids, vecs, fingerprint)
        stats.write_seconds += time.perf_counter() - t0
        stats.commits += 1
        stats.documents += len(docs)
        stats.chunks += len(chunks)
        stats.tokens += sum(c.tokens for c in chunks)
        ready, ready_chunks = [], 0
        if progress is not None:
            progress({**stats.summary(), "seconds": round(time.perf_counter() - t_start, 3)})
        if on_commit is not None:
            on_commit(manifest)

    t_wait = time.perf_counter()
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2):
        stats.wait_seconds += time.perf_counter() - t_wait
        n = len(batch["doc_id"])
        stats.prep_seconds += float(batch["prep_s"].sum())
        stats.embed_seconds += float(batch["embed_s"].sum())
        stats.chunks_embedded += n
        for i in range(n):
            key = (str(batch["source"][i]), str(batch["record"][i]))
            doc = pending.get(key)
            if doc is None:
                doc_id = str(batch["doc_id"][i])
                where = f"{key[0]}: {key[1]}"
                if doc_id in where_of:
                    raise DataError(f"{where}: duplicate document id {doc_id!r} (also at {where_of[doc_id]})")
                where_of[doc_id] = where
                doc = pending[key] = _PendingDoc(doc_id, where, int(batch["n_chunks"][i]))
            ids = np.asarray(batch["tokens"][i], dtype=np.int32)
            stats.encoder_tokens += len(ids)
            doc.parts[int(batch["chunk"][i])] = (str(batch["text"][i]), int(batch["ntok"][i]), ids, batch["vector"][i])
            if len(doc.parts) == doc.n_chunks:
                ready.append(pending.pop(key))
                ready_chunks += doc.n_chunks
        if ready_chunks >= cfg.commit_chunks:
            commit()
        t_wait = time.perf_counter()
    commit()
    if pending:  # cannot happen unless a stage dropped rows
        raise StoreError(f"corpus {cfg.corpus!r}: {len(pending)} document(s) incomplete at the end, e.g. {next(iter(pending.values())).where}")
    return manifest


def print_progress(stats: dict[str, Any]) -> None:
    print(f"qrag index: {stats['corpus']}: +{stats['documents']} documents, +{stats['chunks']} chunks, {stats['tokens']} tokens "
          f"in {stats['seconds']:.1f}s ({stats['tokens'] / max(stats['seconds'], 1e-9):,.0f} tokens/s), {stats['commits']} commits",
          file=sys.stderr, flush=True)
