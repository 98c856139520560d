"""The one scoring rule of every search backend: Q of every chunk for a batch of state rows.

Its own module (not qrag.retrieval.search) because the shard index and the search driver both need it,
and the driver imports the shard hits: keeping the rule here keeps the imports one-way."""

from __future__ import annotations

import torch

from qrag.model.positions import rope_frequencies


@torch.no_grad()
def score_chunks(
    states: torch.Tensor, chunk_vecs: torch.Tensor, pos: torch.Tensor | None, rope_base: float, block: int | None = None
) -> torch.Tensor:
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
    # Pairs (2k, 2k+1) of each twin half, as in qrag.model.positions.rotate: u, w of the state and
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
