"""The retrieval service without its transport: corpora (create, append, list, stats, delete,
re-index), retrieval over a corpus or an inline context, indexing jobs with progress.

Indexing jobs are admitted against bounds (per corpus and overall, across replicas: their
records live on the shared storage, see :mod:`qrag.index.jobs`), run a few at a time, and
always end ``done`` or ``failed`` with a reason. Every limit of a request is checked before
any work, and the chunk budget comes from the model (its positions minus special tokens).

It talks to an encoder and to shard holders through two small async interfaces, so the same
code runs behind Ray Serve (``qrag.distributed.serving`` passes deployment handles) and in one
process (:class:`LocalEncoder`, :class:`LocalShards`: tests and the library).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch

from qrag.config import ModelConfig, SearchConfig
from qrag.data.documents import Document, check_text, parse_documents
from qrag.data.sample import DataError
from qrag.retrieval.embedder import EmbeddingModel, Tokenization
from qrag.index.holder import ShardHolder, ShardOverBudget, corpus_bytes_per_holder
from qrag.index.jobs import Job, JobBoard, new_job_id
from qrag.index.local import HeldShards
from qrag.index.shards import ShardIndex, ShardOptions, ShardUnhealthy
from qrag.retrieval.hits import ShardHits
from qrag.index.store import CorpusConflict, CorpusNotFound, CorpusStore, Manifest, Segment, StoreError
from qrag.retrieval.hits import ChunkRecord
from qrag.retrieval.multistep import AsyncScoringBackend, ScoringBackend, SearchRun, Timings, search_async
from qrag.serving.service_config import ServeConfig

log = logging.getLogger("qrag.service")


class ServiceError(Exception):
    """An HTTP-mappable failure: status, the request field at fault, a message."""

    def __init__(self, status: int, field: str | None, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.field, self.message, self.headers = status, field, message, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"status": self.status, "field": self.field, "message": self.message}}


_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): (.*)$", re.S)


def data_error(exc: DataError, status: int = 422) -> ServiceError:
    """DataError messages start with the field they are about (``documents[3].text: ...``)."""
    match = _FIELD.match(str(exc))
    return ServiceError(status, match.group(1) if match else None, str(exc))


def store_error(exc: StoreError, corpus: str | None = None) -> ServiceError:
    """A store failure as an answer: unknown corpus 404, conflict 409, over the memory budget
    507, anything else (unreadable or damaged files) 503 naming the corpus."""
    if isinstance(exc, CorpusNotFound):
        return ServiceError(404, "corpus", str(exc))
    if isinstance(exc, CorpusConflict):
        return ServiceError(409, "corpus", str(exc))
    if isinstance(exc, ShardOverBudget):
        return ServiceError(507, "corpus", str(exc))
    return ServiceError(503, "corpus", str(exc) if corpus is None or repr(corpus) in str(exc) else f"corpus {corpus!r}: {exc}",
                        {"Retry-After": "5"})


def os_error(exc: OSError) -> ServiceError:
    """The storage failed under a request: full (507) or otherwise unavailable (503); the
    message names the errno, not the server's paths."""
    import errno

    if isinstance(exc, TimeoutError):  # an OSError too, since Python 3.10
        return ServiceError(503, None, "an operation timed out; retry", {"Retry-After": "5"})
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ServiceError(507, None, "the index storage is full; nothing of this request was stored")
    return ServiceError(503, None, f"the index storage failed ({errno.errorcode.get(exc.errno, 'I/O error')}); retry", {"Retry-After": "5"})


# The encoders' position embeddings of these model types start after the padding index.
_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert", "longformer", "mpnet", "data2vec-text", "xmod")


def encoder_positions(encoder) -> int | None:
    """How many token positions a Hugging Face encoder can embed (None: no such limit)."""
    config = getattr(encoder, "config", None)
    n = getattr(config, "max_position_embeddings", None)
    if not isinstance(n, int) or n <= 0:
        return None
    if getattr(config, "model_type", "") in _OFFSET_POSITIONS and isinstance(getattr(config, "pad_token_id", None), int):
        n -= config.pad_token_id + 1
    return n


def chunk_token_limit(max_positions: int | None, tok: Tokenization) -> int:
    """The largest chunk_tokens a chunk can have: the model's positions (and the tokenizer's
    max length) minus the special tokens wrapped around every chunk."""
    limits = [n for n in (max_positions, getattr(tok.tokenizer, "model_max_length", None)) if isinstance(n, int) and 0 < n < 1_000_000]
    special = len(tok.layout.wrap([]))
    return (min(limits) if limits else 512) - special


_CONTROL = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")


class EncoderClient(Protocol):
    async def embed_states(self, seqs: list[np.ndarray]) -> np.ndarray: ...
    async def embed_chunks(self, seqs: list[np.ndarray]) -> np.ndarray: ...


