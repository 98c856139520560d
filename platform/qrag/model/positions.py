"""Chunk positions in Q(s, a): RoPE rotation of action vectors, absolute and relative indices.

The rotation acts on each twin half of the embedding separately (pairs (2k, 2k+1) inside a half),
so the two critics Q1 = <s[:d/2], a[:d/2]> and Q2 = <s[d/2:], a[d/2:]> stay independent.
Positions are float tensors end to end: relative positions are fractional and must stay so.
"""

from __future__ import annotations

import torch

MODES = ("none", "absolute", "relative")


def rope_frequencies(dim: int, base: float, device=None) -> torch.Tensor:
    """Angular frequency of each rotated pair within one half of a ``dim``-wide vector."""
    half = dim // 2
    if half % 2:
        raise ValueError(f"embedding width {dim} must be divisible by 4 for twin halves with RoPE")
    k = torch.arange(half // 2, device=device, dtype=torch.float64)
    return (base ** (-2.0 * k / half)).to(torch.float32)


def rotate(vectors: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate ``vectors`` [..., d] by ``positions`` [...] (float)."""
    d = vectors.shape[-1]
    freqs = rope_frequencies(d, base, vectors.device)
    angles = positions.to(torch.float32).unsqueeze(-1) * freqs  # [..., d/4]
    cos, sin = angles.cos(), angles.sin()
    v = vectors.float().reshape(*vectors.shape[:-1], 2, d // 4, 2)  # [..., half, pair, 2]
    x, y = v[..., 0], v[..., 1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over the two halves
    out = torch.stack((x * cos - y * sin, x * sin + y * cos), dim=-1)
    return out.reshape(vectors.shape).to(vectors.dtype)


def relative_positions(selected: torch.Tensor, n_chunks: torch.Tensor, delta: float, ell: float) -> torch.Tensor:
    """ρ_t(i) = jδ + ℓ(i − b_j)/(b_{j+1} − b_j) for every chunk i (paper eq. 7), 0-based.

    ``selected`` [B, N] bool marks chunks already in the state; ``n_chunks`` [B] is m.
    Boundaries: b_0 = 0, b_j = the j-th selected index, b_{k+1} = m; chunk i lies in the
    interval j with b_j <= i < b_{j+1}. Returns float32 [B, N] (padding rows get junk-free values).
    """
    b, n = selected.shape
    idx = torch.arange(n, device=selected.device).expand(b, n)
    sel = selected.long()
    j = sel.cumsum(1)  # number of selected indices <= i
    # b_j: the last selected index <= i (0 when none is).
    prev = torch.where(selected, idx, torch.zeros_like(idx)).cummax(1).values
    # b_{j+1}: the first selected index > i (m when none is).
    m = n_chunks.to(idx.dtype).unsqueeze(1).expand(b, n)
    nxt_incl = torch.where(selected, idx, m).flip(1).cummin(1).values.flip(1)  # first selected >= i
    nxt = torch.cat([nxt_incl[:, 1:], m[:, :1]], dim=1)  # first selected >= i+1
    nxt = torch.minimum(nxt, m)
    width = (nxt - prev).clamp(min=1).to(torch.float32)
    return j.to(torch.float32) * delta + ell * (idx - prev).to(torch.float32) / width


def chunk_positions(
    mode: str, selected: torch.Tensor, n_chunks: torch.Tensor, delta: float, ell: float
) -> torch.Tensor | None:
    """Positions of every chunk for the current selection, or None when positions are off."""
    if mode == "none":
        return None
    if mode == "absolute":
        n = selected.shape[1]
        return torch.arange(n, device=selected.device, dtype=torch.float32).expand(selected.shape[0], n)
    if mode == "relative":
        return relative_positions(selected, n_chunks, delta, ell)
    raise ValueError(f"unknown positions mode {mode!r} (choose from {', '.join(MODES)})")


def positions_at(
    mode: str, gpos: torch.Tensor, selected: torch.Tensor, n_total: int, delta: float, ell: float
) -> torch.Tensor | None:
    """Positions of the chunks at global indices ``gpos`` [n] for each row of ``selected``
    [B, k] (sorted global indices; pad with ``n_total``), as :func:`qrag.model.positions.chunk_positions`
    computes them over the whole context — the same float32 arithmetic, for a subset of columns."""
    b = selected.shape[0]
    if mode == "none":
        return None
    if mode == "absolute":
        return gpos.to(torch.float32).expand(b, -1)
    if mode != "relative":
        raise ValueError(f"unknown positions mode {mode!r}")
    m = torch.full((b, 1), n_total, dtype=torch.long, device=gpos.device)
    bounds = torch.cat([selected.to(torch.long), m], dim=1)  # b_1..b_k, then m
    idx = gpos.expand(b, -1).contiguous()
    j = torch.searchsorted(bounds, idx, right=True)  # selected indices <= i
    prev = torch.where(j > 0, bounds.gather(1, (j - 1).clamp(min=0)), torch.zeros_like(idx))
    nxt = torch.minimum(bounds.gather(1, j), m)
    width = (nxt - prev).clamp(min=1).to(torch.float32)
    return j.to(torch.float32) * delta + ell * (idx - prev).to(torch.float32) / width
