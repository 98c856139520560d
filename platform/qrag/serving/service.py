"""The retrieval service without its transport: what the HTTP routes call.

It is put together from one module per concern: corpora and their writes
(:mod:`qrag.serving.corpora`), indexing jobs (:mod:`qrag.serving.job_runner`), retrieval
requests (:mod:`qrag.serving.retrieval`) stepped together across requests
(:mod:`qrag.serving.batcher`), over an encoder and shard holders (:mod:`qrag.serving.backends`:
in this process, or Serve deployment handles from ``qrag.distributed.serving``), with errors
mapped once (:mod:`qrag.serving.errors`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from qrag.index.holder import ShardHolder
from qrag.index.store import CorpusStore
from qrag.retrieval.embedder import EmbeddingModel, Tokenization
from qrag.serving.backends import EncoderClient, HolderClient, LocalEncoder, LocalHolder
from qrag.serving.batcher import LockstepBatcher
from qrag.serving.corpora import CorpusAdmin
from qrag.serving.identity import ModelIdentity
from qrag.serving.metrics import Metrics
from qrag.serving.retrieval import RetrievalRequests, RetrieveParams
from qrag.serving.service_config import ServeConfig


class RetrievalService:
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
        self.cfg, self.store, self.model = cfg, store, model
        self.corpora = CorpusAdmin(cfg, store, tok, model, encoder, holders, metrics)
        self.batcher = LockstepBatcher(encoder, cfg.state_batch_size)
        self.requests = RetrievalRequests(self.corpora, self.batcher)
        self.jobs = self.corpora.jobs

    @property
    def holders(self) -> list[HolderClient]:
        """The clients of the shard holders every corpus's shards are spread over."""
        return self.corpora.holders

    @property
    def encoder(self) -> EncoderClient:
        return self.corpora.encoder

    @encoder.setter
    def encoder(self, encoder: EncoderClient) -> None:
        """One encoder for the corpora's writes and the batcher's rounds (tests wrap it)."""
        self.corpora.encoder = self.batcher.encoder = encoder

    # The routes' calls, each answered by the module that owns it.

    async def retrieve(self, p: RetrieveParams) -> dict[str, Any]:
        return await self.requests.retrieve(p)

    def list_corpora(self) -> list[dict[str, Any]]:
        return self.corpora.list_corpora()

    async def corpus_stats(self, name: str) -> dict[str, Any]:
        return await self.corpora.stats(name)

    async def create(
        self, name: str, documents: Any = None, chunk_tokens: int | None = None, wait: bool = True
    ) -> dict[str, Any]:
        return await self.corpora.create(name, documents, chunk_tokens, wait)

    async def append(self, name: str, documents: Any, wait: bool = True) -> dict[str, Any]:
        return await self.corpora.append(name, documents, wait)

    async def delete(self, name: str) -> dict[str, Any]:
        return await self.corpora.delete(name)

    async def reindex(self, name: str, wait: bool = False) -> dict[str, Any]:
        return await self.corpora.reindex(name, wait)

    def job(self, job_id: str) -> dict[str, Any]:
        return self.jobs.job(job_id)

    def corpus_jobs(self, name: str) -> dict[str, Any]:
        self.corpora.path_of(name)  # 422 for a name that is no corpus name
        return self.jobs.corpus_jobs(name)

    async def health(self) -> dict[str, Any]:
        trained = self.model.trained
        return {
            "status": "ok",
            "model": self.model.describe(),
            "message": "serving a trained checkpoint"
            if trained
            else "serving the UNTRAINED bundled encoder: no checkpoint is configured "
            "(set checkpoint in serve/config.yaml or --checkpoint)",
            "shards": len(self.corpora.holders),
            "corpora": len(self.store.names()),
        }


def local_holders(
    cfg: ServeConfig, store: CorpusStore, device: str | torch.device, holders: int | None = None
) -> list[LocalHolder]:
    """Shard holders of this process: ``holders`` of them (default ``cfg.shard_holders()``)."""
    n = cfg.shard_holders() if holders is None else holders
    options = cfg.shard_options()
    budget = cfg.shard_budget(torch.device(device), n)  # shard_memory_bytes, or a share of the machine
    return [LocalHolder(ShardHolder(store, s, n, torch.device(device), options, budget)) for s in range(n)]


def local_service(
    cfg: ServeConfig,
    model: EmbeddingModel,
    device: str = "cpu",
    metrics: Metrics | None = None,
    holders: int | None = None,
) -> RetrievalService:
    """The whole service in one process (no Ray): ``holders`` shard holders (default
    ``cfg.shard_holders()``; 1 = every shard in one holder, scored in one pass per step)."""
    store = CorpusStore(cfg.storage)
    return RetrievalService(
        replace(cfg),
        store,
        model,
        ModelIdentity.of(model),
        LocalEncoder(model, cfg.retry_after_s),
        local_holders(cfg, store, device, holders),
        metrics,
    )
