"""Padding-free encoder passes for BERT-family encoders (MiniLM, contriever, bge, e5).

A padded batch spends its linear layers, layer norms and activations on padding, and its padding
mask keeps PyTorch's attention off the flash kernels (onto the slower memory-efficient ones). A
packed pass lays every sequence of a batch end to end, [total tokens, d], runs the encoder's own
linear, layer-norm and dropout modules on real tokens only, and runs attention per sequence
through variable-length flash attention (``cu_seqlens``: where each sequence starts). The result
is the same function of each sequence as the padded forward (tests compare the two), at the cost
of the real tokens alone.

Only the attention and the embedding's positions are ours; everything else is the Hugging Face
module's, so the weights, the dropout settings and autocast's precision choices are the model's.
Architectures with other attention (MPNet's relative position bias) or other layer structure are
refused by :func:`packing_unsupported` and take the padded path.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from qrag.model.encoder import EncodeStats, autocast_for, flat_sequences, to_device


@dataclass
class Packing:
    """One packed batch: token ids end to end, and where each sequence lies in them."""

    ids: torch.Tensor  # [N] token ids
    positions: torch.Tensor  # [N] each token's position within its sequence
    segments: torch.Tensor  # [N] each token's sequence
    cu_seqlens: torch.Tensor  # [B + 1] int32 offsets of the sequences
    lengths: torch.Tensor  # [B] float lengths (the mean pool's divisor)
    max_len: int
    count: int  # B

    @classmethod
    def of(cls, flat_ids: np.ndarray, lengths: np.ndarray, device: torch.device) -> Packing:
        """``flat_ids``: the sequences' ids one after another; ``lengths``: each one's length."""
        lengths = np.asarray(lengths, dtype=np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        segments = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
        positions = np.arange(int(offsets[-1]), dtype=np.int64) - offsets[:-1][segments]
        # Two copies to the device per batch (the learner's host is its bound), the rest derived there.
        ids, positions_t, segments_t = to_device(
            np.stack([np.asarray(flat_ids, np.int64), positions, segments]), device
        )
        offsets_t = to_device(offsets, device)
        return cls(
            ids=ids,
            positions=positions_t,
            segments=segments_t,
            cu_seqlens=offsets_t.to(torch.int32),
            lengths=offsets_t.diff().to(torch.float32),
            max_len=int(lengths.max()) if len(lengths) else 0,
            count=len(lengths),
        )


def packing_unsupported(model: nn.Module) -> str | None:
    """Why ``model`` cannot run packed (None: it can). Packing needs a BERT-style encoder whose
    layers are exactly embeddings -> (self-attention, output, feed-forward) with absolute positions."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) != "bert":
        return f"not a BERT-family encoder ({getattr(config, 'model_type', type(model).__name__)})"
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return "a decoder or cross-attention BERT"
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        return f"position_embedding_type {config.position_embedding_type!r}"
    if getattr(config, "chunk_size_feed_forward", 0):
        return "chunked feed-forward"
    embeddings, encoder = getattr(model, "embeddings", None), getattr(model, "encoder", None)
    if embeddings is None or encoder is None or not hasattr(encoder, "layer"):
        return "no embeddings/encoder.layer modules"
    needed = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output")
    for path in (*needed, "intermediate", "output"):
        try:
            for layer in encoder.layer:
                attrgetter(path)(layer)
        except AttributeError:
            return f"a layer without {path}"
    return None


