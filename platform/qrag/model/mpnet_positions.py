"""MPNet's relative-position bias, built on the device of the hidden states.

transformers' MPNet (5.17, for one) builds the bias's position buckets with ``torch.arange`` on
the CPU and copies them to the GPU on every forward. CUDA-graph capture refuses that copy, so every
state-encoder shape of an MPNet fell back to eager calls (``GraphedEncoder.fallbacks``). Later
versions (5.24) build them on the device; this gives every version that behaviour, with the same
values.
"""

from __future__ import annotations

import types

import torch
from torch import nn


def device_position_bias(self, x: torch.Tensor, position_ids: torch.Tensor | None = None, num_buckets: int = 32):
    """``MPNetEncoder.compute_position_bias`` without position ids (how MPNet's forward calls it),
    its buckets made where ``x`` is: [B, heads, L, L]."""
    if position_ids is not None:  # not a path MPNet's own forward takes: keep the library's
        return type(self).compute_position_bias(self, x, position_ids, num_buckets)
    batch, length = x.size(0), x.size(1)
    positions = torch.arange(length, dtype=torch.long, device=x.device)
    relative = positions[None, :] - positions[:, None]  # memory position minus context position
    buckets = self.relative_position_bucket(relative, num_buckets=num_buckets)
    values = self.relative_attention_bias(buckets).permute([2, 0, 1]).unsqueeze(0)
    return values.expand((batch, -1, length, length)).contiguous()


def build_position_bias_on_device(model: nn.Module) -> bool:
    """Give an MPNet model's encoder the device-side bias (an instance method: other models of the
    class are untouched, and a deepcopy, as for the target networks, keeps it). True where it did."""
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    encoder = getattr(model, "encoder", None)
    if not isinstance(encoder, MPNetEncoder):
        return False
    encoder.compute_position_bias = types.MethodType(device_position_bias, encoder)
    return True
