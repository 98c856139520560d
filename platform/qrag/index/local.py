"""In-process indexing and search (the library path: tests, benchmarks, no Ray)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from qrag.config import ModelConfig, SearchConfig
from qrag.data.documents import Document, DocumentChunk
from qrag.retrieval.multistep import Retrieval, SearchRun, Timings, search
from qrag.data.tokens import TokenLayout
from qrag.index.shards import CorpusShards, ShardIndex, ShardOptions, as_devices, score_shards
from qrag.retrieval.hits import ShardHits
from qrag.index.pipeline import IndexStats, document_groups, index_groups
from qrag.index.store import CorpusConflict, CorpusStore, Manifest, ManifestCache, StoreError
from qrag.retrieval.hits import ChunkRecord


class Embedder(Protocol):
    """What indexing and search need of a model (see :class:`qrag.retrieval.embedder.EmbeddingModel`)."""

    fingerprint: str
    model_cfg: ModelConfig
    dim: int
    layout: TokenLayout

    def count_tokens(self, texts: list[str]) -> list[int]: ...
    def tokenize_chunks(self, texts: Sequence[str], chunk_tokens: int) -> list[np.ndarray]: ...
    def chunk_documents(
        self, docs: Sequence[Document], chunk_tokens: int
    ) -> tuple[list[DocumentChunk], list[np.ndarray]]: ...
    def tokenize_question(self, text: str) -> np.ndarray: ...
    def embed_chunks(self, seqs: Sequence[np.ndarray]) -> np.ndarray: ...
    def embed_states(self, seqs: Sequence[np.ndarray]) -> np.ndarray: ...


class ShardsBackend:
    """Scoring backend over ShardIndex objects the caller holds (the library index, an inline context):
    every state row is scored against the first ``n_total`` chunks of one corpus (the torch shards
    of a device in one pass with one copy to the host: :func:`qrag.index.shards.score_shards`)."""

    def __init__(self, shards: Sequence[ShardIndex], n_total: int):
        self.shards, self.n_total = list(shards), n_total

    def score(self, states, rows: list[int], selected: list[list[int]], k: int) -> list[ShardHits]:
        return score_shards(self.shards, states, selected, self.n_total, k)


class LocalIndex:
    """Index documents and search corpora in one process, every shard in memory."""

    def __init__(
        self,
        store: CorpusStore,
        model: Embedder,
        device: torch.device | str | Sequence[torch.device | str] = "cpu",
        options: ShardOptions | None = None,
        chunk_batch: int = 4096,
        commit_chunks: int | None = 65536,
        pipelined: bool = True,
        writer: str = "thread",
        replicas: Sequence[Embedder] = (),
    ):
        """``device``: where the shards are held; several: shard s on ``device[s % n]``.
        ``replicas``: the model on more devices (``EmbeddingModel.replica``): indexing embeds
        commit groups on all of them (:func:`qrag.index.pipeline.index_groups`)."""
        self.store, self.model = store, model
        self.devices = as_devices(device)
        self.device = self.devices[0]
        self.replicas = list(replicas)
        self.options = options or ShardOptions()
        self.chunk_batch = chunk_batch
        self.commit_chunks = commit_chunks  # chunks per committed batch (whole documents); None: one batch per call
        self.pipelined = pipelined  # prep, embedding and writing overlap (qrag.index.pipeline)
        self.writer = writer  # "thread" or "process": where a pipelined run writes the store
        self.last_stats: IndexStats | None = None  # stage timings of the last add_documents
        self._open: dict[str, CorpusShards] = {}
        self._manifests = ManifestCache(store)  # searches stat corpus.json; they parse it only when it changed

    def create(self, name: str, chunk_tokens: int, shards: int, dtype: str = "float32") -> Manifest:
        return self.store.create(
            name,
            fingerprint=self.model.fingerprint,
            model=self.model.model_cfg,
            dim=self.model.dim,
            chunk_tokens=chunk_tokens,
            shards=shards,
            dtype=dtype,
        )

    def add_documents(
        self, name: str, docs: Sequence[Document], progress=None, *, resume: bool = False, on_commit=None
    ) -> Manifest:
        """Chunk, tokenise, embed and store ``docs`` (in order) through :mod:`qrag.index.pipeline`:
        committed in batches of whole documents of about ``commit_chunks`` chunks, each batch
        atomically (a failure leaves the corpus at the last whole batch and is raised here).
        ``resume``: documents the corpus holds already are skipped (finishing an interrupted
        call without embedding them again); otherwise they are a CorpusConflict, before any work.
        ``progress(done, known)`` after every encoder call: chunks embedded, chunks prepared."""

        m = self.store.read(name)
        seen: set[str] = set()
        for d in docs:
            if d.id in seen:
                raise CorpusConflict(f"document id {d.id!r} appears twice in this request")
            seen.add(d.id)
        committed = set(self.store.doc_ids(m))
        if resume:
            docs = [d for d in docs if d.id not in committed]
        # Before any embedding: append refuses the same, but only after the work.
        self.store.check_new(m, docs, self.model.fingerprint, committed)
        chunk_tokens = m.chunk_tokens

        def prepare(block: list[Document]):
            return self.model.chunk_documents(block, chunk_tokens)

        if resume and not docs:
            return m
        groups = document_groups(docs, prepare, self.commit_chunks)
        manifest, self.last_stats = index_groups(
            self.store,
            name,
            self.model,
            groups,
            chunk_batch=self.chunk_batch,
            pipelined=self.pipelined,
            progress=progress,
            on_commit=on_commit,
            writer=self.writer,
            replicas=self.replicas,
        )
        return manifest

    def shards(self, name: str, m: Manifest | None = None) -> CorpusShards:
        """The corpus's shards in memory, caught up with its manifest ``m`` (default: read now)."""
        m = m or self._manifests.read(name)
        cs = self._open.get(name)
        if cs is None or cs.uid != m.uid:
            cs = self._open[name] = CorpusShards(self.store, name, range(m.shards), self.devices, self.options)
        cs.sync(m.version, m.uid)
        return cs

    def retrieve(
        self, name: str, question: str, cfg: SearchConfig
    ) -> tuple[Retrieval, dict[int, ChunkRecord], Timings]:
        t0 = time.perf_counter()
        timings = Timings()
        m = self._manifests.read(name)
        if m.fingerprint != self.model.fingerprint:
            raise CorpusConflict(
                f"corpus {name!r} was indexed with model {m.fingerprint}, not {self.model.fingerprint}"
            )
        cs = self.shards(name, m)
        q_ids = self.model.tokenize_question(question)
        timings.tokenize = time.perf_counter() - t0
        run = SearchRun(q_ids, self.model.layout, cfg, m.chunks)
        search([run], self.model.embed_states, self._backend(cs, m), timings)
        timings.total = time.perf_counter() - t0
        return run.result(seconds=timings.total), run.records, timings

    def retrieve_many(self, name: str, questions: Sequence[str], cfg: SearchConfig) -> list[Retrieval]:
        """Search several questions in lockstep: one state-encoder call and one scoring pass per
        shard per step for all of them (what batching concurrent requests buys)."""
        t0 = time.perf_counter()
        m = self._manifests.read(name)
        cs = self.shards(name, m)
        runs = [SearchRun(self.model.tokenize_question(q), self.model.layout, cfg, m.chunks) for q in questions]
        search(runs, self.model.embed_states, self._backend(cs, m))
        seconds = (time.perf_counter() - t0) / max(1, len(runs))
        return [run.result(seconds=seconds) for run in runs]

    @staticmethod
    def _backend(cs: CorpusShards, m: Manifest) -> ShardsBackend:
        if m.chunks < 1:
            raise StoreError(f"corpus {m.name!r} has no chunks")
        return ShardsBackend([cs.shards[s] for s in range(m.shards)], m.chunks)
