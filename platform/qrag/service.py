"""The retrieval service without its transport: corpora (create, append, list, stats, delete,
re-index), retrieval over a corpus or an inline context, indexing jobs with progress.

It talks to an encoder and to shard holders through two small async interfaces, so the same
code runs behind Ray Serve (``qrag.distributed.serving`` passes deployment handles) and in one
process (:class:`LocalEncoder`, :class:`LocalShards`: tests and the library).
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch

from .config import ModelConfig, SearchConfig
from .data.documents import Document, check_text, chunk_documents, parse_documents
from .data.sample import DataError
from .embedder import EmbeddingModel, Tokenization
from .index.multistep import SearchRun, Timings
from .index.shards import CorpusShards, ShardHits, ShardIndex, ShardOptions, ShardUnhealthy
from .index.store import ChunkRecord, CorpusConflict, CorpusNotFound, CorpusStore, Manifest, Segment, StoreError
from .service_config import ServeConfig


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


class EncoderClient(Protocol):
    async def embed_states(self, seqs: list[np.ndarray]) -> np.ndarray: ...
    async def embed_chunks(self, seqs: list[np.ndarray]) -> np.ndarray: ...


class ShardClient(Protocol):
    """Holds some shards of every corpus; raises ShardUnhealthy instead of serving a bad one."""

    async def topk(self, corpus: str, uid: str, version: int, states: np.ndarray, selected: list[list[int]], n_total: int, k: int) -> ShardHits: ...
    async def stats(self, corpus: str | None) -> dict[str, Any]: ...


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

    def describe(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "source": self.source, "trained": self.trained,
                "positions": self.model_cfg.positions, "dim": self.dim, "encoder": self.model_cfg.encoder}


@dataclass
class Job:
    """Progress of one indexing request (append or re-index)."""

    id: str
    corpus: str
    kind: str
    state: str = "queued"  # queued | running | done | failed
    documents: int = 0
    chunks_total: int = 0
    chunks_done: int = 0
    error: dict[str, Any] | None = None
    created: float = field(default_factory=time.time)
    finished: float | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["progress"] = round(self.chunks_done / self.chunks_total, 4) if self.chunks_total else (1.0 if self.state == "done" else 0.0)
        return d


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
        self.jobs: OrderedDict[str, Job] = OrderedDict()
        self._manifests: dict[str, tuple[tuple[int, int], Manifest]] = {}
        self._repairing: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task] = set()

    # -- corpora ----------------------------------------------------------------------------

    def manifest(self, name: str) -> Manifest:
        """The corpus manifest, re-read only when its file changed (one stat per request)."""
        try:
            path = self.store.path(name) / "corpus.json"
        except StoreError as exc:
            raise ServiceError(422, "corpus", str(exc)) from None
        try:
            st = path.stat()
        except FileNotFoundError:
            self._manifests.pop(name, None)
            raise ServiceError(404, "corpus", f"unknown corpus {name!r}") from None
        key = (st.st_ino, st.st_mtime_ns)
        cached = self._manifests.get(name)
        if cached is None or cached[0] != key:
            try:
                cached = (key, self.store.read(name))
            except CorpusNotFound:
                raise ServiceError(404, "corpus", f"unknown corpus {name!r}") from None
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
        shards = [h if isinstance(h, dict) else {"error": str(h)} for h in held]
        return {**m.summary(), "bytes": await asyncio.to_thread(self.store.disk_bytes, name),
                "memory_bytes": sum(s.get("bytes", 0) for s in shards), "shard_holders": shards,
                "compatible": m.fingerprint == self.model.fingerprint}

    async def create(self, name: str, documents: Any = None, chunk_tokens: int | None = None, wait: bool = True) -> dict[str, Any]:
        budget = self.cfg.chunk_tokens if chunk_tokens is None else chunk_tokens
        if not 8 <= budget <= 512:
            raise ServiceError(422, "chunk_tokens", f"chunk_tokens must be between 8 and 512, got {budget}")
        docs = self._documents(documents) if documents is not None else []
        try:
            await asyncio.to_thread(self.store.create, name, fingerprint=self.model.fingerprint, model=self.model.model_cfg,
                                    dim=self.model.dim, chunk_tokens=budget, shards=self.cfg.shards, dtype=self.cfg.dtype)
        except CorpusConflict as exc:
            raise ServiceError(409, "name", str(exc)) from None
        except StoreError as exc:
            raise ServiceError(422, "name", str(exc)) from None
        if not docs:
            return {"corpus": self.manifest(name).summary(), "job": None}
        return await self.append(name, docs, wait=wait)

    async def delete(self, name: str) -> dict[str, Any]:
        self.manifest(name)
        try:
            await asyncio.to_thread(self.store.delete, name)
        except CorpusNotFound:
            raise ServiceError(404, "corpus", f"unknown corpus {name!r}") from None
        self._manifests.pop(name, None)
        return {"deleted": name}

    def _documents(self, documents: Any) -> list[Document]:
        if isinstance(documents, list) and len(documents) > self.cfg.max_documents:
            raise ServiceError(413, "documents", f"{len(documents)} documents in one request; send at most {self.cfg.max_documents} per request")
        try:
            docs = parse_documents(documents)
        except DataError as exc:
            raise data_error(exc) from None
        return docs

    async def append(self, name: str, documents: Any, wait: bool = True) -> dict[str, Any]:
        m = self._compatible(name)
        docs = documents if documents and isinstance(documents[0], Document) else self._documents(documents)
        if not docs:
            raise ServiceError(422, "documents", "no documents to add")
        existing = set(await asyncio.to_thread(self.store.doc_ids, m))
        dup = next((d.id for d in docs if d.id in existing), None)
        if dup is not None:
            raise ServiceError(409, "documents", f"document id {dup!r} is already in corpus {name!r}")
        job = self._new_job(name, "append", len(docs))
        task = self._run_job(job, self._index(job, m, docs))
        if not wait:
            return {"corpus": m.summary(), "job": job.as_dict()}
        await task
        if job.state == "failed":
            raise ServiceError(job.error["status"], job.error["field"], job.error["message"])
        return {"corpus": self.manifest(name).summary(), "job": job.as_dict()}

    async def _index(self, job: Job, m: Manifest, docs: list[Document]) -> None:
        chunks = await asyncio.to_thread(chunk_documents, docs, self.tok.count_tokens, m.chunk_tokens)
        ids = await asyncio.to_thread(self.tok.tokenize_chunks, [c.text for c in chunks], m.chunk_tokens)
        job.chunks_total = len(ids)
        vectors = await self._embed_chunks(ids, job)
        try:
            await asyncio.to_thread(self.store.append, m.name, docs, chunks, ids, vectors, self.model.fingerprint)
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
        """Re-embed every chunk of a corpus with the served model (after a model change)."""
        m = self.manifest(name)
        job = self._new_job(name, "reindex", m.documents)
        task = self._run_job(job, self._reindex(job, name))
        if wait:
            await task
        return {"corpus": self.manifest(name).summary(), "job": job.as_dict()}

    async def _reindex(self, job: Job, name: str) -> None:
        m = await asyncio.to_thread(self.store.set_fingerprint, name, self.model.fingerprint, self.model.dim, self.model.model_cfg)
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

    def _new_job(self, corpus: str, kind: str, documents: int) -> Job:
        job = Job(secrets.token_hex(6), corpus, kind, documents=documents)
        self.jobs[job.id] = job
        while len(self.jobs) > self.cfg.jobs_kept:
            self.jobs.popitem(last=False)
        return job

    def _run_job(self, job: Job, work) -> asyncio.Task:
        async def run() -> None:
            job.state = "running"
            try:
                await work
                job.state = "done"
            except ServiceError as exc:
                job.state, job.error = "failed", exc.body()["error"]
            except (StoreError, DataError) as exc:
                job.state, job.error = "failed", ServiceError(500, None, str(exc)).body()["error"]
            finally:
                job.finished = time.time()

        task = asyncio.ensure_future(run())
        self._tasks.add(task)  # keep a reference: a running job must not be garbage-collected
        task.add_done_callback(self._tasks.discard)
        return task

    def job(self, job_id: str) -> dict[str, Any]:
        job = self.jobs.get(job_id)
        if job is None:
            raise ServiceError(404, "job", f"unknown job {job_id!r} (jobs are kept per ingress replica; the last {self.cfg.jobs_kept})")
        return job.as_dict()

    def _compatible(self, name: str) -> Manifest:
        m = self.manifest(name)
        if m.fingerprint != self.model.fingerprint:
            raise ServiceError(409, "corpus", f"corpus {name!r} was indexed with model {m.fingerprint}; this server runs {self.model.fingerprint} "
                                              f"({self.model.source}). POST /v1/corpora/{name}/reindex re-embeds it from its stored texts")
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
        if p.stop_threshold is not None and not np.isfinite(p.stop_threshold):
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
            if p.chunk_tokens is not None and not 8 <= p.chunk_tokens <= 512:
                raise ServiceError(422, "chunk_tokens", f"chunk_tokens must be between 8 and 512, got {p.chunk_tokens}")
        elif p.chunk_tokens is not None or p.return_chunks:
            raise ServiceError(422, "chunk_tokens" if p.chunk_tokens is not None else "return_chunks", "only for an inline 'context' (a corpus keeps its own chunking)")
        return SearchConfig(max_steps=p.max_steps, beam_width=p.beam_width, stop_threshold=p.stop_threshold, alternatives=p.alternatives)

    async def retrieve(self, p: RetrieveParams) -> dict[str, Any]:
        search = self.check(p)
        if p.context is not None:
            return await self._retrieve_context(p, search)
        t0 = time.perf_counter()
        m = self._compatible(p.corpus)
        if m.chunks == 0:
            raise ServiceError(409, "corpus", f"corpus {p.corpus!r} has no documents yet")
        question = self.tok.tokenize_question(p.question)
        timings = Timings(tokenize=time.perf_counter() - t0)
        for attempt in range(2 + len(m.batches) * m.shards):
            try:
                run = await self._search(question, search, m, timings)
                break
            except ShardUnhealthy as exc:
                if attempt > len(m.batches) * m.shards or not all(pr.repairable for pr in exc.problems):
                    raise ServiceError(503, "corpus", f"corpus {m.name!r} is unhealthy: {exc}") from None
                await self._repair(m.name, exc)
                m = self._compatible(p.corpus)
        timings.total = time.perf_counter() - t0
        return self._response(p, run, timings, m.chunks)

    async def _search(self, question: np.ndarray, search: SearchConfig, m: Manifest, timings: Timings) -> SearchRun:
        run = SearchRun(question, self.tok.layout, search, m.chunks)
        while live := run.live():
            t = time.perf_counter()
            states = await self.encoder.embed_states(run.states(live))
            t1 = time.perf_counter()
            selected = run.selected(live)
            hits = await asyncio.gather(*(s.topk(m.name, m.uid, m.version, states, selected, m.chunks, run.k) for s in self.shards))
            t2 = time.perf_counter()
            run.advance(live, hits)
            timings.encode += t1 - t
            timings.score += t2 - t1
            timings.merge += time.perf_counter() - t2
        return run

    async def _repair(self, name: str, exc: ShardUnhealthy) -> None:
        """Re-embed segments whose vectors are missing or corrupt from their stored texts."""
        lock = self._repairing.setdefault(name, asyncio.Lock())
        async with lock:
            m = await asyncio.to_thread(self.store.read, name)
            for problem in exc.problems:
                batch = next(b for b in m.batches if b["id"] == problem.batch)
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
        chunks = await asyncio.to_thread(chunk_documents, [doc], self.tok.count_tokens, budget)
        ids = await asyncio.to_thread(self.tok.tokenize_chunks, [c.text for c in chunks], budget)
        question = self.tok.tokenize_question(p.question)
        timings = Timings(tokenize=time.perf_counter() - t0)
        t = time.perf_counter()
        vectors = await self._embed_chunks(ids)
        timings.encode += time.perf_counter() - t
        shard = ShardIndex("context", 0, 1, self.model.model_cfg, self.model.dim, torch.device("cpu"), ShardOptions(faiss="never"))
        shard.add(Segment(0, np.arange(len(chunks)), vectors, ids, [c.doc_id for c in chunks], [c.text for c in chunks]))

        run = await self._search_local(question, search, len(chunks), shard, timings)
        timings.total = time.perf_counter() - t0
        out = self._response(p, run, timings, len(chunks))
        if p.return_chunks:
            out["chunks"] = [c.text for c in chunks]
        return out

    async def _search_local(self, question, search: SearchConfig, n: int, shard: ShardIndex, timings: Timings) -> SearchRun:
        run = SearchRun(question, self.tok.layout, search, n)
        while live := run.live():
            t = time.perf_counter()
            states = await self.encoder.embed_states(run.states(live))
            t1 = time.perf_counter()
            hits = await asyncio.to_thread(shard.topk, states, run.selected(live), n, run.k)
            t2 = time.perf_counter()
            run.advance(live, [hits])
            timings.encode += t1 - t
            timings.score += t2 - t1
            timings.merge += time.perf_counter() - t2
        return run

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
    def __init__(self, model: EmbeddingModel):
        self.model = model
        self._lock = asyncio.Lock()

    async def embed_states(self, seqs: list[np.ndarray]) -> np.ndarray:
        async with self._lock:
            return await asyncio.to_thread(self.model.embed_states, seqs)

    async def embed_chunks(self, seqs: list[np.ndarray]) -> np.ndarray:
        async with self._lock:
            return await asyncio.to_thread(self.model.embed_chunks, seqs)


class ShardHolder:
    """Shards ``slot, slot + holders, ...`` of every corpus, loaded from the store on demand and
    kept in step with it (what one shard deployment replica does)."""

    def __init__(self, store: CorpusStore, slot: int, holders: int, device: torch.device, options: ShardOptions | None = None):
        self.store, self.slot, self.holders, self.device = store, slot, holders, device
        self.options = options or ShardOptions()
        self.corpora: dict[str, CorpusShards] = {}

    def _open(self, corpus: str, uid: str, version: int) -> CorpusShards:
        cs = self.corpora.get(corpus)
        if cs is None or (cs.uid is not None and cs.uid != uid):
            m = self.store.read(corpus)
            cs = CorpusShards(self.store, corpus, range(self.slot, m.shards, self.holders), self.device, self.options)
            self.corpora[corpus] = cs
        cs.sync(version, uid)
        return cs

    def topk(self, corpus: str, uid: str, version: int, states: np.ndarray, selected: list[list[int]], n_total: int, k: int) -> ShardHits:
        try:
            cs = self._open(corpus, uid, version)
        except CorpusNotFound:
            self.corpora.pop(corpus, None)
            raise
        return cs.topk(states, selected, n_total, k)

    def stats(self, corpus: str | None = None) -> dict[str, Any]:
        held = {name: cs for name, cs in self.corpora.items() if corpus is None or name == corpus}
        return {
            "slot": self.slot, "device": str(self.device), "corpora": len(held),
            "rows": sum(s.n for cs in held.values() for s in cs.shards.values()),
            "bytes": sum(cs.nbytes() for cs in held.values()),
            "loaded_rows": sum(cs.loaded_rows for cs in held.values()),
            "problems": [str(p) for cs in held.values() for p in cs.problems],
        }


class LocalShards:
    """A :class:`ShardHolder` behind the async client interface."""

    def __init__(self, holder: ShardHolder):
        self.holder = holder

    async def topk(self, *args) -> ShardHits:
        return await asyncio.to_thread(self.holder.topk, *args)

    async def stats(self, corpus: str | None = None) -> dict[str, Any]:
        return self.holder.stats(corpus)


def local_service(cfg: ServeConfig, model: EmbeddingModel, device: str = "cpu") -> RetrievalService:
    """The whole service in one process (no Ray)."""
    store = CorpusStore(cfg.storage)
    identity = ModelIdentity(model.fingerprint, model.model_cfg, model.dim, model.source.describe(), model.source.trained)
    options = ShardOptions(faiss=cfg.faiss, approx_above=cfg.approx_above)
    holders = [LocalShards(ShardHolder(store, s, cfg.shards, torch.device(device), options)) for s in range(cfg.shards)]
    return RetrievalService(replace(cfg), store, model, identity, LocalEncoder(model), holders)
