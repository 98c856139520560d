"""Encoders at fixed (batch, length) shapes, replayed from CUDA graphs: the state encoder at
serving time, and the chunk encoder while indexing on a GPU.

One short state through a 6-layer encoder is ~100 kernel launches. Run eagerly, that costs
milliseconds of Python and launch overhead while the GPU works for tens of microseconds. A CUDA
graph per padded shape replays the same kernels with one launch. While indexing, every op also
hands the GIL back and forth with the threads that gather tokenised input and write the store;
one replay per batch leaves the feeding thread a few GIL hand-overs instead of hundreds.

Padding a state to its bucket does not change its vector: padded positions are masked out of
attention and of the mean pool (tests check it against :func:`qrag.model.encoder.encode`). The
attention mask goes in 4-D (:func:`qrag.model.encoder.attention_mask_4d`), which transformers passes
through untouched: for a 2-D mask it first asks the GPU whether any token is padded (``mask.all()``),
a host sync that graph capture forbids and that costs a round trip per call even without graphs.

On CPU (or with ``graphs=False``) the same padded forward runs eagerly, so the serving path is
the same code everywhere; a shape whose capture fails falls back to eager once, and says why in
:attr:`GraphedEncoder.fallbacks`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from qrag.model.encoder import attention_mask_4d, autocast_for, in_input_order, mean_pool


def shape_keyed(fallbacks: dict[tuple[int, int], str]) -> dict[str, str]:
    """:attr:`GraphedEncoder.fallbacks`, keyed (batch, length), as JSON can hold them: "BxL"."""
    return {f"{b}x{n}": why for (b, n), why in fallbacks.items()}


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
LENGTH_BUCKETS = (32, 64, 96, 128, 192, 256, 384, 512)
# Chunks: finer lengths (a 64-token chunk is 66 ids, bucket 72), and few large row counts, as
# a corpus's chunks are nearly all the same length and come by the thousand.
CHUNK_LENGTH_BUCKETS = (16, 32, 48, 64, 72, 80, 96, 128, 160, 192, 256, 384, 512)
CHUNK_BATCH_BUCKETS = (64, 256, 1024, 4096)


_CAPTURE_LOCKS: dict[tuple[str, int], threading.Lock] = {}
_CAPTURE_LOCKS_GUARD = threading.Lock()


def capture_lock(device: torch.device | str) -> threading.Lock:
    """One lock per GPU for every CUDA-graph capture on it (chunk and state encoders, scoring).
    Two captures at once on one device failed: two feeder threads indexing on one GPU, each
    capturing its encoder's shapes, got "operation not permitted when stream is capturing";
    a query's state-encoder capture beside an
    append's chunk-encoder capture in a Serve replica could meet the same."""
    dev = torch.device(device)
    index = (
        dev.index
        if dev.index is not None
        else (torch.cuda.current_device() if dev.type == "cuda" and torch.cuda.is_available() else 0)
    )
    with _CAPTURE_LOCKS_GUARD:
        return _CAPTURE_LOCKS.setdefault((dev.type, index), threading.Lock())


def capture_graph(
    run: Callable[[], Any], device: torch.device, pool: Any, error_mode: str = "global"
) -> tuple[Any, Any, Any]:
    """Warm ``run`` up twice on a side stream of ``device`` (capture requires it; compiled code
    compiles there), then capture it on that stream with ``device`` current: (graph, its outputs,
    the memory pool, made when ``pool`` is None). Not on torch.cuda.graph's default capture
    stream: that one is one per process, made on the device current at its first use, and every
    capture on cuda:1 failed on it. The caller holds :func:`capture_lock`."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream(device).wait_stream(side)
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode=error_mode):
            outputs = run()
    return graph, outputs, pool


def bucket_of(value: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``value`` (None past the largest)."""
    for b in buckets:
        if value <= b:
            return b
    return None


