"""Approximate candidates for shards beyond a brute-force budget, re-scored exactly.

An inner-product FAISS index (IVF-PQ or IVF-Flat; on the shard's GPU when FAISS has GPUs) holds
a shard's chunk vectors as stored, unrotated. With RoPE positions, Q = <s, R(p) a> / 2 =
<R(-p) s, a> / 2 because a rotation's transpose is its inverse: for a fixed position p, the best
chunks are a plain inner-product search with the state rotated back by p. A state's chunks lie in
the segments between its selected chunks, segment j at relative positions [jδ, jδ + ℓ], so the
candidate stage searches with the state rotated back to ``probes`` positions spread over every
segment and keeps the union of the answers. The candidates are then scored exactly at their true
positions (:func:`qrag.model.positions.positions_at` and :func:`qrag.retrieval.scoring.score_chunks`,
the exact path's arithmetic) and each state keeps its best ``k``. Positions off: one probe, the
state itself. Absolute positions rotate by the chunk index, so no small set of probes covers them:
those shards stay exact.

What is approximate is only which chunks reach the exact re-scoring: the values and positions
returned are exact for the chunks returned. ``bench/ann_gpu.py`` measures the recall of the exact
top-k.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qrag.config import ModelConfig
from qrag.index.faiss_files import save_index
from qrag.index.shard_faiss import ShardFaiss
from qrag.model.positions import positions_at, rotate
from qrag.retrieval.scoring import score_chunks

KINDS = ("ivf_pq", "ivf_flat", "flat")


@dataclass
class AnnSettings:
    """The candidate stage of one shard."""

    kind: str = "ivf_pq"  # ivf_pq | ivf_flat | flat (exact inner products: tests and small shards)
    nlist: int = 0  # inverted lists; 0: about 4 sqrt(rows)
    nprobe: int = 32  # lists searched per probe
    pq_bytes: int = 0  # IVF-PQ code bytes per vector; 0: dim / 8
    probes: int = 2  # positions per segment the state is rotated back to (relative positions)
    candidates: int = 256  # chunks kept per probe (at least k plus the selected count)
    train_rows: int = 262_144  # vectors the coarse quantiser and PQ are trained on (a sample)
    gpu: bool = True  # on the shard's GPU when FAISS was built with GPUs


def probe_positions(n_selected: int, model: ModelConfig, probes: int) -> np.ndarray:
    """The positions one state is searched at: ``probes`` cell centres in each of the
    ``n_selected + 1`` segments of relative positions (segment j: [jδ, jδ + ℓ]); [0.0] when
    positions are off."""
    if model.positions == "none":
        return np.zeros(1, np.float32)
    if model.positions != "relative":
        raise ValueError(f"no candidate stage for positions {model.positions!r} (only none or relative)")
    cells = (np.arange(probes, dtype=np.float32) + 0.5) / probes * model.relative_ell
    return (np.arange(n_selected + 1, dtype=np.float32)[:, None] * model.relative_delta + cells).reshape(-1)


def probe_queries(
    states: torch.Tensor, selected_counts: list[int], model: ModelConfig, probes: int
) -> tuple[torch.Tensor, list[int]]:
    """Every state rotated back to each of its probe positions: [sum of probes, d] float32, and how
    many rows belong to each state (in order)."""
    positions = [probe_positions(n_sel, model, probes) for n_sel in selected_counts]
    counts = [len(p) for p in positions]
    rows = states.float().repeat_interleave(torch.tensor(counts, device=states.device), dim=0, output_size=sum(counts))
    if model.positions == "none":
        return rows, counts
    pos = torch.from_numpy(np.concatenate(positions)).to(states.device)  # one copy for every state's probes
    return rotate(rows, -pos, model.rope_base), counts


_GPU_RESOURCES: dict[int, Any] = {}
_GPU_LOCK = threading.Lock()


def gpu_resources(faiss: Any, device: int) -> Any:
    """One StandardGpuResources per GPU per process (each holds a temporary-memory pool)."""
    with _GPU_LOCK:
        if device not in _GPU_RESOURCES:
            _GPU_RESOURCES[device] = faiss.StandardGpuResources()
        return _GPU_RESOURCES[device]


def faiss_has_gpus(faiss: Any) -> bool:
    return hasattr(faiss, "StandardGpuResources") and getattr(faiss, "get_num_gpus", lambda: 0)() > 0


def on_device(faiss: Any, index: Any, settings: AnnSettings, device: torch.device) -> Any:
    """``index`` moved to ``device``'s GPU when FAISS has GPUs and ``settings.gpu`` (else as it is)."""
    if not (settings.gpu and device.type == "cuda" and faiss_has_gpus(faiss)):
        return index
    options = faiss.GpuClonerOptions()
    options.useFloat16 = True  # IVF-PQ: float16 lookup tables (48-byte codes exceed shared memory in float32)
    return faiss.index_cpu_to_gpu(gpu_resources(faiss, device.index or 0), device.index or 0, index, options)