class ShardClient(Protocol):
    """Holds some shards of every corpus; raises ShardUnhealthy instead of serving a bad one."""

    async def topk(self, corpus: str, uid: str, version: int, states: np.ndarray, selected: list[list[int]], n_total: int, k: int) -> ShardHits: ...
    async def stats(self, corpus: str | None) -> dict[str, Any]: ...
    async def forget(self, corpus: str) -> None: ...


class Metrics(Protocol):
    def stage(self, stage: str, seconds: float) -> None: ...
    def chunks_indexed(self, n: int) -> None: ...


@dataclass
class ModelIdentity:
    fingerprint: str
    model_cfg: ModelConfig
    dim: int
    source: str
    trained: bool
    max_positions: int | None = None  # token positions the encoders embed (bounds chunk_tokens)

    def describe(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "source": public_source(self.source), "trained": self.trained,
                "positions": self.model_cfg.positions, "dim": self.dim, "encoder": public_source(self.model_cfg.encoder)}


def public_source(spec: str) -> str:
    """A model source without the server's directories: URIs stay, a path keeps its last parts."""
    if "://" in spec or spec.startswith(("runs:/", "models:/")) or "/" not in spec:
        return spec
    parts = [p for p in spec.split("/") if p]
    return ".../" + "/".join(parts[-2:]) if len(parts) > 2 else spec


@dataclass
class RetrieveParams:
    question: str
    corpus: str | None = None
    context: str | None = None
    max_steps: int = 2
    beam_width: int = 1
    stop_threshold: float | None = None
    alternatives: int = 3
    chunk_tokens: int | None = None  # inline context only
    return_chunks: bool = False  # inline context only: echo the chunking (the web page draws it)


