"""Search over contexts held in memory (evaluation, training checks, the MLflow model): embed
every chunk of each context once, then run the multi-step search of :mod:`qrag.retrieval.multistep` —
greedy, beam search over Q, Q-threshold stopping — with :class:`ContextVectors` scoring.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from qrag import progress
from qrag.config import SearchConfig
from qrag.model.encoder import EncodeStats, encode, pad_rows
from qrag.retrieval.hits import ShardHits
from qrag.retrieval.multistep import Retrieval, SearchRun, search
from qrag.model.qnet import QNetwork
from qrag.retrieval.scoring import score_chunks
from qrag.data.tokens import TokenizedSample, TokenLayout

RETRIEVE = "retrieve"  # the progress kind of questions searched (a command's bar over many calls collects them)


class ContextVectors:
    """Scoring backend over the chunk vectors of several contexts in memory, one per search run:
    ``vectors`` [S, N, d] (zeros beyond each context's ``counts``), scored by ``retriever.score``
    with the positions of the whole context (a subclass or a test may replace that rule)."""

    def __init__(self, retriever: Retriever, vectors: torch.Tensor, counts: np.ndarray):
        self.retriever, self.vectors = retriever, vectors
        self.counts = torch.from_numpy(counts).to(vectors.device)
        self.valid = torch.arange(vectors.shape[1], device=vectors.device)[None, :] < self.counts[:, None]

    @torch.no_grad()
    def score(self, states: torch.Tensor, rows: list[int], selected: list[list[int]], k: int) -> list[ShardHits]:
        dev, width = self.vectors.device, self.vectors.shape[1]
        idx = torch.tensor(rows, device=dev)
        mask = torch.zeros(len(rows), width, dtype=torch.bool, device=dev)
        for r, sel in enumerate(selected):
            if sel:
                mask[r, sel] = True
        # One context: its [N, d] vectors are shared by all rows (one matmul, no gathered copy).
        vecs = self.vectors[0] if len(self.vectors) == 1 else self.vectors[idx]
        n_chunks = self.counts[idx]
        pos = self.retriever.qnet.positions(mask, n_chunks)
        q = self.retriever.score(states, vecs, mask, n_chunks, positions=pos)
        q = q.masked_fill(mask | ~self.valid[idx], float("-inf"))
        top_q, top_i = q.topk(min(k, width), dim=1)
        top_pos = None if pos is None else pos.gather(1, top_i).cpu().numpy()
        top_q, top_i = top_q.cpu().numpy(), top_i.cpu().numpy()
        return [ShardHits(top_q, np.where(np.isfinite(top_q), top_i, -1), top_pos)]


class Retriever:
    """Runs the search for a trained (or untrained) Q-network on any device."""

    def __init__(self, qnet: QNetwork, layout: TokenLayout, device: torch.device, encode_tokens: int = 32768):
        self.qnet = qnet.eval()
        self.layout = layout
        self.device = device
        self.encode_tokens = encode_tokens
        self.stats = EncodeStats()

    def _encode(self, model, seqs: Sequence[np.ndarray], kind: str) -> torch.Tensor:
        pooled = encode(
            model,
            seqs,
            pad_id=self.layout.pad_id,
            device=self.device,
            max_tokens=self.encode_tokens,
            stats=self.stats,
            kind=kind,
        )
        return self.qnet.finish(pooled)

    @torch.no_grad()
    def embed_chunks(self, seqs: Sequence[np.ndarray], chunk_batch: int = 4096) -> torch.Tensor:
        """Chunk vectors [N, d], ``chunk_batch`` chunks per call so peak memory does not grow with N."""
        parts = [
            self._encode(self.qnet.action_encoder, seqs[i : i + chunk_batch], "chunks")
            for i in range(0, len(seqs), chunk_batch)
        ]
        return torch.cat(parts) if parts else torch.zeros(0, self.qnet.dim, device=self.device)

    @torch.no_grad()
    def embed_states(self, seqs: Sequence[np.ndarray]) -> torch.Tensor:
        return self._encode(self.qnet.state_encoder, seqs, "states")

    @torch.no_grad()
    def score(
        self,
        states: torch.Tensor,
        chunk_vecs: torch.Tensor,
        selected: torch.Tensor,
        n_chunks: torch.Tensor,
        block: int | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Q (mean of the twin halves) of every chunk for each state row: [L, N].

        ``chunk_vecs`` is [L, N, d] or [N, d] shared by all rows. Without positions the mean of
        the twin dot products is half the full dot product: one matmul, no copy of the vectors.
        With positions the rotation is folded into the dot product (never materialising rotated
        copies of the chunk vectors), ``block`` chunks at a time (default: ~2M floats per
        temporary, whatever the number of rows), so extra memory does not grow with N x L.
        ``positions`` may pass ``self.qnet.positions(selected, n_chunks)`` already computed.
        """
        pos = self.qnet.positions(selected, n_chunks) if positions is None else positions
        return score_chunks(states, chunk_vecs, pos, self.qnet.cfg.rope_base, block)

    def retrieve(
        self, samples: Sequence[TokenizedSample], cfg: SearchConfig, max_batch_chunks: int = 65536
    ) -> list[Retrieval]:
        """Search every sample; short contexts are batched together, long ones run alone."""
        results: list[Retrieval] = []
        batch: list[TokenizedSample] = []
        size = 0
        with progress.bar(len(samples), "retrieve", "q", kind=RETRIEVE) as shown:
            for sample in samples:
                if batch and size + sample.n_chunks > max_batch_chunks:
                    results.extend(self._retrieve_batch(batch, cfg))
                    shown.update(len(batch))
                    batch, size = [], 0
                batch.append(sample)
                size += sample.n_chunks
            if batch:
                results.extend(self._retrieve_batch(batch, cfg))
                shown.update(len(batch))
        return results

    @torch.no_grad()
    def _retrieve_batch(self, samples: Sequence[TokenizedSample], cfg: SearchConfig) -> list[Retrieval]:
        """The samples' searches in lockstep: one state-encoder call and one scoring pass per step."""
        t0 = time.perf_counter()
        counts = np.array([s.n_chunks for s in samples])
        flat = self.embed_chunks([c for s in samples for c in s.chunks], cfg.chunk_batch)
        vectors = flat.unsqueeze(0) if len(samples) == 1 else pad_rows(flat, counts)
        runs = [SearchRun(s.question, self.layout, cfg, s.n_chunks, chunks=s.chunks) for s in samples]
        search(runs, self.embed_states, ContextVectors(self, vectors, counts))
        seconds = (time.perf_counter() - t0) / len(samples)
        return [run.result(s.id, seconds) for s, run in zip(samples, runs)]