def encode_packed(
    model: nn.Module,
    seqs: Sequence[np.ndarray],
    *,
    device: torch.device,
    max_tokens: int = 32768,
    grad: bool = False,
    stats: EncodeStats | None = None,
    kind: str = "encode",
    autocast: bool = True,
) -> torch.Tensor:
    """Mean-pooled embeddings of token sequences, in input order: [len(seqs), d] float32, as
    :func:`qrag.model.encoder.encode` computes them, without padding. Sequences are packed in
    input order into batches of at most ``max_tokens`` tokens (a longer sequence alone).
    ``autocast=False`` runs the model in its own dtype (a bf16 copy in bf16 throughout)."""
    if len(seqs) == 0:
        return torch.zeros(0, model.config.hidden_size, device=device)
    lengths, offsets, flat = flat_sequences(seqs)
    stats = stats if stats is not None else EncodeStats()
    pieces = []
    grad_ctx = nullcontext() if grad else torch.no_grad()
    with stats.timing(device, kind), grad_ctx, autocast_for(device) if autocast else nullcontext():
        for start, end in pack_bounds(lengths, max_tokens):
            packing = Packing.of(flat[offsets[start] : offsets[end]], lengths[start:end], device)
            pieces.append(packed_mean_pool(packed_hidden(model, packing), packing))
    stats.padded_tokens += int(lengths.sum())
    stats.count(lengths)
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def pack_bounds(lengths: np.ndarray, max_tokens: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) runs of sequences holding at most ``max_tokens`` tokens each (a
    longer sequence alone). One search per batch, not a Python step per sequence."""
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    bounds, start = [], 0
    while start < len(ends):
        before = ends[start - 1] if start else 0
        end = max(start + 1, int(np.searchsorted(ends, before + max_tokens, side="right")))
        bounds.append((start, end))
        start = end
    return bounds


def packed_hidden(model: nn.Module, packing: Packing) -> torch.Tensor:
    """The last hidden state of every real token, [N, d]: the model's forward without padding."""
    emb = model.embeddings
    # The padded forward's order of additions (word + token type, then + position): equal results.
    x = emb.word_embeddings(packing.ids) + emb.token_type_embeddings.weight[0]
    x = emb.dropout(emb.LayerNorm(x + emb.position_embeddings(packing.positions)))
    for layer in model.encoder.layer:
        attn = layer.attention.self
        heads, size = attn.num_attention_heads, attn.attention_head_size
        q, k, v = (proj(x).view(-1, heads, size) for proj in (attn.query, attn.key, attn.value))
        dropout = attn.dropout.p if attn.training else 0.0
        context = varlen_attention(q, k, v, packing, dropout, attn.scaling).reshape(-1, heads * size)
        x = layer.attention.output(context, x)
        x = layer.output(layer.intermediate(x), x)
    return x


def packed_mean_pool(hidden: torch.Tensor, packing: Packing) -> torch.Tensor:
    """Each sequence's mean token vector, [B, d] float32."""
    sums = hidden.new_zeros(packing.count, hidden.shape[1], dtype=torch.float32)
    sums.index_add_(0, packing.segments, hidden.float())
    return sums / packing.lengths.clamp(min=1.0).unsqueeze(1)


def flash_varlen_available(q: torch.Tensor) -> bool:
    """Variable-length flash attention: a CUDA device, half precision, head size a multiple of 8."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing, dropout: float, scale: float
) -> torch.Tensor:
    """Attention within each packed sequence: q, k, v [N, heads, head size] -> [N, heads, head size].
    Flash's variable-length kernel (dropout and backward included) where it runs; elsewhere the
    sequences are padded into one batch for scaled-dot-product attention, which computes the same."""
    if flash_varlen_available(q):
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, packing.cu_seqlens, packing.cu_seqlens, packing.max_len, packing.max_len,
            dropout, False, False, scale=scale,
        )  # fmt: skip
        return out[0]
    return _padded_attention(q, k, v, packing, dropout, scale)


def _padded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing, dropout: float, scale: float
) -> torch.Tensor:
    where = (packing.segments, packing.positions)
    shape = (packing.count, packing.max_len, q.shape[1], q.shape[2])

    def padded(t: torch.Tensor) -> torch.Tensor:
        return t.new_zeros(shape).index_put(where, t).transpose(1, 2)  # [B, heads, L, size]

    mask = torch.arange(packing.max_len, device=q.device)[None, :] < packing.lengths[:, None]
    out = F.scaled_dot_product_attention(
        padded(q), padded(k), padded(v), attn_mask=mask[:, None, None, :], dropout_p=dropout, scale=scale
    )
    return out.transpose(1, 2)[where]
