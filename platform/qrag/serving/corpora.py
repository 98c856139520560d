"""Corpora of the service: create, append, list, stats, delete, re-index and repair.

Every limit of a request is checked before any work, and the chunk budget comes from the model
(its positions minus special tokens). Writes run as indexing jobs (:mod:`qrag.serving.job_runner`).
An append, re-index or repair names the corpus generation (``uid``) it read its settings and texts
from, and the store refuses it (409) if the corpus was deleted and created again meanwhile.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from qrag.data.documents import Document, normalize_id, parse_documents
from qrag.data.sample import DataError
from qrag.index.holder import corpus_bytes_per_holder
from qrag.index.jobs import Job
from qrag.index.shards import ShardUnhealthy
from qrag.index.store import (
    Batch,
    CorpusChanged,
    CorpusConflict,
    CorpusNotFound,
    CorpusStore,
    Manifest,
    ManifestCache,
    StoreError,
)
from qrag.retrieval.embedder import Tokenization
from qrag.serving.backends import EncoderClient, HolderClient
from qrag.serving.errors import ServiceError, data_error, store_error
from qrag.serving.identity import ModelIdentity, chunk_token_limit, public_source
from qrag.serving.job_runner import JobRunner
from qrag.serving.metrics import Metrics
from qrag.serving.service_config import ServeConfig


class CorpusAdmin:
    def __init__(
        self,
        cfg: ServeConfig,
        store: CorpusStore,
        tok: Tokenization,
        model: ModelIdentity,
        encoder: EncoderClient,
        holders: Sequence[HolderClient],
        metrics: Metrics | None = None,
    ):
        self.cfg, self.store, self.tok, self.model = cfg, store, tok, model
        self.encoder, self.holders, self.metrics = encoder, list(holders), metrics
        self.max_chunk_tokens = chunk_token_limit(model.max_positions, tok)
        self.jobs = JobRunner(cfg, store, self._summary_or_none)
        self._manifests = ManifestCache(store)
        self._repairing: dict[str, asyncio.Lock] = {}

    def path_of(self, name: str):
        try:
            return self.store.path(name)
        except StoreError as exc:
            raise ServiceError(422, "corpus", str(exc)) from None

    def manifest(self, name: str) -> Manifest:
        """The corpus manifest, re-read only when its file changed (one stat per request)."""
        self.path_of(name)  # an invalid name is the request's fault (422), not the store's
        try:
            return self._manifests.read(name)
        except StoreError as exc:
            raise store_error(exc, name) from None

    def _summary_or_none(self, name: str) -> dict[str, Any] | None:
        try:
            return self.manifest(name).summary()
        except ServiceError:
            return None

    def compatible(self, name: str, reindexing: bool = False) -> Manifest:
        """The manifest of a corpus indexed with the served model (409 otherwise); with
        ``reindexing``, also one being re-indexed to it (appends may go on meanwhile)."""
        m = self.manifest(name)
        target = m.reindex.fingerprint if m.reindex is not None else None
        if m.fingerprint == self.model.fingerprint or (reindexing and target == self.model.fingerprint):
            return m
        if target == self.model.fingerprint:
            raise ServiceError(
                409,
                "corpus",
                f"corpus {name!r} is being re-indexed to the served model {target}, or its re-index "
                f"was interrupted: it serves once that ends (GET /v1/corpora/{name}/jobs; POST "
                f"/v1/corpora/{name}/reindex goes on from the segments already re-embedded)",
            )
        raise ServiceError(
            409,
            "corpus",
            f"corpus {name!r} was indexed with model {m.fingerprint}; this server runs "
            f"{self.model.fingerprint} ({public_source(self.model.source)}). "
            f"POST /v1/corpora/{name}/reindex re-embeds it from its stored texts",
        )

    def searchable(self, name: str) -> Manifest:
        """The manifest of a corpus a query can search: of the served model (409), within the
        shards' memory budget (507), holding documents (409)."""
        m = self.compatible(name)
        self.check_memory(m, m.name, 0, 0)
        if m.chunks == 0:
            raise ServiceError(409, "corpus", f"corpus {name!r} has no documents yet")
        return m

    def list_corpora(self) -> list[dict[str, Any]]:
        out = []
        for name in self.store.names():
            try:
                out.append(self.manifest(name).summary())
            except (ServiceError, StoreError):
                continue  # deleted meanwhile, or unreadable (its stats call says why)
        return out

    async def stats(self, name: str) -> dict[str, Any]:
        m = self.manifest(name)
        held = await asyncio.gather(*(s.stats(name) for s in self.holders), return_exceptions=True)
        shards = [h if isinstance(h, dict) else {"error": type(h).__name__} for h in held]
        return {
            **m.summary(),
            "bytes": await asyncio.to_thread(self.store.disk_bytes, name),
            "memory_bytes": sum(s.get("bytes", 0) for s in shards),
            "shard_holders": shards,
            "compatible": m.fingerprint == self.model.fingerprint,
        }

    def chunk_budget(self, chunk_tokens: int | None, field: str = "chunk_tokens") -> int:
        budget = self.cfg.chunk_tokens if chunk_tokens is None else chunk_tokens
        hi = self.max_chunk_tokens
        if not 8 <= budget <= hi:
            raise ServiceError(
                422,
                field,
                f"{field} must be between 8 and {hi} (the model's token positions minus its special tokens), "
                f"got {budget}",
            )
        return budget

    # -- writes -----------------------------------------------------------------------------

    async def create(
        self, name: str, documents: Any = None, chunk_tokens: int | None = None, wait: bool = True
    ) -> dict[str, Any]:
        """Create a corpus; with documents it becomes visible only once they are indexed, so a
        failed create leaves nothing (and its retry is not a 409)."""
        try:
            self.store.path(name)
        except StoreError as exc:
            raise ServiceError(422, "name", str(exc)) from None
        budget = self.chunk_budget(chunk_tokens)
        # Checking a request's documents reads all their text: in a thread, off the event loop.
        docs = await asyncio.to_thread(self._documents, documents) if documents is not None else []
        if (self.store.root / name / "corpus.json").exists():
            raise ServiceError(409, "name", f"corpus {name!r} already exists")
        if not docs:
            try:
                m = await self._store_create(name, budget)
            except CorpusConflict as exc:
                raise ServiceError(409, "name", str(exc)) from None
            return {"corpus": m.summary(), "job": None}
        return await self.jobs.submit(
            name, "create", len(docs), lambda job: self._create(job, name, budget, docs), wait
        )

    async def _create(self, job: Job, name: str, budget: int, docs: list[Document]) -> None:
        chunks, ids = await self._chunk(job, docs, budget)
        self.check_memory(None, name, len(ids), sum(c.tokens for c in chunks))
        vectors = await self._embed_chunks(ids, job)
        try:
            await self._store_create(name, budget, first=(docs, chunks, ids, vectors), job=job.id)
        except CorpusConflict as exc:
            raise ServiceError(409, "name", f"{exc} (created by another request meanwhile)") from None
        if self.metrics:
            self.metrics.chunks_indexed(len(ids))

    async def _store_create(self, name: str, budget: int, **with_documents: Any):
        """A new corpus of the served model and this service's shard layout, off the event loop
        (``with_documents``: ``first`` batch and its ``job``, when documents come with the create)."""
        return await asyncio.to_thread(
            self.store.create,
            name,
            fingerprint=self.model.fingerprint,
            model=self.model.model_cfg,
            dim=self.model.dim,
            chunk_tokens=budget,
            shards=self.cfg.shards,
            dtype=self.cfg.dtype,
            **with_documents,
        )

    async def delete(self, name: str) -> dict[str, Any]:
        self.path_of(name)
        try:
            await asyncio.to_thread(self.store.delete, name)
        except CorpusNotFound:
            raise ServiceError(404, "corpus", f"unknown corpus {name!r}") from None
        self._manifests.forget(name)
        # Free the shards' memory now (replicas not reached drop it at their next sweep).
        await asyncio.gather(*(s.forget(name) for s in self.holders), return_exceptions=True)
        return {"deleted": name}

    def _documents(self, documents: Any) -> list[Document]:
        if isinstance(documents, list) and len(documents) > self.cfg.max_documents:
            raise ServiceError(
                413,
                "documents",
                f"{len(documents)} documents in one request; send at most {self.cfg.max_documents} per request",
            )
        try:
            docs = parse_documents(documents)
        except DataError as exc:
            raise data_error(exc) from None
        word = re.compile(r"\S{%d,}" % (self.cfg.max_word_chars + 1))
        for i, d in enumerate(docs):
            long = word.search(d.text)
            if long:
                raise ServiceError(
                    422,
                    f"documents[{i}].text",
                    f"documents[{i}].text: {long.end() - long.start()} characters without "
                    f"a space at character {long.start()}; at most {self.cfg.max_word_chars} (max_word_chars)",
                )
        return docs

    async def append(self, name: str, documents: Any, wait: bool = True) -> dict[str, Any]:
        m = self.compatible(name, reindexing=True)
        docs = (
            documents
            if documents and isinstance(documents[0], Document)
            else await asyncio.to_thread(self._documents, documents)
        )
        if not docs:
            raise ServiceError(422, "documents", "no documents to add")
        self.check_memory(m, name, 0, 0)
        try:
            existing = {normalize_id(i) for i in await asyncio.to_thread(self.store.doc_ids, m)}
        except StoreError as exc:
            raise store_error(exc, name) from None
        dup = next((d.id for d in docs if normalize_id(d.id) in existing), None)
        if dup is not None:
            raise ServiceError(409, "documents", f"document id {dup!r} is already in corpus {name!r}")
        return await self.jobs.submit(name, "append", len(docs), lambda job: self._index(job, m, docs), wait)

    def shard_budget(self) -> int | None:
        """Memory each shard holder may use: the configured budget, else the smallest that the
        holders of this process sized from the machine (holders behind handles check their own)."""
        if self.cfg.shard_memory_bytes is not None:
            return self.cfg.shard_memory_bytes
        budgets = [
            b
            for b in (getattr(getattr(c, "holder", None), "memory_bytes", None) for c in self.holders)
            if b is not None
        ]
        return min(budgets) if budgets else None

    def check_memory(self, m: Manifest | None, name: str, chunks: int, tokens: int) -> None:
        """507 when the corpus (with ``chunks`` more) would not fit the shards' memory budget."""
        budget = self.shard_budget()
        if budget is None:
            return
        if m is None:
            m = Manifest(
                name=name, uid="", fingerprint="", model={}, dim=self.model.dim, chunk_tokens=0, shards=self.cfg.shards
            )
        need = corpus_bytes_per_holder(m, len(self.holders), chunks, tokens)
        if need > budget:
            raise ServiceError(
                507,
                "documents" if chunks else "corpus",
                f"corpus {name!r} would need about {need / 2**20:.1f} MiB in each index shard; the budget is "
                f"{budget / 2**20:.1f} MiB (shard_memory_bytes): use another corpus or more shards",
            )

    async def _chunk(self, job: Job, docs: list[Document], budget: int) -> tuple[list, list[np.ndarray]]:
        chunks, ids = await asyncio.to_thread(self.tok.chunk_documents, docs, budget)
        job.chunks_total = len(ids)
        return chunks, ids

    async def _index(self, job: Job, m: Manifest, docs: list[Document]) -> None:
        chunks, ids = await self._chunk(job, docs, m.chunk_tokens)
        self.check_memory(self.manifest(m.name), m.name, len(ids), sum(c.tokens for c in chunks))
        vectors = await self._embed_chunks(ids, job)
        try:
            await asyncio.to_thread(
                self.store.append, m.name, docs, chunks, ids, vectors, self.model.fingerprint, job.id, m.uid
            )
        except CorpusChanged as exc:
            raise ServiceError(409, "corpus", str(exc)) from None
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

    async def embed_chunks(self, ids: list[np.ndarray]) -> np.ndarray:
        """Vectors of chunk token ids (an inline context's), in encoder calls of ``chunk_batch``."""
        return await self._embed_chunks(ids)

    async def reindex(self, name: str, wait: bool = False) -> dict[str, Any]:
        """Re-embed every chunk of a corpus with the served model (after a model change); one
        re-index per corpus at a time. The corpus serves its old vectors until all new ones are
        written, then switches in one commit; an interrupted re-index goes on where it stopped."""
        m = self.manifest(name)
        return await self.jobs.submit(name, "reindex", m.documents, lambda job: self._reindex(job, name, m.uid), wait)

    async def _reindex(self, job: Job, name: str, uid: str) -> None:
        fingerprint = self.model.fingerprint
        m = await asyncio.to_thread(
            self.store.begin_reindex, name, uid, fingerprint, self.model.dim, self.model.model_cfg
        )
        self.check_memory(m, name, 0, 0)
        todo = self.store.reindex_todo(m)
        while True:  # appends of another model meanwhile leave segments to re-embed at the swap
            job.chunks_total = m.chunks
            job.chunks_done = m.chunks - sum(batch.shards[shard].chunks for batch, shard in todo)
            for batch, shard in todo:
                await self._reembed_segment(m, shard, batch, stage=True)
                job.chunks_done += batch.shards[shard].chunks
            m, todo = await asyncio.to_thread(self.store.finish_reindex, name, uid, fingerprint)
            if not todo:
                return

    async def _reembed_segment(self, m: Manifest, shard: int, batch: Batch, stage: bool = False) -> None:
        """New vectors of one segment from its stored texts: staged for the re-index under way, or
        in place of missing or corrupt ones (repair); of ``m``'s generation only."""
        rows = await asyncio.to_thread(self.store.read_texts, m, shard, batch)
        ids = await asyncio.to_thread(self.tok.tokenize_chunks, [t for _, _, t in rows], m.chunk_tokens)
        vectors = await self._embed_chunks(ids)
        if stage:
            await asyncio.to_thread(
                self.store.stage_vectors, m.name, m.uid, self.model.fingerprint, shard, batch.id, vectors, ids
            )
        else:
            await asyncio.to_thread(
                self.store.replace_vectors, m.name, shard, batch.id, vectors, ids, self.model.fingerprint, m.uid
            )

    async def repaired(self, name: str, exc: ShardUnhealthy) -> Manifest:
        """Repair what a query found unhealthy, and the corpus to search again: 503 when the
        damage cannot be repaired (texts lost), 404 when the corpus was deleted meanwhile."""
        if not all(pr.repairable for pr in exc.problems):
            raise ServiceError(503, "corpus", f"corpus {name!r} is unhealthy: {exc}")
        try:
            await self.repair(name, exc)
        except StoreError as err:  # deleted or damaged meanwhile
            if not (self.store.root / name / "corpus.json").exists():
                raise ServiceError(404, "corpus", f"corpus {name!r} was deleted") from None
            raise store_error(err, name) from None
        return self.compatible(name)

    async def repair(self, name: str, exc: ShardUnhealthy) -> None:
        """Re-embed segments whose vectors are missing or corrupt from their stored texts."""
        lock = self._repairing.setdefault(name, asyncio.Lock())
        async with lock:
            m = await asyncio.to_thread(self.store.read, name)
            for problem in exc.problems:
                batch = m.batch(problem.batch)
                if batch is None:
                    continue  # the corpus was re-created meanwhile: the retry reads the new one
                entry = batch.shards[problem.shard]
                segment, still = await asyncio.to_thread(self.store.read_segment, m, problem.shard, batch)
                if still is None and entry.fingerprint == m.fingerprint:
                    continue  # another request repaired it meanwhile
                await self._reembed_segment(m, problem.shard, batch)
                m = await asyncio.to_thread(self.store.current, m, "repair")
