"""In-process indexing and search (the library path: tests, benchmarks, no Ray)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from ..config import ModelConfig, SearchConfig
from ..data.documents import Document
from ..search import Retrieval
from ..tokens import TokenLayout
from .multistep import SearchRun, Timings
from .shards import CorpusShards, ShardOptions
from .store import ChunkRecord, CorpusConflict, CorpusStore, Manifest


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
        from ..data.documents import chunk_documents

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