class RetrievalService:
    def __init__(self, cfg: ServeConfig, store: CorpusStore, tok: Tokenization, model: ModelIdentity,
                 encoder: EncoderClient, shards: Sequence[ShardClient], metrics: Metrics | None = None):
        self.cfg, self.store, self.tok, self.model = cfg, store, tok, model
        self.encoder, self.shards, self.metrics = encoder, list(shards), metrics
        self.max_chunk_tokens = chunk_token_limit(model.max_positions, tok)
        self.board = JobBoard(store.root, stale_s=cfg.job_stale_s)
        self.jobs: OrderedDict[str, Job] = OrderedDict()  # this replica's jobs (fresher than their records)
        self._manifests: dict[str, tuple[tuple[int, int], Manifest]] = {}
        self._repairing: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task] = set()
        self._workers: asyncio.Semaphore | None = None  # made in the serving event loop
        self._workers_loop: asyncio.AbstractEventLoop | None = None
        self._heartbeat: asyncio.Task | None = None

    # -- corpora ----------------------------------------------------------------------------

    def _corpus_path(self, name: str):
        try:
            return self.store.path(name)
        except StoreError as exc:
            raise ServiceError(422, "corpus", str(exc)) from None

    def manifest(self, name: str) -> Manifest:
        """The corpus manifest, re-read only when its file changed (one stat per request)."""
        path = self._corpus_path(name) / "corpus.json"
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            self._manifests.pop(name, None)
            raise ServiceError(404, "corpus", f"unknown corpus {name!r}") from None
        key = (st.st_ino, st.st_mtime_ns)
        cached = self._manifests.get(name)
        if cached is None or cached[0] != key:
            try:
                cached = (key, self.store.read(name))
            except StoreError as exc:
                raise store_error(exc, name) from None
            self._manifests[name] = cached
        return cached[1]

    def list_corpora(self) -> list[dict[str, Any]]:
        out = []
        for name in self.store.names():
            try:
                out.append(self.manifest(name).summary())
            except (ServiceError, StoreError):
                continue  # deleted meanwhile, or unreadable (its stats call says why)
        return out

    async def corpus_stats(self, name: str) -> dict[str, Any]:
        m = self.manifest(name)
        held = await asyncio.gather(*(s.stats(name) for s in self.shards), return_exceptions=True)
        shards = [h if isinstance(h, dict) else {"error": type(h).__name__} for h in held]
        return {**m.summary(), "bytes": await asyncio.to_thread(self.store.disk_bytes, name),
                "memory_bytes": sum(s.get("bytes", 0) for s in shards), "shard_holders": shards,
                "compatible": m.fingerprint == self.model.fingerprint}

    def _chunk_budget(self, chunk_tokens: int | None, field: str = "chunk_tokens") -> int:
        budget = self.cfg.chunk_tokens if chunk_tokens is None else chunk_tokens
        hi = self.max_chunk_tokens
        if not 8 <= budget <= hi:
            raise ServiceError(422, field, f"{field} must be between 8 and {hi} (the model's token positions minus its special tokens), got {budget}")
        return budget

    async def create(self, name: str, documents: Any = None, chunk_tokens: int | None = None, wait: bool = True) -> dict[str, Any]:
        """Create a corpus; with documents it becomes visible only once they are indexed, so a
        failed create leaves nothing (and its retry is not a 409)."""
        try:
            self.store.path(name)
        except StoreError as exc:
            raise ServiceError(422, "name", str(exc)) from None
        budget = self._chunk_budget(chunk_tokens)
        docs = self._documents(documents) if documents is not None else []
        if (self.store.root / name / "corpus.json").exists():
            raise ServiceError(409, "name", f"corpus {name!r} already exists")
        if not docs:
            try:
                m = await asyncio.to_thread(self.store.create, name, fingerprint=self.model.fingerprint, model=self.model.model_cfg,
                                            dim=self.model.dim, chunk_tokens=budget, shards=self.cfg.shards, dtype=self.cfg.dtype)
            except CorpusConflict as exc:
                raise ServiceError(409, "name", str(exc)) from None
            return {"corpus": m.summary(), "job": None}
        return await self._submit(name, "create", len(docs), lambda job: self._create(job, name, budget, docs), wait)

    async def _create(self, job: Job, name: str, budget: int, docs: list[Document]) -> None:
        chunks, ids = await self._chunk(job, docs, budget)
        self._check_memory(None, name, len(ids), sum(c.tokens for c in chunks))
        vectors = await self._embed_chunks(ids, job)
        try:
            await asyncio.to_thread(self.store.create, name, fingerprint=self.model.fingerprint, model=self.model.model_cfg, dim=self.model.dim,
                                    chunk_tokens=budget, shards=self.cfg.shards, dtype=self.cfg.dtype,
                                    first=(docs, chunks, ids, vectors), job=job.id)
        except CorpusConflict as exc:
            raise ServiceError(409, "name", f"{exc} (created by another request meanwhile)") from None
        if self.metrics:
            self.metrics.chunks_indexed(len(ids))

    async def delete(self, name: str) -> dict[str, Any]:
        self._corpus_path(name)
        try:
            await asyncio.to_thread(self.store.delete, name)
        except CorpusNotFound:
            raise ServiceError(404, "corpus", f"unknown corpus {name!r}") from None
        self._manifests.pop(name, None)
        # Free the shards' memory now (replicas not reached drop it at their next sweep).
        await asyncio.gather(*(s.forget(name) for s in self.shards), return_exceptions=True)
        return {"deleted": name}

    def _documents(self, documents: Any) -> list[Document]:
        if isinstance(documents, list) and len(documents) > self.cfg.max_documents:
            raise ServiceError(413, "documents", f"{len(documents)} documents in one request; send at most {self.cfg.max_documents} per request")
        try:
            docs = parse_documents(documents)
        except DataError as exc:
            raise data_error(exc) from None
        word = re.compile(r"\S{%d,}" % (self.cfg.max_word_chars + 1))
        for i, d in enumerate(docs):
            bad = _CONTROL.search(d.id)
            if bad:
                raise ServiceError(422, f"documents[{i}].id", f"documents[{i}].id: control character or lone surrogate at character {bad.start()}")
            long = word.search(d.text)
            if long:
                raise ServiceError(422, f"documents[{i}].text", f"documents[{i}].text: {long.end() - long.start()} characters without a space "
                                   f"at character {long.start()}; at most {self.cfg.max_word_chars} (max_word_chars)")
        return docs

    async def append(self, name: str, documents: Any, wait: bool = True) -> dict[str, Any]:
        m = self._compatible(name)
        docs = documents if documents and isinstance(documents[0], Document) else self._documents(documents)
        if not docs:
            raise ServiceError(422, "documents", "no documents to add")
        self._check_memory(m, name, 0, 0)
        try:
            existing = set(await asyncio.to_thread(self.store.doc_ids, m))
        except StoreError as exc:
            raise store_error(exc, name) from None
        dup = next((d.id for d in docs if d.id in existing), None)
        if dup is not None:
            raise ServiceError(409, "documents", f"document id {dup!r} is already in corpus {name!r}")
        return await self._submit(name, "append", len(docs), lambda job: self._index(job, m, docs), wait)

    def _check_memory(self, m: Manifest | None, name: str, chunks: int, tokens: int) -> None:
        """507 when the corpus (with ``chunks`` more) would not fit the shards' memory budget."""
        budget = self.cfg.shard_memory_bytes
        if budget is None:
            return
        if m is None:
            m = Manifest(name=name, uid="", fingerprint="", model={}, dim=self.model.dim, chunk_tokens=0, shards=self.cfg.shards)
        need = corpus_bytes_per_holder(m, len(self.shards), chunks, tokens)
        if need > budget:
            raise ServiceError(507, "documents" if chunks else "corpus",
                               f"corpus {name!r} would need about {need / 2**20:.1f} MiB in each index shard; the budget is "
                               f"{budget / 2**20:.1f} MiB (shard_memory_bytes): use another corpus or more shards")

    async def _chunk(self, job: Job, docs: list[Document], budget: int) -> tuple[list, list[np.ndarray]]:
        chunks, ids = await asyncio.to_thread(self.tok.chunk_documents, docs, budget)
        job.chunks_total = len(ids)
        return chunks, ids

    async def _index(self, job: Job, m: Manifest, docs: list[Document]) -> None:
        chunks, ids = await self._chunk(job, docs, m.chunk_tokens)
        self._check_memory(self.manifest(m.name), m.name, len(ids), sum(c.tokens for c in chunks))
        vectors = await self._embed_chunks(ids, job)
        try:
            await asyncio.to_thread(self.store.append, m.name, docs, chunks, ids, vectors, self.model.fingerprint, job.id)
        except CorpusConflict as exc:
            raise ServiceError(409, "documents", str(exc)) from None
        except CorpusNotFound:
            raise ServiceError(404, "corpus", f"corpus {m.name!r} was deleted while indexing") from None
        if self.metrics:
            self.metrics.chunks_indexed(len(ids))

    async def _embed_chunks(self, ids: list[np.ndarray], job: Job | None = None) -> np.ndarray:
        parts = []
        step = max(1, self.cfg.chunk_batch)
        for lo in range(0, len(ids), step):
            parts.append(await self.encoder.embed_chunks(ids[lo : lo + step]))
            if job is not None:
                job.chunks_done = min(len(ids), lo + step)
        return np.concatenate(parts).astype(np.float32) if parts else np.zeros((0, self.model.dim), np.float32)

    async def reindex(self, name: str, wait: bool = False) -> dict[str, Any]:
        """Re-embed every chunk of a corpus with the served model (after a model change); one
        re-index per corpus at a time."""
        m = self.manifest(name)
        return await self._submit(name, "reindex", m.documents, lambda job: self._reindex(job, name), wait)

    async def _reindex(self, job: Job, name: str) -> None:
        m = await asyncio.to_thread(self.store.set_fingerprint, name, self.model.fingerprint, self.model.dim, self.model.model_cfg)
        self._check_memory(m, name, 0, 0)
        job.chunks_total = m.chunks
        for batch in m.batches:
            for shard in range(m.shards):
                await self._reembed_segment(m, shard, batch)
                job.chunks_done += batch["shards"][shard]["chunks"]

    async def _reembed_segment(self, m: Manifest, shard: int, batch: dict[str, Any]) -> None:
        rows = await asyncio.to_thread(self.store.read_texts, m, shard, batch)
        ids = await asyncio.to_thread(self.tok.tokenize_chunks, [t for _, _, t in rows], m.chunk_tokens)
        vectors = await self._embed_chunks(ids)
        await asyncio.to_thread(self.store.replace_vectors, m.name, shard, batch["id"], vectors, ids, self.model.fingerprint)

    # -- jobs -------------------------------------------------------------------------------

    async def _submit(self, corpus: str, kind: str, documents: int, work: Callable[[Job], Awaitable[None]], wait: bool) -> dict[str, Any]:
        """Admit a job (429 past the bounds), start it, and with ``wait`` answer when it ends or
        after ``job_wait_s`` (then 202: it goes on). A client that goes away does not stop it."""
        job = await asyncio.to_thread(self._admit, corpus, kind, documents)
        self.jobs[job.id] = job  # in the event loop: _beat iterates this dict there
        while len(self.jobs) > self.cfg.jobs_kept and not next(iter(self.jobs.values())).active:
            self.jobs.popitem(last=False)
        task = self._start(job, work(job))
        if wait:
            # Answer (202) before the request deadline does (503); waiting never cancels the job.
            await asyncio.wait({task}, timeout=min(self.cfg.job_wait_s, 0.8 * self.cfg.request_timeout_s))
            if job.state == "failed":
                raise ServiceError(job.error["status"], job.error["field"], job.error["message"])
        try:
            summary = self.manifest(corpus).summary() if job.state == "done" or kind != "create" else None
        except ServiceError:
            summary = None
        return {"corpus": summary, "job": job.as_dict()}

    def _admit(self, corpus: str, kind: str, documents: int) -> Job:
        c = self.cfg
        with self.board.admission():
            active = []
            for j in self.board.active():
                if self.jobs.get(j.id) is None and self.board.stale(j):
                    self._settle(j)
                else:
                    active.append(j)
            mine = [j for j in active if j.corpus == corpus]
            running = next((j for j in mine if j.kind == "reindex"), None)
            if kind == "reindex" and running is not None:
                raise ServiceError(409, "corpus", f"corpus {corpus!r} is being re-indexed already (job {running.id})")
            if len(mine) >= c.max_jobs_per_corpus:
                raise ServiceError(429, "corpus", f"{len(mine)} indexing jobs of corpus {corpus!r} are queued or running; at most "
                                   f"{c.max_jobs_per_corpus} (max_jobs_per_corpus): retry later", {"Retry-After": str(c.retry_after_s)})
            if len(active) >= c.max_jobs:
                raise ServiceError(429, None, f"{len(active)} indexing jobs are queued or running; at most {c.max_jobs} (max_jobs): retry later",
                                   {"Retry-After": str(c.retry_after_s)})
            job = Job(new_job_id(), corpus, kind, documents=documents)
            self.board.save(job)
        return job

    def _settle(self, job: Job) -> Job:
        """A stale record (its server stopped): done if its batch reached the corpus, else failed."""
        latest = self.board.get(job.id)
        if latest is not None and not latest.active:
            return latest  # it ended after all (the record read was a leftover)
        batch = None
        if job.kind in ("create", "append"):
            try:
                batch = self.store.job_batch(self.store.read(job.corpus), job.id)
            except StoreError:
                batch = None
        if batch is not None:
            job.state, job.chunks_done = "done", job.chunks_total
        else:
            nothing = "nothing of it was stored" if job.kind != "reindex" else f"POST /v1/corpora/{job.corpus}/reindex again"
            job.state = "failed"
            job.error = ServiceError(503, None, f"interrupted: the server running this job stopped (restart or crash) "
                                                f"before it finished; {nothing}").body()["error"]
        job.finished = time.time()
        self.board.save(job)
        return job

    def _start(self, job: Job, work: Awaitable[None]) -> asyncio.Task:
        loop = asyncio.get_running_loop()
        if self._workers is None or self._workers_loop is not loop:  # (tests run several loops)
            self._workers, self._workers_loop = asyncio.Semaphore(max(1, self.cfg.job_workers)), loop

        async def run() -> None:
            try:
                async with self._workers:
                    job.state, job.started = "running", time.time()
                    await asyncio.to_thread(self.board.save, job)
                    await work
                    job.state = "done"
            except ServiceError as exc:
                job.state, job.error = "failed", exc.body()["error"]
            except StoreError as exc:
                job.state, job.error = "failed", store_error(exc, job.corpus).body()["error"]
            except DataError as exc:
                job.state, job.error = "failed", data_error(exc).body()["error"]
            except OSError as exc:  # disk full, storage gone
                job.state, job.error = "failed", os_error(exc).body()["error"]
            except asyncio.CancelledError:
                job.state, job.error = "failed", ServiceError(503, None, "cancelled: the server is shutting down").body()["error"]
                raise
            except Exception as exc:  # a bug or an unexpected backend failure: still an ending, with a reason
                log.exception("indexing job %s failed", job.id)
                job.state, job.error = "failed", ServiceError(500, None, f"internal error: {type(exc).__name__}").body()["error"]
            finally:
                if job.state == "done":
                    job.chunks_done = job.chunks_total
                job.finished = time.time()
                try:
                    self.board.save(job)  # synchronous: it must happen even when cancelled
                except OSError:
                    log.exception("cannot record the end of job %s", job.id)
                self.board.prune(self.cfg.jobs_kept)

        task = asyncio.ensure_future(run())
        self._tasks.add(task)  # keep a reference: a running job must not be garbage-collected
        task.add_done_callback(self._tasks.discard)
        if self._heartbeat is None or self._heartbeat.done():
            self._heartbeat = asyncio.ensure_future(self._beat())
        return task

    async def _beat(self) -> None:
        """Rewrite this replica's active job records (progress, and proof that it is alive)."""
        while any(j.active for j in list(self.jobs.values())):
            await asyncio.sleep(self.cfg.job_heartbeat_s)
            for job in [j for j in list(self.jobs.values()) if j.active]:
                await asyncio.to_thread(self.board.save, job)

    def job(self, job_id: str) -> dict[str, Any]:
        job = self.jobs.get(job_id)
        if job is None:
            job = self.board.get(job_id)
            if job is not None and self.board.stale(job):
                job = self._settle(job)
        if job is None:
            raise ServiceError(404, "job", f"unknown job {job_id!r} (the last {self.cfg.jobs_kept} finished jobs are kept)")
        return job.as_dict()

    def corpus_jobs(self, name: str) -> dict[str, Any]:
        self._corpus_path(name)
        jobs = {j.id: j for j in self.board.recent(name, self.cfg.jobs_kept)}
        jobs.update({j.id: j for j in list(self.jobs.values()) if j.corpus == name})  # (a snapshot: this runs in a thread)
        out = [self._settle(j) if self.board.stale(j) and j.id not in self.jobs else j for j in jobs.values()]
        return {"corpus": name, "jobs": [j.as_dict() for j in sorted(out, key=lambda j: j.created, reverse=True)]}

    def _compatible(self, name: str) -> Manifest:
        m = self.manifest(name)
        if m.fingerprint != self.model.fingerprint:
            raise ServiceError(409, "corpus", f"corpus {name!r} was indexed with model {m.fingerprint}; this server runs {self.model.fingerprint} "
                                              f"({public_source(self.model.source)}). POST /v1/corpora/{name}/reindex re-embeds it from its stored texts")
        return m

    # -- retrieval --------------------------------------------------------------------------

    def check(self, p: RetrieveParams) -> SearchConfig:
        """Range checks of a request (types are checked by the HTTP layer)."""
        c = self.cfg
        if (p.corpus is None) == (p.context is None):
            raise ServiceError(422, "corpus", "give exactly one of 'corpus' (an indexed corpus) and 'context' (inline text)")
        if not p.question.strip():
            raise ServiceError(422, "question", "empty question")
        if len(p.question) > c.max_question_chars:
            raise ServiceError(422, "question", f"question of {len(p.question)} characters; at most {c.max_question_chars}")
        for name, value, hi in (("max_steps", p.max_steps, c.max_steps), ("beam_width", p.beam_width, c.max_beam_width)):
            if not 1 <= value <= hi:
                raise ServiceError(422, name, f"{name} must be between 1 and {hi}, got {value}")
        if not 0 <= p.alternatives <= c.max_alternatives:
            raise ServiceError(422, "alternatives", f"alternatives must be between 0 and {c.max_alternatives}, got {p.alternatives}")
        if p.stop_threshold is not None:
            try:
                p.stop_threshold = float(p.stop_threshold)  # a 401-digit integer does not fit a float
            except OverflowError:
                p.stop_threshold = float("inf")
            if not np.isfinite(p.stop_threshold):
                raise ServiceError(422, "stop_threshold", "stop_threshold must be a finite number or null")
        try:
            check_text(p.question, "question")
            if p.context is not None:
                check_text(p.context, "context")
        except DataError as exc:
            raise data_error(exc) from None
        if p.context is not None:
            if not p.context.strip():
                raise ServiceError(422, "context", "empty context")
            if len(p.context) > c.max_context_chars:
                raise ServiceError(413, "context", f"context of {len(p.context)} characters; at most {c.max_context_chars} (index it as a corpus instead)")
            self._chunk_budget(p.chunk_tokens)
            long = re.search(r"\S{%d,}" % (c.max_word_chars + 1), p.context)
            if long:
                raise ServiceError(422, "context", f"context: {long.end() - long.start()} characters without a space at character "
                                   f"{long.start()}; at most {c.max_word_chars} (max_word_chars)")
        elif p.chunk_tokens is not None or p.return_chunks:
            raise ServiceError(422, "chunk_tokens" if p.chunk_tokens is not None else "return_chunks", "only for an inline 'context' (a corpus keeps its own chunking)")
        return SearchConfig(max_steps=p.max_steps, beam_width=p.beam_width, stop_threshold=p.stop_threshold, alternatives=p.alternatives)

    async def retrieve(self, p: RetrieveParams) -> dict[str, Any]:
        search = self.check(p)
        if p.context is not None:
            return await self._retrieve_context(p, search)
        t0 = time.perf_counter()
        m = self._compatible(p.corpus)
        self._check_memory(m, m.name, 0, 0)
        if m.chunks == 0:
            raise ServiceError(409, "corpus", f"corpus {p.corpus!r} has no documents yet")
        question = self.tok.tokenize_question(p.question)
        timings = Timings(tokenize=time.perf_counter() - t0)
        for attempt in range(2 + len(m.batches) * m.shards):
            try:
                run = await self._search(question, search, m.chunks, ShardClients(self.shards, m), timings)
                break
            except ShardUnhealthy as exc:
                if attempt > len(m.batches) * m.shards or not all(pr.repairable for pr in exc.problems):
                    raise ServiceError(503, "corpus", f"corpus {m.name!r} is unhealthy: {exc}") from None
                try:
                    await self._repair(m.name, exc)
                except StoreError as err:  # deleted or damaged meanwhile
                    if not (self.store.root / m.name / "corpus.json").exists():
                        raise ServiceError(404, "corpus", f"corpus {m.name!r} was deleted") from None
                    raise store_error(err, m.name) from None
                m = self._compatible(p.corpus)
        timings.total = time.perf_counter() - t0
        return self._response(p, run, timings, m.chunks)

    async def _search(self, question: np.ndarray, search: SearchConfig, n_total: int, backend: AsyncScoringBackend,
                      timings: Timings) -> SearchRun:
        run = SearchRun(question, self.tok.layout, search, n_total)
        await search_async([run], self.encoder.embed_states, backend, timings)
        return run

    async def _repair(self, name: str, exc: ShardUnhealthy) -> None:
        """Re-embed segments whose vectors are missing or corrupt from their stored texts."""
        lock = self._repairing.setdefault(name, asyncio.Lock())
        async with lock:
            m = await asyncio.to_thread(self.store.read, name)
            for problem in exc.problems:
                batch = next((b for b in m.batches if b["id"] == problem.batch), None)
                if batch is None:
                    continue  # the corpus was re-created meanwhile: the retry reads the new one
                entry = batch["shards"][problem.shard]
                segment, still = await asyncio.to_thread(self.store.read_segment, m, problem.shard, batch)
                if still is None and entry.get("fingerprint") == m.fingerprint:
                    continue  # another request repaired it meanwhile
                await self._reembed_segment(m, problem.shard, batch)
                m = await asyncio.to_thread(self.store.read, name)

    async def _retrieve_context(self, p: RetrieveParams, search: SearchConfig) -> dict[str, Any]:
        """One long document per question (the BabiLong setting): chunk, embed, search in memory."""
        t0 = time.perf_counter()
        budget = p.chunk_tokens or self.cfg.chunk_tokens
        doc = Document("context", p.context)
        chunks, ids = await asyncio.to_thread(self.tok.chunk_documents, [doc], budget)
        question = self.tok.tokenize_question(p.question)
        timings = Timings(tokenize=time.perf_counter() - t0)
        t = time.perf_counter()
        vectors = await self._embed_chunks(ids)
        timings.encode += time.perf_counter() - t
        shard = ShardIndex("context", 0, 1, self.model.model_cfg, self.model.dim, torch.device("cpu"), ShardOptions(faiss="never"))
        shard.add(Segment(0, np.arange(len(chunks)), vectors, ids, [c.doc_id for c in chunks], [c.text for c in chunks]))

        run = await self._search(question, search, len(chunks), InThread(HeldShards([shard], len(chunks))), timings)
        timings.total = time.perf_counter() - t0
        out = self._response(p, run, timings, len(chunks))
        if p.return_chunks:
            out["chunks"] = [c.text for c in chunks]
        return out

    def _response(self, p: RetrieveParams, run: SearchRun, timings: Timings, n_chunks: int) -> dict[str, Any]:
        if self.metrics:
            for stage, seconds in asdict(timings).items():
                self.metrics.stage(stage, seconds)
        result = run.result()

        def chunk(g: int) -> dict[str, Any]:
            rec: ChunkRecord = run.records[g]
            return {"chunk_id": int(g), "doc_id": rec.doc_id, "text": rec.text}

        steps = [{
            "step": i + 1, **chunk(s.chunk), "q": s.q, "position": s.position,
            "alternatives": [{**chunk(a), "q": q} for a, q in s.alternatives],
        } for i, s in enumerate(result.steps)]
        return {
            "corpus": p.corpus, "question": p.question, "steps": steps, "stopped_early": result.stopped_early,
            "n_chunks": n_chunks, "timings": timings.as_ms(),
            "search": {"max_steps": p.max_steps, "beam_width": p.beam_width, "stop_threshold": p.stop_threshold, "alternatives": p.alternatives},
            "model": {"fingerprint": self.model.fingerprint, "trained": self.model.trained},
        }

    async def health(self) -> dict[str, Any]:
        trained = self.model.trained
        return {
            "status": "ok", "model": self.model.describe(),
            "message": "serving a trained checkpoint" if trained else
                       "serving the UNTRAINED bundled encoder: no checkpoint is configured (set checkpoint in serve/config.yaml or --checkpoint)",
            "shards": len(self.shards), "corpora": len(self.store.names()),
        }


