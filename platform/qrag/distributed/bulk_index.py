"""Bulk indexing on a Ray cluster: the two routes of ``qrag index`` (and ``jobs/index_corpus.py``)
under a cluster address, picked by :func:`qrag.index.bulk.cluster_path` in :func:`index_on_cluster`.

**The lanes on one GPU node** (:func:`lanes_on_a_node`, the default on a cluster with GPU nodes): a
Ray task that holds every GPU of one node runs :func:`qrag.index.bulk.index_files` there, the path
``qrag index`` takes on a single machine; it streams each commit's figures back to the driver. The
storage and the inputs must be reachable from that node (a shared file system or an fsspec URL).

**Ray Data** (:func:`bulk_index`, the default on a cluster without GPUs, or ``--path ray``):
files -> documents -> chunks + token ids -> vectors -> store.

::

    input files (qrag.data.records: JSONL / text / parquet; local paths, globs, folders or any fsspec URL)
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
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from qrag.data.documents import Document, DocumentChunk
from qrag.data.records import expand_inputs, plan_parts, read_records
from qrag.data.sample import DataError
from qrag.index.bulk import USER_ERRORS, BulkIndexConfig, cluster_path
from qrag.distributed.loopback import keep_ray_on_loopback
from qrag.index.store import CorpusConflict, CorpusNotFound, CorpusStore, Manifest, StoreError
from qrag.model.encoder import host_settings_while_feeding
from qrag.retrieval.embedder import load_embedding_model, resolve_source, source_identity


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

        source = resolve_source(
            model["checkpoint"], model["encoder"], model["model_cache"], model["mlflow_tracking_uri"]
        )
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
        source = resolve_source(
            model["checkpoint"], model["encoder"], model["model_cache"], model["mlflow_tracking_uri"]
        )
        self.model = load_embedding_model(source, device, encode_tokens=encode_tokens, chunk_batch=encode_batch)
        if self.model.fingerprint != fingerprint:
            raise CorpusConflict(
                f"the encoder actor loaded model {self.model.fingerprint}, the driver expected {fingerprint}"
            )

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        t0 = time.perf_counter()
        with host_settings_while_feeding(self.model.device):  # one torch thread, a short GIL interval (see there)
            vectors = (
                self.model.embed_chunks(list(batch["tokens"]))
                if len(batch["tokens"])
                else np.zeros((0, self.model.dim), np.float32)
            )
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
        cause = getattr(
            e, "cause", None
        )  # a RayTaskError's: the task's own exception (the error itself may pose as one)
        if isinstance(e, USER_ERRORS) and cause is None:
            return type(e)(str(e).strip().splitlines()[-1] if "Traceback" in str(e) else str(e))
        todo += [cause, e.__cause__, e.__context__]
    return None


def _raise_user_error(exc: BaseException) -> None:
    """Raise the user's error that a Ray task raised inside ``exc``, alone, where there is one."""
    user = _user_error(exc)
    if user is not None and user is not exc:
        raise user from None


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
        keep_ray_on_loopback()
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, configure_logging=False)


def bulk_index(
    cfg: BulkIndexConfig,
    progress: Callable[[dict[str, Any]], None] | None = None,
    on_commit: Callable[[Manifest], None] | None = None,
) -> dict[str, Any]:
    """Index ``cfg.inputs`` into corpus ``cfg.corpus`` (created when missing) on the running Ray
    (started by :func:`ensure_ray` when there is none). Returns the run's figures (:class:`BulkStats`).
    ``progress`` gets them after every commit; ``on_commit`` gets the manifest (tests interrupt the run there)."""
    import ray
    from ray.data import ActorPoolStrategy, DataContext

    cfg = cfg.with_defaults("ray")
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
            raise CorpusConflict(
                f"corpus {cfg.corpus!r} was indexed with model {manifest.fingerprint}; "
                f"{source.describe()} is {fingerprint}"
            )
        manifest.check_settings(chunk_tokens=cfg.chunk_tokens, shards=cfg.shards, dtype=cfg.dtype)
        committed = frozenset(store.doc_ids(manifest))
        chunk_tokens = manifest.chunk_tokens
    else:
        store.path(cfg.corpus)  # a bad name fails before any work
        committed = frozenset()
        chunk_tokens = cfg.chunk_tokens or 64
    stats.already_committed = len(committed)

    ensure_ray()  # after the checks above: a bad input or corpus fails before Ray starts
    gpus = (
        cfg.encoder_gpus
        if cfg.encoder_gpus is not None
        else (1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0)
    )
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
        ds = ray.data.from_items(
            [{"path": p, "format": f, "start": a, "end": b} for p, f, a, b in parts],
            override_num_blocks=max(1, len(parts)),
        )
        # Two actor pools: Ray Data never fuses them (a task stage would be fused into the encoder
        # actors on a CPU-only cluster, which would then read files one at a time between forwards).
        ds = ds.map_batches(
            DocumentChunker,
            batch_size=1,
            batch_format="numpy",
            num_cpus=cfg.tokenize_cpus,
            compute=ActorPoolStrategy(min_size=1, max_size=tokenizers),
            fn_constructor_kwargs={
                "model": model,
                "chunk_tokens": chunk_tokens,
                "docs_per_block": cfg.docs_per_block,
                "skip": ray.put(committed) if committed else None,
            },
        )
        ds = ds.map_batches(
            ChunkEncoder,
            batch_size=cfg.encode_batch,
            batch_format="numpy",
            compute=ActorPoolStrategy(size=cfg.encoder_actors),
            num_gpus=gpus,
            num_cpus=cfg.encoder_cpus,
            fn_constructor_kwargs={
                "model": model,
                "fingerprint": fingerprint,
                "device": "cuda" if gpus > 0 else "cpu",
                "encode_tokens": cfg.encode_tokens,
                "encode_batch": cfg.encode_batch,
            },
        )
        manifest = _drain(
            ds, store, cfg, manifest, fingerprint, model_cfg, chunk_tokens, stats, t_start, progress, on_commit
        )
    except Exception as exc:
        _raise_user_error(exc)
        raise
    finally:
        ctx.execution_options.preserve_order, ctx.target_max_block_size = saved
    if manifest is None:
        raise DataError(f"{', '.join(cfg.inputs)}: no documents to index")
    stats.corpus_documents, stats.corpus_chunks = manifest.documents, manifest.chunks
    stats.seconds = time.perf_counter() - t_start
    return {"path": "ray", "devices": ["cuda" if gpus > 0 else "cpu"] * cfg.encoder_actors, **stats.summary()}


