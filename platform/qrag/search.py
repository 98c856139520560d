"""Inference: embed the chunks once, then step by step embed the state and score every available
chunk (a dot product after the position rotation). Greedy, beam search over Q (Plan Q-RAG), and
stopping when the best available Q falls below a threshold.

Beam search keeps, per question, the ``beam_width`` best paths and returns the best-scoring one.
How a path is scored (``search.beam_score``) follows from what Q estimates: Q(s_t, a_t) is the
expected return of the whole episode from s_t (which holds the path's earlier picks) taking a_t,
and the reward comes only at the end. So for an exact Q every Q along a path estimates the value
of that same path, and the Bellman equation bounds the later ones by the earlier ones:
Q(s_t, a_t) = γ·V(s_{t+1}) ≥ γ·Q(s_{t+1}, a_{t+1}) (the soft value is at least the max).

* ``min`` (default): the lowest Q along the path. For an exact Q (γ ≈ 1) it is the Q of the last
  step, the path's own value; where the learned Q breaks the bound — a later step, in a state
  the policy rarely reaches (after a wrong pick), valued above what the earlier step promised —
  the earlier, better-trained estimate caps it.
* ``last``: the Q of the last step alone. It trusts exactly those off-policy over-estimates and
  measured far below greedy (bench/results/beam_vs_greedy_cpu.json).

Ties go to the path whose last step has the higher Q (then to the better parent), so beam search
follows greedy's choice unless another path scores strictly higher. For T = 2 the greedy path is
always among the final candidates, so the returned path never scores below it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .config import SearchConfig
from .encoder import EncodeStats, encode, pad_rows
from .positions import rope_frequencies
from .qnet import QNetwork
from .tokens import TokenizedSample, TokenLayout


@dataclass
class Step:
    chunk: int
    q: float
    position: float | None
    alternatives: list[tuple[int, float]]  # the best other candidates at this step


@dataclass
class Retrieval:
    sample_id: str
    steps: list[Step]
    stopped_early: bool = False  # a Q threshold ended it before max_steps
    seconds: float = 0.0

    @property
    def selected(self) -> list[int]:
        return [s.chunk for s in self.steps]


# How a path's score follows from its parent's score and the Q of its new last step.
BEAM_SCORES = {
    "min": lambda parent, q: min(parent, q),
    "last": lambda parent, q: q,
}


def _rank(beam: _Beam) -> tuple[float, float]:
    """Sort key, best first: the path's score, then the Q of its last step."""
    return (-beam.score, -(beam.steps[-1].q if beam.steps else float("inf")))


def best_path(beams: Sequence[_Beam]) -> _Beam:
    """The path search returns: the best by :func:`_rank` (offline search and the sharded index alike)."""
    return min(beams, key=_rank)


def beam_rule(name: str):
    if name not in BEAM_SCORES:
        raise ValueError(f"search.beam_score must be one of {', '.join(BEAM_SCORES)}, got {name!r}")
    return BEAM_SCORES[name]


@dataclass
class _Beam:
    sample: int
    steps: list[Step] = field(default_factory=list)
    score: float = float("inf")
    finished: bool = False

    @property
    def chosen(self) -> frozenset[int]:
        return frozenset(s.chunk for s in self.steps)