# ---------------------------------------------------------------------------------------------
# In-process backends (tests, the library, `qrag serve --no-ray` style use)


class LocalEncoder:
    """The encoder in this process; its failures (CUDA out of memory, ...) answer 503, as the
    Serve encoder's do. Concurrent requests' states are embedded together (as the Serve encoder's
    ``@serve.batch``, without its wait): while one forward runs, arriving states queue, and the
    next forward takes them, whole requests, up to ``batch_size`` states (1 = one request each)."""

    def __init__(self, model: EmbeddingModel, retry_after_s: int = 1, batch_size: int = 1):
        self.model, self.retry_after_s, self.batch_size = model, retry_after_s, batch_size
        self._lock = asyncio.Lock()  # one forward at a time
        self._queue: list[tuple[list[np.ndarray], asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None  # kept: the event loop holds tasks weakly
        self.forwards = 0  # state forwards run (a test counts the batching)

    def _failed(self, exc: BaseException) -> ServiceError:
        log.warning("the encoder failed: %s", exc)
        return ServiceError(503, None, f"the encoder failed ({type(exc).__name__}); retry", {"Retry-After": str(self.retry_after_s)})

    async def _call(self, fn, seqs: list[np.ndarray]) -> np.ndarray:
        async with self._lock:
            try:
                return await asyncio.to_thread(fn, seqs)
            except (RuntimeError, MemoryError) as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
                raise self._failed(exc) from None

    async def embed_states(self, seqs: list[np.ndarray]) -> np.ndarray:
        future = asyncio.get_running_loop().create_future()
        self._queue.append((seqs, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.get_running_loop().create_task(self._drain())
        return await future

    def _next_batch(self) -> list[tuple[list[np.ndarray], asyncio.Future]]:
        """Queued requests, oldest first, up to ``batch_size`` states (one request at least);
        cancelled ones (their deadline passed) are dropped."""
        batch, size = [], 0
        while self._queue and (not batch or size + len(self._queue[0][0]) <= self.batch_size):
            seqs, future = self._queue.pop(0)
            if not future.done():
                batch.append((seqs, future))
                size += len(seqs)
        return batch

    async def _drain(self) -> None:
        batch: list[tuple[list[np.ndarray], asyncio.Future]] = []
        try:
            while batch := self._next_batch():
                try:
                    self.forwards += 1
                    vectors = await self._call(self.model.embed_states, [x for seqs, _ in batch for x in seqs])
                except ServiceError as error:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(error)
                    continue
                lo = 0
                for seqs, future in batch:
                    if not future.done():
                        future.set_result(vectors[lo : lo + len(seqs)])
                    lo += len(seqs)
        except BaseException as exc:  # never leave a request waiting for a batch that will not run
            for _, future in batch + self._queue:
                if not future.done():
                    future.set_exception(self._failed(exc))
            self._queue.clear()
            raise

    async def embed_chunks(self, seqs: list[np.ndarray]) -> np.ndarray:
        return await self._call(self.model.embed_chunks, seqs)


class ShardClients:
    """Scoring backend over the shard holders of a corpus version (Serve handles or
    :class:`LocalShards`), asked all at once."""

    def __init__(self, clients: Sequence[ShardClient], m: Manifest):
        self.clients, self.m = list(clients), m

    async def topk(self, states: np.ndarray, rows: list[int], selected: list[list[int]], k: int) -> list[ShardHits]:
        m = self.m
        return list(await asyncio.gather(*(c.topk(m.name, m.uid, m.version, states, selected, m.chunks, k) for c in self.clients)))


class InThread:
    """A backend of this process scored in a worker thread, so the event loop keeps serving."""

    def __init__(self, backend: ScoringBackend):
        self.backend = backend

    async def topk(self, states: np.ndarray, rows: list[int], selected: list[list[int]], k: int) -> list[ShardHits]:
        return list(await asyncio.to_thread(self.backend.topk, states, rows, selected, k))


class LocalShards:
    """A :class:`ShardHolder` behind the async client interface."""

    def __init__(self, holder: ShardHolder):
        self.holder = holder

    async def topk(self, *args) -> ShardHits:
        return await asyncio.to_thread(self.holder.topk, *args)

    async def stats(self, corpus: str | None = None) -> dict[str, Any]:
        return self.holder.stats(corpus)

    async def forget(self, corpus: str) -> None:
        self.holder.forget(corpus)


def local_service(cfg: ServeConfig, model: EmbeddingModel, device: str = "cpu", metrics: Metrics | None = None) -> RetrievalService:
    """The whole service in one process (no Ray): one shard holder per index-shard deployment
    (``cfg.shard_deployments``; 1 = every shard in one holder, scored in one pass per step)."""
    store = CorpusStore(cfg.storage)
    identity = ModelIdentity(model.fingerprint, model.model_cfg, model.dim, model.source.describe(), model.source.trained,
                             encoder_positions(model.qnet.action_encoder))
    options = cfg.shard_options()
    n = cfg.shard_holders()
    clients = [LocalShards(ShardHolder(store, s, n, torch.device(device), options, cfg.shard_memory_bytes)) for s in range(n)]
    return RetrievalService(replace(cfg), store, model, identity, LocalEncoder(model, cfg.retry_after_s, cfg.state_batch_size),
                            clients, metrics)