def _drain(
    ds,
    store: CorpusStore,
    cfg: BulkIndexConfig,
    manifest: Manifest | None,
    fingerprint: str,
    model_cfg,
    chunk_tokens: int,
    stats: BulkStats,
    t_start: float,
    progress,
    on_commit,
) -> Manifest | None:
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
            manifest = store.create(
                cfg.corpus,
                fingerprint=fingerprint,
                model=model_cfg,
                dim=vecs.shape[1],
                chunk_tokens=chunk_tokens,
                shards=cfg.shards or 2,
                dtype=cfg.dtype or "float32",
                first=(docs, chunks, token_ids, vecs),
            )
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
        raise StoreError(
            f"corpus {cfg.corpus!r}: {len(pending)} document(s) incomplete at the end, "
            f"e.g. {next(iter(pending.values())).where}"
        )
    return manifest


# ---------------------------------------------------------------------------------------------
# The route under a cluster address, and the lanes on one node


def node_gpus() -> int:
    """The most GPUs one live node of the running Ray cluster has (0: no GPU node)."""
    import ray

    return max((int(node["Resources"].get("GPU", 0)) for node in ray.nodes() if node.get("Alive")), default=0)


def index_on_cluster(
    cfg: BulkIndexConfig, address: str | None, progress: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Join the cluster of ``address`` (a local Ray when None and none is running) and index there:
    the lanes on one node with the most GPUs, or Ray Data (:func:`qrag.index.bulk.cluster_path`)."""
    ensure_ray(address)
    gpus = node_gpus()
    if cluster_path(cfg, gpus) == "lanes":
        return lanes_on_a_node(cfg, gpus, progress)
    return bulk_index(cfg, progress=progress)


def lanes_on_a_node(
    cfg: BulkIndexConfig, gpus: int, progress: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """:func:`qrag.index.bulk.index_files` as one Ray task holding ``gpus`` GPUs of a node (its lanes
    on every one of them; on the CPU when 0). ``progress`` gets each commit's figures, streamed
    back from the node. Returns the run's figures with the node's address."""
    import ray

    task = ray.remote(_lanes_here).options(num_returns="streaming", num_gpus=gpus, name="qrag-index-lanes")
    result: dict[str, Any] = {}
    try:
        for ref in task.remote(replace(cfg, lanes="gpus" if gpus else "cpu")):
            event = ray.get(ref)
            if "commit" in event and progress is not None:
                progress(event["commit"])
            result = event.get("done", result)
    except Exception as exc:
        _raise_user_error(exc)
        raise
    return result


def _lanes_here(cfg: BulkIndexConfig) -> Iterator[dict[str, Any]]:
    """The task of :func:`lanes_on_a_node`, on its node: the lanes on the devices Ray gave it
    (CUDA_VISIBLE_DEVICES); yields ``{"commit": figures}`` after each commit, then ``{"done": figures}``."""
    import queue
    import threading

    from qrag.index.bulk import index_files

    files = expand_inputs(cfg.inputs, cfg.format)  # the node's view of the inputs and of the model
    source = resolve_source(cfg.checkpoint, cfg.encoder, cfg.model_cache, cfg.mlflow_tracking_uri)
    events: queue.Queue = queue.Queue()

    def run() -> None:  # in a thread: a generator cannot yield from inside the lanes' commit callback
        try:
            done = index_files(cfg, files, source, on_commit=lambda stats: events.put(("commit", stats)))
            events.put(("done", {**done, "node": _this_node()}))
        except BaseException as exc:  # noqa: BLE001 - raised in the task below
            events.put(("error", exc))

    threading.Thread(target=run, name="qrag-index-lanes", daemon=True).start()
    while True:
        kind, value = events.get()
        if kind == "error":
            raise value
        yield {kind: value}
        if kind == "done":
            return


def _this_node() -> str:
    """The address this node has in the cluster (the machine may have others)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    return next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), node_id)
