"""The Q-network: Q(s, a^i) = <E_s(s), R(pos_i) E_a(a^i)> with twin halves, plus EMA targets."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from qrag.config import ModelConfig
from qrag.model.positions import chunk_positions, rotate

SIMILARITIES = ("twin", "cosine")


class QNetwork(nn.Module):
    """Online state/action encoders and (optionally) their EMA targets.

    ``E_s`` and ``E_a`` start as two copies of one pretrained encoder and are trained separately.
    """

    def __init__(self, state_encoder: nn.Module, action_encoder: nn.Module, cfg: ModelConfig, use_target: bool = True):
        super().__init__()
        self.cfg = cfg
        self.state_encoder = state_encoder
        self.action_encoder = action_encoder
        self.use_target = use_target
        if use_target:
            self.target_state_encoder = copy.deepcopy(state_encoder).requires_grad_(False)
            self.target_action_encoder = copy.deepcopy(action_encoder).requires_grad_(False)
        if self.dim % 4:
            raise ValueError(f"embedding width {self.dim} must be divisible by 4 (twin halves of rotated pairs)")
        if cfg.similarity not in SIMILARITIES:
            raise ValueError(f"model.similarity must be one of {', '.join(SIMILARITIES)}, got {cfg.similarity!r}")
        if cfg.freeze_embeddings:
            for encoder in (state_encoder, action_encoder):
                encoder.get_input_embeddings().requires_grad_(False)

    def train(self, mode: bool = True) -> QNetwork:
        """Targets always run in eval mode: bootstrapped values must not carry dropout noise."""
        super().train(mode)
        if self.use_target:
            self.target_state_encoder.eval()
            self.target_action_encoder.eval()
        return self

    @classmethod
    def from_pretrained(cls, encoder: nn.Module, cfg: ModelConfig, use_target: bool = True) -> QNetwork:
        return cls(encoder, copy.deepcopy(encoder), cfg, use_target)

    @property
    def dim(self) -> int:
        return int(self.state_encoder.config.hidden_size)

    def online_parameters(self) -> list[nn.Parameter]:
        """The trained parameters (frozen embedding tables excluded)."""
        return [p for p in (*self.state_encoder.parameters(), *self.action_encoder.parameters()) if p.requires_grad]

    def target_encoders(self) -> tuple[nn.Module, nn.Module]:
        """Encoders that bootstrap V; the online ones when targets are ablated."""
        if self.use_target:
            return self.target_state_encoder, self.target_action_encoder
        return self.state_encoder, self.action_encoder

    @torch.no_grad()
    def update_targets(self, tau: float) -> None:
        if not self.use_target:
            return
        pairs = [(self.target_state_encoder, self.state_encoder), (self.target_action_encoder, self.action_encoder)]
        for target, online in pairs:
            # Frozen parameters (e.g. token embeddings) never move, so their targets already equal
            # them: skipping them saves the largest tensors' memory traffic on every update.
            moving = [(t, o.detach()) for t, o in zip(target.parameters(), online.parameters()) if o.requires_grad]
            if moving:
                t_params, o_params = map(list, zip(*moving))
                torch._foreach_lerp_(t_params, o_params, tau)

    def finish(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled encoder output -> the vector Q uses.

        'twin': each twin half unit-length, so Q (the mean of the twin dot products) is the mean
        of two half-vector cosines. 'cosine': the whole vector scaled to length √2, so the same
        mean of twin dot products, ⟨s, a⟩ / 2, is the full-vector cosine of the pooled embeddings.
        """
        if not self.cfg.normalize:
            return pooled
        if self.cfg.similarity == "cosine":
            return torch.nn.functional.normalize(pooled.float(), dim=-1) * math.sqrt(2.0)
        h = pooled.shape[-1] // 2
        halves = pooled.float().reshape(*pooled.shape[:-1], 2, h)
        return torch.nn.functional.normalize(halves, dim=-1).reshape(pooled.shape)

    def positions(self, selected: torch.Tensor, n_chunks: torch.Tensor) -> torch.Tensor | None:
        c = self.cfg
        return chunk_positions(c.positions, selected, n_chunks, c.relative_delta, c.relative_ell)

    def place(self, chunk_vectors: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Apply the position rotation to chunk vectors (identity when positions are off)."""
        if positions is None:
            return chunk_vectors
        return rotate(chunk_vectors, positions, self.cfg.rope_base)

    @staticmethod
    def twin_scores(state: torch.Tensor, placed_chunks: torch.Tensor) -> torch.Tensor:
        """[B, d] x [B, N, d] -> [B, N, 2]: Q1 and Q2 from the two halves."""
        h = state.shape[-1] // 2
        q1 = torch.einsum("bd,bnd->bn", state[:, :h], placed_chunks[..., :h])
        q2 = torch.einsum("bd,bnd->bn", state[:, h:], placed_chunks[..., h:])
        return torch.stack((q1, q2), dim=-1)

    @staticmethod
    def pair_scores(state: torch.Tensor, placed_chunk: torch.Tensor) -> torch.Tensor:
        """[K, d] x [K, d] -> [K, 2]: Q1, Q2 of one (state, action) pair per row."""
        h = state.shape[-1] // 2
        prod = state * placed_chunk
        return torch.stack((prod[:, :h].sum(-1), prod[:, h:].sum(-1)), dim=-1)