@torch.no_grad()
def score_chunks(states: torch.Tensor, chunk_vecs: torch.Tensor, pos: torch.Tensor | None, rope_base: float,
                 block: int | None = None) -> torch.Tensor:
    """Q (mean of the twin halves) of every chunk for each state row: [L, N], the chunks rotated to
    ``pos`` [L, N] (or not, for None). ``chunk_vecs`` is [L, N, d] or [N, d] shared by all rows.
    The one scoring rule of offline search and of the sharded index."""
    if pos is None:
        if chunk_vecs.dim() == 2:
            return (states.float() @ chunk_vecs.float().T) * 0.5
        return torch.einsum("ld,lnd->ln", states.float(), chunk_vecs.float()) * 0.5
    n, d = chunk_vecs.shape[-2], states.shape[-1]
    rows, q4 = len(states), d // 4
    block = block or max(1024, (1 << 21) // max(1, rows * d))
    freqs = rope_frequencies(d, rope_base, states.device)
    # Pairs (2k, 2k+1) of each twin half, as in qrag.positions.rotate: u, w of the state and
    # x, y of a chunk; <s, R(θ)a> = Σ cosθ·(u·x + w·y) + sinθ·(w·x − u·y).
    st = states.float().reshape(rows, 1, 2, q4, 2)
    u, w = st[..., 0], st[..., 1]
    out = torch.empty(rows, n, device=states.device, dtype=torch.float32)
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        v = chunk_vecs[..., lo:hi, :].float()
        v = v.reshape(*v.shape[:-1], 2, q4, 2)
        x, y = v[..., 0], v[..., 1]  # [(L,) b, 2, d/4]
        along = (u * x).sum(-2) + (w * y).sum(-2)  # [L, b, d/4], summed over the two halves
        across = (w * x).sum(-2) - (u * y).sum(-2)
        angles = pos[:, lo:hi].to(torch.float32).unsqueeze(-1) * freqs
        out[:, lo:hi] = 0.5 * (angles.cos() * along + angles.sin() * across).sum(-1)
    return out


class Retriever:
    """Runs the search for a trained (or untrained) Q-network on any device."""

    def __init__(self, qnet: QNetwork, layout: TokenLayout, device: torch.device, encode_tokens: int = 32768):
        self.qnet = qnet.eval()
        self.layout = layout
        self.device = device
        self.encode_tokens = encode_tokens
        self.stats = EncodeStats()

    def _encode(self, model, seqs: Sequence[np.ndarray], kind: str) -> torch.Tensor:
        pooled = encode(model, seqs, pad_id=self.layout.pad_id, device=self.device, max_tokens=self.encode_tokens, stats=self.stats, kind=kind)
        return self.qnet.finish(pooled)

    @torch.no_grad()
    def embed_chunks(self, seqs: Sequence[np.ndarray], chunk_batch: int = 4096) -> torch.Tensor:
        """Chunk vectors [N, d], ``chunk_batch`` chunks per call so peak memory does not grow with N."""
        parts = [self._encode(self.qnet.action_encoder, seqs[i : i + chunk_batch], "chunks") for i in range(0, len(seqs), chunk_batch)]
        return torch.cat(parts) if parts else torch.zeros(0, self.qnet.dim, device=self.device)

    @torch.no_grad()
    def embed_states(self, seqs: Sequence[np.ndarray]) -> torch.Tensor:
        return self._encode(self.qnet.state_encoder, seqs, "states")

    @torch.no_grad()
    def score(self, states: torch.Tensor, chunk_vecs: torch.Tensor, selected: torch.Tensor, n_chunks: torch.Tensor,
              block: int | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
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

    def retrieve(self, samples: Sequence[TokenizedSample], cfg: SearchConfig, max_batch_chunks: int = 65536) -> list[Retrieval]:
        """Search every sample; short contexts are batched together, long ones run alone."""
        results: list[Retrieval] = []
        batch: list[TokenizedSample] = []
        size = 0
        for sample in samples:
            if batch and size + sample.n_chunks > max_batch_chunks:
                results.extend(self._retrieve_batch(batch, cfg))
                batch, size = [], 0
            batch.append(sample)
            size += sample.n_chunks
        if batch:
            results.extend(self._retrieve_batch(batch, cfg))
        return results

    @torch.no_grad()
    def _retrieve_batch(self, samples: Sequence[TokenizedSample], cfg: SearchConfig) -> list[Retrieval]:
        t0 = time.perf_counter()
        dev = self.device
        counts = np.array([s.n_chunks for s in samples])
        width = int(counts.max())
        flat = self.embed_chunks([c for s in samples for c in s.chunks], cfg.chunk_batch)
        if len(samples) == 1:
            chunk_vecs = flat.unsqueeze(0)
        else:
            chunk_vecs = pad_rows(flat, counts)
        counts_t = torch.from_numpy(counts).to(dev)
        valid = torch.arange(width, device=dev)[None, :] < counts_t[:, None]
        beams = [_Beam(i) for i in range(len(samples))]
        width_beam = max(1, cfg.beam_width)
        for _ in range(cfg.max_steps):
            live = [b for b in beams if not b.finished]
            if not live:
                break
            states = self.embed_states([self._state_ids(samples[b.sample], b) for b in live])
            rows = torch.tensor([b.sample for b in live], device=dev)
            selected = torch.zeros(len(live), width, dtype=torch.bool, device=dev)
            for i, b in enumerate(live):
                if b.steps:
                    selected[i, list(b.chosen)] = True
            vecs = chunk_vecs[0] if len(samples) == 1 else chunk_vecs[rows]
            pos = self.qnet.positions(selected, counts_t[rows])
            q = self.score(states, vecs, selected, counts_t[rows], positions=pos)
            q = q.masked_fill(selected | ~valid[rows], float("-inf"))
            k = min(width, max(width_beam, cfg.alternatives + 1))
            top_q, top_i = q.topk(k, dim=1)
            top_q, top_i = top_q.cpu().numpy(), top_i.cpu().numpy()
            pos_np = None if pos is None else pos.gather(1, torch.from_numpy(top_i).to(dev)).cpu().numpy()
            beams = self._advance(beams, live, top_q, top_i, pos_np, cfg, width_beam)
        results = []
        seconds = (time.perf_counter() - t0) / len(samples)
        for i, sample in enumerate(samples):
            best = best_path([b for b in beams if b.sample == i])
            stopped = best.finished and len(best.steps) < min(cfg.max_steps, sample.n_chunks)
            results.append(Retrieval(sample.id, best.steps, stopped_early=stopped, seconds=seconds))
        return results

    def _state_ids(self, sample: TokenizedSample, beam: _Beam) -> np.ndarray:
        return self.layout.state(sample.question, [sample.chunks[i] for i in sorted(beam.chosen)])

    @staticmethod
    def _advance(beams, live, top_q, top_i, pos_np, cfg: SearchConfig, width: int) -> list[_Beam]:
        """Expand live beams by their best actions; keep the ``width`` best per sample."""
        rule = beam_rule(cfg.beam_score)
        candidates: dict[int, list[_Beam]] = {}
        for b in beams:
            if b.finished:
                candidates.setdefault(b.sample, []).append(b)
        for row, b in enumerate(live):
            finite = np.isfinite(top_q[row])
            if not finite.any():  # no chunk left
                candidates.setdefault(b.sample, []).append(_Beam(b.sample, b.steps, b.score, True))
                continue
            if cfg.stop_threshold is not None and top_q[row][0] < cfg.stop_threshold:
                candidates.setdefault(b.sample, []).append(_Beam(b.sample, b.steps, b.score, True))
                continue
            for j in range(min(width, int(finite.sum()))):
                q = float(top_q[row][j])
                if cfg.stop_threshold is not None and q < cfg.stop_threshold:
                    break
                alts = [(int(top_i[row][a]), float(top_q[row][a])) for a in range(len(top_i[row])) if a != j and np.isfinite(top_q[row][a])]
                step = Step(int(top_i[row][j]), q, None if pos_np is None else float(pos_np[row][j]), alts[: cfg.alternatives])
                candidates.setdefault(b.sample, []).append(_Beam(b.sample, [*b.steps, step], rule(b.score, q)))
        kept: list[_Beam] = []
        for sample in sorted(candidates):
            seen: set[frozenset[int]] = set()
            for cand in sorted(candidates[sample], key=_rank):  # stable: equal keys keep the parents' order
                if cand.chosen in seen:
                    continue
                seen.add(cand.chosen)
                kept.append(cand)
                if sum(1 for k in kept if k.sample == sample) >= width:
                    break
        return kept