def build_index(faiss: Any, vectors: np.ndarray, settings: AnnSettings, device: torch.device) -> Any:
    """An empty inner-product index for ``vectors`` [n, d] float32, trained on (a sample of) them."""
    n, d = vectors.shape
    if settings.kind not in KINDS:
        raise ValueError(f"unknown candidate index kind {settings.kind!r} (choose from {', '.join(KINDS)})")
    if settings.kind == "flat":
        spec = "Flat"
    else:
        nlist = settings.nlist or int(4 * np.sqrt(n))
        nlist = max(1, min(nlist, n // 39))  # k-means wants ~39 points per centroid
        code = settings.pq_bytes or d // 8
        spec = f"IVF{nlist},PQ{code}" if settings.kind == "ivf_pq" else f"IVF{nlist},Flat"
    index = on_device(faiss, faiss.index_factory(d, spec, faiss.METRIC_INNER_PRODUCT), settings, device)
    if not index.is_trained:
        rng = np.random.default_rng(0)
        sample = vectors if n <= settings.train_rows else vectors[np.sort(rng.choice(n, settings.train_rows, False))]
        index.train(np.ascontiguousarray(sample, dtype=np.float32))
    return index


class ShardAnn(ShardFaiss):
    """The candidate index of one shard's first ``rows`` vectors: loaded from ``folder`` at start
    when a saved one matches (:mod:`qrag.index.faiss_files`, files ``ann_NNN``), else built at the
    first query above the budget (or at warm-up), trained on its first rows; appended rows are
    added (IVF lists take them without retraining). Locking and saving (off the request path, on
    the saver thread) are :class:`~qrag.index.shard_faiss.ShardFaiss`'s."""

    FILE_NAME = "ann"

    def __init__(
        self,
        faiss: Any,
        settings: AnnSettings,
        device: torch.device,
        *,
        shard: int = 0,
        folder: Path | None = None,
        uid: str = "",
    ):
        # dim, hnsw_m and ef_search shape HNSW and flat indexes only (_new_index is this class's own)
        super().__init__(faiss, 0, shard, hnsw_m=0, ef_search=0, folder=folder, uid=uid)
        self.settings, self.device = settings, device

    def _new_index(self, vectors: np.ndarray, approximate: bool) -> Any:
        return self._ready(build_index(self.faiss, vectors, self.settings, self.device))

    def _loaded(self, index: Any) -> Any:
        return self._ready(on_device(self.faiss, index, self.settings, self.device))

    def _ready(self, index: Any) -> Any:
        if hasattr(index, "nprobe"):
            index.nprobe = self.settings.nprobe
        return index

    def _saved_kind(self) -> bool:
        return True

    def _build_key(self) -> str:
        s = self.settings
        return f"{s.kind}/nlist={s.nlist}/pq={s.pq_bytes}"

    def _serialisable(self, index: Any) -> Any:
        return self.faiss.index_gpu_to_cpu(index) if "Gpu" in type(index).__name__ else index

    def _write(self, data: bytes, rows: int, batches: list[tuple[int, str]]) -> bool:
        return save_index(data, rows, self.folder, self.shard, self.uid, batches, self._build_key(), self.FILE_NAME)

    def search(self, queries: np.ndarray, k: int, n: int) -> np.ndarray | None:
        """Rows of the best ``k`` per query (-1 pads); None when the index holds fewer than ``n``."""
        found = super().search(queries, min(k, self.rows), n)
        return None if found is None else found[1]


def candidate_rows(found: np.ndarray, counts: list[int], n: int) -> np.ndarray:
    """Each state's probes' answers as one row [B, width] of local rows below ``n``, duplicates
    and pads as -1."""
    width = max(c for c in counts) * found.shape[1]
    out = np.full((len(counts), width), -1, np.int64)
    start = 0
    for r, c in enumerate(counts):
        rows = found[start : start + c].reshape(-1)
        rows = np.unique(rows[(rows >= 0) & (rows < n)])
        out[r, : len(rows)] = rows
        start += c
    return out


@torch.no_grad()
def rescore(
    states: torch.Tensor,
    vectors: torch.Tensor,
    local: torch.Tensor,
    sel: torch.Tensor,
    shard: int,
    n_shards: int,
    n_total: int,
    model: ModelConfig,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Exact Q of each state's candidate rows ``local`` [B, C] (-1: none) of a shard whose vectors
    are ``vectors``: its best ``min(k, C)`` values, local rows and positions (None: positions off),
    the selected chunks (``sel``, :func:`qrag.index.shards.selected_matrix`) and pads at -inf."""
    valid = local >= 0
    rows = local.clamp(min=0)
    gpos = shard + n_shards * rows
    pos = positions_at(model.positions, gpos, sel, n_total, model.relative_delta, model.relative_ell)
    q = score_chunks(states, vectors[rows], pos, model.rope_base)
    banned = (gpos[:, :, None] == sel[:, None, :]).any(-1) | ~valid
    q = q.masked_fill(banned, float("-inf"))
    top_q, top_c = q.topk(min(k, q.shape[1]), dim=1)
    top_rows = torch.where(torch.isfinite(top_q), rows.gather(1, top_c), torch.full_like(top_c, -1))
    return top_q, top_rows, None if pos is None else pos.gather(1, top_c)