class GraphedEncoder:
    """E_s(s) (or, given ``encoder=qnet.action_encoder``, E_a(a)) for a list of token sequences,
    at bucketed shapes (CUDA graphs on GPU)."""

    def __init__(
        self,
        qnet,
        pad_id: int,
        device: torch.device,
        *,
        graphs: bool | None = None,
        encoder: torch.nn.Module | None = None,
        batch_buckets: Sequence[int] = BATCH_BUCKETS,
        length_buckets: Sequence[int] = LENGTH_BUCKETS,
    ):
        self.qnet, self.pad_id, self.device = qnet, pad_id, torch.device(device)
        self.encoder = qnet.state_encoder if encoder is None else encoder
        limit = getattr(self.encoder.config, "max_position_embeddings", None) or max(length_buckets)
        self.length_buckets = tuple(b for b in length_buckets if b <= limit) or (int(limit),)
        self.batch_buckets = tuple(batch_buckets)
        self.graphs = (self.device.type == "cuda") if graphs is None else bool(graphs and self.device.type == "cuda")
        self._captured: dict[
            tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]
        ] = {}
        self._pool = None  # one memory pool shared by every captured shape
        self.fallbacks: dict[tuple[int, int], str] = {}
        self.replays = 0
        # A graph reads and writes fixed tensors: two threads replaying one shape (two appends in a
        # replica, or queries from several threads) would swap each other's inputs and outputs.
        # Copy-in, replay and copy-out are queued together on the stream, one thread at a time.
        self._replay_lock = threading.Lock()
        self.eager_calls = 0
        self.padded_tokens = 0  # ids fed to the encoder, padding included (the learner's counters read it)

    @property
    def captured_shapes(self) -> list[tuple[int, int]]:
        """(batch, length) of every shape replayed from a graph so far."""
        return sorted(self._captured)

    @classmethod
    def for_chunks(cls, qnet, pad_id: int, device: torch.device, **kwargs) -> GraphedEncoder:
        """The chunk encoder, for :meth:`encode_sorted` (indexing)."""
        kwargs.setdefault("batch_buckets", CHUNK_BATCH_BUCKETS)
        kwargs.setdefault("length_buckets", CHUNK_LENGTH_BUCKETS)
        return cls(qnet, pad_id, device, encoder=qnet.action_encoder, **kwargs)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with autocast_for(self.device):
            hidden = self.encoder(input_ids=ids, attention_mask=attention_mask_4d(self.encoder, mask)).last_hidden_state
            pooled = mean_pool(hidden, mask).float()
        return self.qnet.finish(pooled)

    def _capture(self, batch: int, length: int):
        ids = torch.full((batch, length), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros(batch, length, dtype=torch.bool, device=self.device)
        mask[:, 0] = True
        # thread_local: a query or an append in another thread of the replica may allocate or
        # launch meanwhile (on its own stream); 'global', the default, would fail that call.
        graph, out, self._pool = capture_graph(
            lambda: self._forward(ids, mask), self.device, self._pool, "thread_local"
        )
        return graph, ids, mask, out

    def _graph(self, batch: int, length: int):
        key = (batch, length)
        if key in self.fallbacks:
            return None
        entry = self._captured.get(key)
        if entry is None:
            with capture_lock(self.device):
                try:
                    entry = self._captured[key] = self._capture(batch, length)
                except RuntimeError as exc:  # an op that cannot be captured: this shape runs eagerly
                    self.fallbacks[key] = f"{type(exc).__name__}: {exc}"[:300]
                    torch.cuda.synchronize(self.device)
                    return None
        return entry

    def warm_up(self, max_batch: int, max_length: int) -> int:
        """Capture every shape a call of at most ``max_batch`` sequences of at most ``max_length``
        tokens can take, now rather than on the first call of each shape (a replica's first
        queries paid the captures). Returns how many shapes are ready; 0 where graphs are off."""
        if not self.graphs:
            return 0
        top_batch = bucket_of(max_batch, self.batch_buckets) or self.batch_buckets[-1]
        top_length = bucket_of(max_length, self.length_buckets) or self.length_buckets[-1]
        ready = 0
        with self._replay_lock:
            for batch in (b for b in self.batch_buckets if b <= top_batch):
                for length in (n for n in self.length_buckets if n <= top_length):
                    ready += self._graph(batch, length) is not None
        return ready

    def warm_up_sorted(self, max_length: int, max_tokens: int) -> int:
        """Make :meth:`encode_sorted` ready for sequences of at most ``max_length`` ids and
        ``max_tokens`` per forward (an indexing lane does it while it starts). The shape of its full
        batches of the longest sequences (nearly every batch of an index, as chunks fill their budget
        but at a document's end) is captured; every other shape it can take runs once eagerly, so
        its kernels are loaded now and its capture at first use is cheap. Without it, a fresh GPU
        machine's first run was markedly slower than the next, the captures and the kernels' first
        use falling inside the indexing. Capturing every shape instead (17 for MiniLM, each capture
        on its own stream) ran three lanes on one GPU out of memory. Returns how many shapes are
        captured (0 or 1); 0 where graphs are off."""
        if not self.graphs:
            return 0
        top = bucket_of(max_length, self.length_buckets) or self.length_buckets[-1]
        main = (self._rows_for(top, max_tokens), top)
        with self._replay_lock:
            ready = int(self._graph(*main) is not None)
            with torch.no_grad():
                for length in (n for n in self.length_buckets if n <= top):
                    for batch in (b for b in self.batch_buckets if b <= self._rows_for(length, max_tokens)):
                        if (batch, length) != main:
                            ids, mask = self._padded([np.full(length, self.pad_id, np.int64)], batch, length)
                            self._forward(ids.to(self.device), mask.to(self.device))
        return ready

    def _rows_for(self, length: int, max_tokens: int) -> int:
        """Rows of :meth:`encode_sorted`'s full batches of ``length``: the largest batch bucket of at
        most ``max_tokens`` padded tokens (the smallest bucket if none is)."""
        return max([b for b in self.batch_buckets if b * length <= max_tokens], default=self.batch_buckets[0])

    def _padded(self, seqs: Sequence[np.ndarray], batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(seqs)
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=n)
        ids = np.full((batch, length), self.pad_id, dtype=np.int64)
        mask = np.zeros((batch, length), dtype=bool)
        mask[:n] = np.arange(length)[None, :] < lengths[:, None]
        flat = (
            np.concatenate(seqs)
            if all(type(s) is np.ndarray and s.ndim == 1 for s in seqs)
            else np.concatenate([np.asarray(s).reshape(-1) for s in seqs])
        )
        ids[:n][mask[:n]] = flat  # row-major: each row's tokens in turn
        mask[n:, 0] = True  # rows beyond the request: one visible token keeps the pool finite
        ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
        if self.device.type == "cuda":  # pinned: the copies to the device (or the graph's inputs) run async
            return ids_t.pin_memory(), mask_t.pin_memory()
        return ids_t, mask_t

    @torch.no_grad()
    def __call__(self, seqs: Sequence[np.ndarray]) -> torch.Tensor:
        """[len(seqs), d] float32 vectors, in input order."""
        if not seqs:
            return torch.zeros(0, self.qnet.dim, device=self.device)
        top = self.batch_buckets[-1]
        if len(seqs) > top:
            return torch.cat([self(seqs[i : i + top]) for i in range(0, len(seqs), top)])
        longest = max(len(s) for s in seqs)
        length = bucket_of(longest, self.length_buckets)
        if length is None:
            raise ValueError(f"a state of {longest} tokens is longer than the encoder's {self.length_buckets[-1]}")
        batch = bucket_of(len(seqs), self.batch_buckets) or len(seqs)
        ids, mask = self._padded(seqs, batch, length)  # on the host
        self.padded_tokens += batch * length
        if self.graphs:
            with self._replay_lock:
                entry = self._graph(batch, length)
                if entry is not None:
                    graph, static_ids, static_mask, out = entry
                    static_ids.copy_(ids, non_blocking=True)  # straight into the graph's inputs: no device-side copy
                    static_mask.copy_(mask, non_blocking=True)
                    graph.replay()
                    self.replays += 1
                    return out[: len(seqs)].clone()
        self.eager_calls += 1
        return self._forward(ids.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True))[
            : len(seqs)
        ]

    @torch.no_grad()
    def encode_sorted(self, seqs: Sequence[np.ndarray], max_tokens: int) -> torch.Tensor:
        """Many sequences (a corpus's chunks), vectors in input order: sorted by length, then cut
        into batches of the largest batch bucket whose padded shape holds at most ``max_tokens``
        tokens (the smallest bucket if none does). Only the last batch of each length is padded
        with empty rows."""
        n = len(seqs)
        if n == 0:
            return torch.zeros(0, self.qnet.dim, device=self.device)
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=n)
        order = np.argsort(-lengths, kind="stable")
        pieces, start = [], 0
        while start < n:
            longest = int(lengths[order[start]])
            length = bucket_of(longest, self.length_buckets)
            if length is None:
                raise ValueError(
                    f"a sequence of {longest} tokens is longer than the encoder's {self.length_buckets[-1]}"
                )
            rows = self._rows_for(length, max_tokens)
            pieces.append(self([seqs[i] for i in order[start : start + rows]]))
            start += rows
        return in_input_order(pieces, order)
