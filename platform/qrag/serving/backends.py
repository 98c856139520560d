"""The encoder and the shard holders the service talks to, and their in-process forms.

The service sees two small interfaces: an :class:`EncoderClient` and :class:`HolderClient` s
(each reaches one :class:`~qrag.index.holder.ShardHolder`, which holds some shards of every
corpus; the hierarchy is in :mod:`qrag.index`). Behind Ray Serve they may be deployment handles
(``qrag.distributed.serving``); here they are objects of this process, which also answer
synchronously (``embed_now``, ``best_chunks_now``, ``score_now``) so that the batcher runs a whole round in one
worker thread (:mod:`qrag.serving.batcher`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from qrag.index.holder import ShardHolder
from qrag.index.local import ShardsBackend
from qrag.index.store import Manifest
from qrag.retrieval.embedder import EmbeddingModel
from qrag.retrieval.hits import ShardHits
from qrag.serving.errors import ServiceError

log = logging.getLogger("qrag.service")


class EncoderClient(Protocol):
    async def embed_states(self, seqs: list[np.ndarray]) -> np.ndarray: ...
    async def embed_chunks(self, seqs: list[np.ndarray]) -> np.ndarray: ...


class HolderClient(Protocol):
    """A client of one shard holder (some shards of every corpus): :class:`LocalHolder` in this
    process, ``RemoteHolder`` over a Serve handle. Raises ShardUnhealthy instead of serving a bad shard."""

    async def best_chunks(
        self, corpus: str, uid: str, version: int, states: np.ndarray, selected: list[list[int]], n_total: int, k: int
    ) -> ShardHits: ...
    async def ready(self, corpus: str, uid: str, version: int) -> None: ...
    async def stats(self, corpus: str | None) -> dict[str, Any]: ...
    async def forget(self, corpus: str) -> None: ...


class LocalEncoder:
    """The encoder in this process. One forward at a time (CUDA-graph input buffers are shared);
    its failures (CUDA out of memory, ...) answer 503 with Retry-After."""

    def __init__(self, model: EmbeddingModel, retry_after_s: int = 1):
        self.model, self.retry_after_s = model, retry_after_s
        self._lock = threading.Lock()
        self.forwards = 0  # state forwards run (tests count the batching)

    def _failed(self, exc: BaseException) -> ServiceError:
        log.warning("the encoder failed: %s", exc)
        return ServiceError(
            503, None, f"the encoder failed ({type(exc).__name__}); retry", {"Retry-After": str(self.retry_after_s)}
        )

    def _call(self, fn, seqs: list[np.ndarray]) -> np.ndarray:
        with self._lock:
            try:
                return fn(seqs)
            except (RuntimeError, MemoryError) as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
                raise self._failed(exc) from None

    def embed_now(self, seqs: list[np.ndarray]) -> np.ndarray:
        self.forwards += 1
        return self._call(self.model.embed_states, seqs)

    async def embed_states(self, seqs: list[np.ndarray]) -> np.ndarray:
        return await asyncio.to_thread(self.embed_now, seqs)

    async def embed_chunks(self, seqs: list[np.ndarray]) -> np.ndarray:
        return await asyncio.to_thread(self._call, self.model.embed_chunks, seqs)


class LocalHolder:
    """A :class:`ShardHolder` of this process behind the client interface. Corpora load in their
    own threads, so a search of a loaded corpus never waits behind another's load."""

    def __init__(self, holder: ShardHolder, loaders: int = 2):
        self.holder = holder
        self._loader = ThreadPoolExecutor(loaders, thread_name_prefix="qrag-load")

    def best_chunks_now(
        self, corpus: str, uid: str, version: int, states: np.ndarray, selected: list[list[int]], n_total: int, k: int
    ) -> ShardHits:
        return self.holder.best_chunks(corpus, uid, version, states, selected, n_total, k)

    async def best_chunks(self, *args) -> ShardHits:
        return await asyncio.to_thread(self.best_chunks_now, *args)

    async def ready(self, corpus: str, uid: str, version: int) -> None:
        if self.holder.loaded(corpus, uid, version) is None:
            await asyncio.get_running_loop().run_in_executor(self._loader, self.holder.ensure, corpus, uid, version)

    async def stats(self, corpus: str | None = None) -> dict[str, Any]:
        return self.holder.stats(corpus)

    async def forget(self, corpus: str) -> None:
        self.holder.forget(corpus)


class HoldersBackend:
    """The scoring backend of one corpus version over every holder client, asked all at once."""

    def __init__(self, clients: Sequence[HolderClient], m: Manifest):
        self.clients, self.m = list(clients), m
        if all(hasattr(c, "best_chunks_now") for c in self.clients):  # every holder in this process
            self.score_now = self._score_now

    def _args(self, states: np.ndarray, selected: list[list[int]], k: int) -> tuple:
        m = self.m
        return m.name, m.uid, m.version, states, selected, m.chunks, k

    async def score(self, states: np.ndarray, rows: list[int], selected: list[list[int]], k: int) -> list[ShardHits]:
        return list(await asyncio.gather(*(c.best_chunks(*self._args(states, selected, k)) for c in self.clients)))

    def _score_now(self, states: np.ndarray, rows: list[int], selected: list[list[int]], k: int) -> list[ShardHits]:
        return [c.best_chunks_now(*self._args(states, selected, k)) for c in self.clients]

    async def ready(self) -> None:
        """Every client holds the corpus version (loads happen here, not in a round)."""
        m = self.m
        await asyncio.gather(*(c.ready(m.name, m.uid, m.version) for c in self.clients))


class InlineBackend:
    """The scoring backend of an inline context: its shard, held by this process for one request
    (a :class:`ShardsBackend` behind the awaited interface, with ``score_now`` for the batcher)."""

    def __init__(self, backend: ShardsBackend):
        self.backend = backend

    def score_now(self, states: np.ndarray, rows: list[int], selected: list[list[int]], k: int) -> list[ShardHits]:
        return list(self.backend.score(states, rows, selected, k))

    async def score(self, states: np.ndarray, rows: list[int], selected: list[list[int]], k: int) -> list[ShardHits]:
        return await asyncio.to_thread(self.score_now, states, rows, selected, k)
