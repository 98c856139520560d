"""Retrieval requests: range checks, the search over a corpus or an inline context through the
replica's :class:`~qrag.serving.batcher.LockstepBatcher`, repair of unhealthy shards, and the
answer's shape."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from qrag.config import SearchConfig
from qrag.data.documents import Document, check_text
from qrag.data.sample import DataError
from qrag.index.local import ShardsBackend
from qrag.index.shards import ShardIndex, ShardOptions, ShardUnhealthy
from qrag.index.store import Segment
from qrag.retrieval.hits import ChunkRecord
from qrag.retrieval.multistep import SearchRun, Timings
from qrag.serving.backends import HoldersBackend, InlineBackend
from qrag.serving.batcher import LockstepBatcher
from qrag.serving.corpora import CorpusAdmin
from qrag.serving.errors import ServiceError, data_error


BEAM_TEMPERATURES = (1e-4, 1e4)  # what a request's beam_temperature may be


@dataclass
class RetrieveParams:
    question: str
    corpus: str | None = None
    context: str | None = None
    max_steps: int = 2
    beam_width: int = 1
    beam_score: str = "min"
    beam_temperature: float = 0.05
    stop_threshold: float | None = None
    alternatives: int = 3
    chunk_tokens: int | None = None  # inline context only
    return_chunks: bool = False  # inline context only: echo the chunking (the web page draws it)


class RetrievalRequests:
    def __init__(self, corpora: CorpusAdmin, batcher: LockstepBatcher):
        self.corpora, self.batcher = corpora, batcher
        self.cfg, self.tok, self.model, self.metrics = corpora.cfg, corpora.tok, corpora.model, corpora.metrics

    def check(self, p: RetrieveParams) -> SearchConfig:
        """Range checks of a request (types are checked by the HTTP layer)."""
        c = self.cfg
        if (p.corpus is None) == (p.context is None):
            raise ServiceError(
                422, "corpus", "give exactly one of 'corpus' (an indexed corpus) and 'context' (inline text)"
            )
        if not p.question.strip():
            raise ServiceError(422, "question", "empty question")
        if len(p.question) > c.max_question_chars:
            raise ServiceError(
                422, "question", f"question of {len(p.question)} characters; at most {c.max_question_chars}"
            )
        for name, value, hi in (
            ("max_steps", p.max_steps, c.max_steps),
            ("beam_width", p.beam_width, c.max_beam_width),
        ):
            if not 1 <= value <= hi:
                raise ServiceError(422, name, f"{name} must be between 1 and {hi}, got {value}")
        if not 0 <= p.alternatives <= c.max_alternatives:
            raise ServiceError(
                422, "alternatives", f"alternatives must be between 0 and {c.max_alternatives}, got {p.alternatives}"
            )
        lo, hi = BEAM_TEMPERATURES
        if not lo <= p.beam_temperature <= hi:  # Q / τ must stay a finite float for every Q in [-1, 1]
            raise ServiceError(
                422, "beam_temperature", f"beam_temperature must be between {lo:g} and {hi:g}, got {p.beam_temperature}"
            )
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
                raise ServiceError(
                    413,
                    "context",
                    f"context of {len(p.context)} characters; at most {c.max_context_chars} "
                    f"(index it as a corpus instead)",
                )
            self.corpora.chunk_budget(p.chunk_tokens)
            long = re.search(r"\S{%d,}" % (c.max_word_chars + 1), p.context)
            if long:
                raise ServiceError(
                    422,
                    "context",
                    f"context: {long.end() - long.start()} characters without a space at character "
                    f"{long.start()}; at most {c.max_word_chars} (max_word_chars)",
                )
        elif p.chunk_tokens is not None or p.return_chunks:
            field = "chunk_tokens" if p.chunk_tokens is not None else "return_chunks"
            raise ServiceError(422, field, "only for an inline 'context' (a corpus keeps its own chunking)")
        return SearchConfig(
            max_steps=p.max_steps,
            beam_width=p.beam_width,
            beam_score=p.beam_score,
            beam_temperature=float(p.beam_temperature),
            stop_threshold=p.stop_threshold,
            alternatives=p.alternatives,
        )

    async def retrieve(self, p: RetrieveParams) -> dict[str, Any]:
        # An inline context's checks scan up to max_context_chars: in a thread, off the event loop.
        search = await asyncio.to_thread(self.check, p) if p.context is not None else self.check(p)
        if p.context is not None:
            return await self._retrieve_context(p, search)
        t0 = time.perf_counter()
        m = self.corpora.searchable(p.corpus)
        question = self.tok.tokenize_question(p.question)
        timings = Timings(tokenize=time.perf_counter() - t0)
        for attempt in range(2 + len(m.batches) * m.shards):
            try:
                backend = HoldersBackend(self.corpora.holders, m)
                await backend.ready()
                run = SearchRun(question, self.tok.layout, search, m.chunks)
                await self.batcher.run(run, backend, (m.name, m.uid, m.version, m.chunks), timings)
                break
            except ShardUnhealthy as exc:
                if attempt > len(m.batches) * m.shards:
                    raise ServiceError(503, "corpus", f"corpus {m.name!r} is unhealthy: {exc}") from None
                m = await self.corpora.repaired(m.name, exc)
        timings.total = time.perf_counter() - t0
        return self._response(p, run, timings, m.chunks)

    async def _retrieve_context(self, p: RetrieveParams, search: SearchConfig) -> dict[str, Any]:
        """One long document per question (the BabiLong setting): chunk, embed, search in memory."""
        t0 = time.perf_counter()
        budget = p.chunk_tokens or self.cfg.chunk_tokens
        chunks, ids = await asyncio.to_thread(self.tok.chunk_documents, [Document("context", p.context)], budget)
        question = self.tok.tokenize_question(p.question)
        timings = Timings(tokenize=time.perf_counter() - t0)
        t = time.perf_counter()
        vectors = await self.corpora.embed_chunks(ids)
        timings.encode += time.perf_counter() - t
        shard = ShardIndex(
            "context", 0, 1, self.model.model_cfg, self.model.dim, torch.device("cpu"), ShardOptions(faiss="never")
        )
        await asyncio.to_thread(
            shard.add,
            Segment(0, np.arange(len(chunks)), vectors, ids, [c.doc_id for c in chunks], [c.text for c in chunks]),
        )
        backend = InlineBackend(ShardsBackend([shard], len(chunks)))
        run = SearchRun(question, self.tok.layout, search, len(chunks))
        await self.batcher.run(run, backend, backend, timings)  # its own key: nobody shares an inline context
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

        steps = [
            {
                "step": i + 1,
                **chunk(s.chunk),
                "q": s.q,
                "position": s.position,
                "alternatives": [{**chunk(a), "q": q} for a, q in s.alternatives],
            }
            for i, s in enumerate(result.steps)
        ]
        return {
            "corpus": p.corpus,
            "question": p.question,
            "steps": steps,
            "stopped_early": result.stopped_early,
            "n_chunks": n_chunks,
            "timings": timings.as_ms(),
            "search": {
                "max_steps": p.max_steps,
                "beam_width": p.beam_width,
                "beam_score": p.beam_score,
                "beam_temperature": float(p.beam_temperature),
                "stop_threshold": p.stop_threshold,
                "alternatives": p.alternatives,
            },
            "model": {"fingerprint": self.model.fingerprint, "trained": self.model.trained},
        }
