"""Scoring one shard of a corpus: exact (rotated) inner products, FAISS candidates for large
unrotated host shards, approximate candidates re-scored exactly for shards beyond a brute-force
budget (:mod:`qrag.index.ann`), the merge of shard top-k lists, and a corpus's shards held together
(:func:`score_shards`: all torch shards of one device scored with one device-to-host copy)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qrag.config import ModelConfig
from qrag.model.positions import positions_at, rope_frequencies
from qrag.retrieval.hits import ChunkRecord, ShardHits, merge_hits
from qrag.retrieval.scoring import score_chunks
from qrag.index.ann import AnnSettings, ShardAnn, candidate_rows, probe_queries, rescore
from qrag.index.shard_faiss import ShardFaiss
from qrag.index.score_graphs import pack, score_graphs_for, unpack
from qrag.index.store import (
    CorpusNotFound,
    CorpusStore,
    Segment,
    SegmentProblem,
    StoreError,
    shard_rows,
)


def relative_scores(
    states: torch.Tensor,
    vectors: torch.Tensor,
    gpos: torch.Tensor,
    sel: torch.Tensor,
    n_total: int,
    delta: float,
    ell: float,
    freqs: torch.Tensor,
) -> torch.Tensor:
    """Q of every chunk of a shard for each state row, chunks rotated to their relative positions,
    selected chunks at -inf: :func:`positions_at` + :func:`qrag.retrieval.scoring.score_chunks` + the
    exclusion, written as one expression so that ``torch.compile`` fuses it into a few kernels
    that never materialise the [rows, chunks, d/4] temporaries (GPU only; see ``_fused``)."""
    pos = positions_at("relative", gpos, sel, n_total, delta, ell)
    rows, d = states.shape
    q4 = d // 4
    st = states.reshape(rows, 1, 2, q4, 2)
    v = vectors.reshape(1, -1, 2, q4, 2)
    u, w, x, y = st[..., 0], st[..., 1], v[..., 0], v[..., 1]
    along = (u * x).sum(-2) + (w * y).sum(-2)
    across = (w * x).sum(-2) - (u * y).sum(-2)
    angles = pos.unsqueeze(-1) * freqs
    q = 0.5 * (angles.cos() * along + angles.sin() * across).sum(-1)
    banned = (gpos[None, :, None] == sel[:, None, :]).any(-1)
    return q.masked_fill(banned, float("-inf"))


_FUSED: dict[str, Any] = {}
# Compiled variants of relative_scores a process may keep. Each device is a guard of its own (and
# one row or one selected chunk are specialised apart from many): with shards on 2 GPUs, the
# default 8 ran out at 100M tokens ("recompile_limit ... Expected device index"), and dynamo runs
# every variant past the limit eagerly, a silent slowdown.
FUSED_VARIANTS = 64


def _fused():
    """``relative_scores`` compiled once per process (None where compiling failed: eager blocks)."""
    if "fn" not in _FUSED:
        try:
            import torch._dynamo.config as dynamo_config

            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, FUSED_VARIANTS)
            _FUSED["fn"] = torch.compile(relative_scores, dynamic=True)
        except Exception as exc:  # noqa: BLE001 - no compiler here: the blocked eager path serves
            _FUSED["fn"], _FUSED["error"] = None, f"{type(exc).__name__}: {exc}"
    return _FUSED["fn"]


@dataclass
class ShardOptions:
    """How a shard scores: exact torch (always with RoPE positions) or FAISS (positions off)."""

    faiss: str = "auto"  # auto: FAISS on CPU shards when positions are off | always | never
    approx_above: int = 2_000_000  # chunks per shard above which FAISS uses HNSW instead of flat IP
    hnsw_m: int = 32
    hnsw_ef_search: int = 128
    score_block: int = 1 << 18  # (state row x chunk) pairs rotated at once: bounds temporary memory
    fused: bool = True  # GPU + relative positions: score with the compiled relative_scores (no temporaries)
    graphs: bool = True  # GPU + batched: replay each scoring step of a device's shards from a CUDA graph
    # Score every torch shard of a device in one pass with one device-to-host copy per step
    # (score_shards); False: each shard on its own, several host syncs each (the previous path).
    batched: bool = True
    # Beyond ann_above chunks a shard (models without positions or with relative ones) takes its
    # candidates from an approximate index and scores them exactly (qrag.index.ann): auto | always | never.
    ann: str = "auto"
    ann_above: int = 4_000_000
    ann_settings: AnnSettings = field(default_factory=AnnSettings)


def selected_matrix(selected: Sequence[Sequence[int]], n_total: int) -> np.ndarray:
    """Each state row's selected set [B, width >= 1], sorted and padded with ``n_total``: what
    :func:`positions_at` and the exclusion of chosen chunks read on the device."""
    sel = np.full((len(selected), max(1, max((len(s) for s in selected), default=0))), n_total, dtype=np.int64)
    for r, s in enumerate(selected):
        sel[r, : len(s)] = sorted(s)
    return sel


def states_on(states: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    return (states if torch.is_tensor(states) else torch.tensor(np.asarray(states))).to(device, torch.float32)


def to_host(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """``tensors`` (any dtypes, one device) as host arrays with one device-to-host copy: their
    bytes packed into one buffer, since each copy of its own would wait for the device."""
    if not tensors:
        return []
    return unpack(pack(tensors).cpu().numpy(), [(t.dtype, tuple(t.shape)) for t in tensors])


def row_bytes(text_chars: int, doc_id_chars: int, n_tokens: int) -> int:
    """Host memory of one row beside its vector: text, document id (up to 4 bytes a character),
    int32 token ids, and the Python objects around them."""
    return text_chars + doc_id_chars + 4 * n_tokens + 250


class ShardIndex:
    """One shard of one corpus in memory.

    Vectors live on ``device`` in float32 and grow by appends (capacity doubles). Scores are
    Q = mean of the twin halves of <s, R(pos) a>, computed exactly in torch in column blocks; with
    positions off and ``faiss`` allowed, an inner-product FAISS index gives the candidates instead.
    """

    def __init__(
        self,
        corpus: str,
        shard: int,
        n_shards: int,
        model: ModelConfig,
        dim: int,
        device: torch.device,
        options: ShardOptions | None = None,
    ):
        self.corpus, self.shard, self.n_shards = corpus, shard, n_shards
        self.model, self.dim, self.device = model, dim, device
        self.options = options or ShardOptions()
        self._buf = torch.zeros(0, dim, device=device)
        self.n = 0
        self.doc_ids: list[str] = []
        self.texts: list[str] = []
        self.tokens: list[np.ndarray] = []
        self.loaded: dict[int, str] = {}  # batch id -> sha256 of the vectors file loaded
        self.faiss: ShardFaiss | None = None  # made at the first FAISS query, or by restore_faiss
        self.ann: ShardAnn | None = None  # made at the first query beyond the brute-force budget
        # Where an approximate FAISS index of this shard is saved and loaded (CorpusShards sets it).
        self.faiss_folder: Path | None = None
        self.uid: str | None = None
        self._freqs: torch.Tensor | None = None  # RoPE frequencies for the fused scorer
        self._lock = threading.Lock()
        self._row_bytes = 0  # texts, token ids and their Python objects: what nbytes adds to the vectors

    @property
    def vectors(self) -> torch.Tensor:
        return self._buf[: self.n]

    @property
    def uses_faiss(self) -> bool:
        o = self.options.faiss
        if self.model.positions != "none" or o == "never":
            return False
        if o == "always":
            return _faiss() is not None
        return self.device.type == "cpu" and _faiss() is not None

    @property
    def uses_ann(self) -> bool:
        """Candidates from an approximate index, re-scored exactly (beyond ``ann_above`` rows, or
        ``ann="always"``); never for absolute positions, nor where the FAISS path above serves."""
        o = self.options
        if o.ann == "never" or self.model.positions not in ("none", "relative") or self.uses_faiss:
            return False
        return _faiss() is not None and (o.ann == "always" or self.n > o.ann_above)

    def nbytes(self) -> int:
        """Memory held: the vector buffer (its capacity) plus the rows' texts and token ids."""
        return int(self._buf.numel()) * 4 + self._row_bytes

    def reserve(self, rows: int) -> None:
        """Grow the buffer once to ``rows`` (loading a corpus knows its size: no doubling slack)."""
        with self._lock:
            if rows > len(self._buf):
                grown = torch.zeros(rows, self.dim, device=self.device)
                grown[: self.n] = self._buf[: self.n]
                self._buf = grown

    def add(self, segment: Segment, vectors_sha256: str | None = None) -> None:
        """Append a batch's rows (``vectors_sha256``: its vectors file's, recorded in :attr:`loaded`
        with the rows, so the FAISS index never covers rows whose batch it cannot name)."""
        n_new = len(segment.positions)
        expected = self.shard + self.n_shards * np.arange(self.n, self.n + n_new)
        if not np.array_equal(segment.positions, expected):
            raise StoreError(f"corpus {self.corpus!r} shard {self.shard}: batch {segment.batch} rows out of order")
        with self._lock:
            need = self.n + n_new
            if need > len(self._buf):
                grown = torch.zeros(max(need, 2 * len(self._buf), 1024), self.dim, device=self.device)
                grown[: self.n] = self._buf[: self.n]
                self._buf = grown
            self._buf[self.n : need] = torch.from_numpy(np.asarray(segment.vectors, dtype=np.float32)).to(self.device)
            self.doc_ids.extend(segment.doc_ids)
            self.texts.extend(segment.texts)
            self.tokens.extend(segment.tokens)
            self._row_bytes += sum(
                row_bytes(len(t), len(d), len(ids)) for t, d, ids in zip(segment.texts, segment.doc_ids, segment.tokens)
            )
            self.n = need
            if vectors_sha256 is not None:
                self.loaded[segment.batch] = vectors_sha256

    def record(self, g: int) -> ChunkRecord:
        r = g // self.n_shards
        return ChunkRecord(self.doc_ids[r], self.texts[r], self.tokens[r])

    def _approximate(self) -> bool:
        return self.n > self.options.approx_above

    def _batches(self) -> list[tuple[int, str]]:
        return list(self.loaded.items())  # in load order: the order of the rows

    @property
    def faiss_loaded_rows(self) -> int:
        """Rows of a saved FAISS index loaded at start (0: none)."""
        return self.faiss.loaded_rows if self.faiss is not None else 0

    def _shard_faiss(self) -> ShardFaiss:
        if self.faiss is not None:  # every FAISS query after the first: no lock
            return self.faiss
        with self._lock:
            if self.faiss is None:
                o = self.options
                self.faiss = ShardFaiss(
                    _faiss(),
                    self.dim,
                    self.shard,
                    hnsw_m=o.hnsw_m,
                    ef_search=o.hnsw_ef_search,
                    folder=self.faiss_folder,
                    uid=self.uid or "",
                )
            return self.faiss

    def restore_faiss(self) -> None:
        """Load the saved approximate index of this shard (what it covers of the loaded rows)."""
        if (
            _faiss() is None
            or self.faiss_folder is None
            or not self.uses_faiss
            or not self._approximate()
            or self.faiss is not None
        ):
            return
        self._shard_faiss().restore(self._batches())

    def _rows_from(self, start: int) -> tuple[np.ndarray, list[tuple[int, str]]]:
        with self._lock:  # rows and the batches they complete, read together
            return self.vectors[start : self.n].cpu().numpy(), self._batches()

    @torch.no_grad()
    def best_chunks(
        self, states: torch.Tensor | np.ndarray, selected: Sequence[Sequence[int]], n_total: int, k: int
    ) -> ShardHits:
        """Each state row's best ``k`` chunks of this shard among the first ``n_total`` global
        positions, the row's ``selected`` (global) chunks excluded."""
        n = self.rows_within(n_total)
        states = states_on(states, self.device)
        rows = len(states)
        with_pos = self.model.positions != "none"
        if n == 0 or k <= 0:
            return ShardHits.empty(rows, with_pos)
        mine = [
            [g // self.n_shards for g in sel if g % self.n_shards == self.shard and g < n_total] for sel in selected
        ]
        if self.uses_faiss:
            q, local = self._faiss_best_chunks(states, mine, n, k)
            pos = None
        elif self.uses_ann:
            q, local, pos = self._ann_best_chunks(states, selected, n, n_total, k)
        else:
            q, local, pos = self._exact_best_chunks(states, selected, mine, n, n_total, k)
        return self.hits(q, local, pos)

    def rows_within(self, n_total: int) -> int:
        """Rows of this shard among the first ``n_total`` global positions (and loaded)."""
        return min(self.n, shard_rows(self.shard, self.n_shards, n_total))

    def hits(self, q: np.ndarray, local: np.ndarray, pos: np.ndarray | None) -> ShardHits:
        """The host half of :meth:`best_chunks`: local rows (-1: none) to global ids, and their records."""
        ids = np.where(local >= 0, self.shard + self.n_shards * local, -1)
        records = {int(g): self.record(int(g)) for g in np.unique(ids[ids >= 0])}
        return ShardHits(q, ids.astype(np.int64), pos, records)

    def _gpos(self, n: int) -> torch.Tensor:
        return self.shard + self.n_shards * torch.arange(n, device=self.device)

    def _selected_rows(
        self, selected: Sequence[Sequence[int]], n: int, n_total: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Global positions of this shard's first ``n`` rows, and each state row's selected set
        [B, width] (sorted, padded with ``n_total``): built on the host, one copy to the device."""
        return self._gpos(n), torch.from_numpy(selected_matrix(selected, n_total)).to(self.device)

    def _wants_fused(self) -> bool:
        return self.model.positions == "relative" and self.device.type == "cuda" and self.options.fused

    def _fused_scores(
        self, states: torch.Tensor, vectors: torch.Tensor, gpos: torch.Tensor, sel: torch.Tensor, n_total: int
    ) -> torch.Tensor | None:
        """Q by the compiled ``relative_scores`` (selected chunks at -inf); None where it cannot compile."""
        fn = _fused()
        if fn is None:
            return None
        c = self.model
        if self._freqs is None:  # constant per shard: not rebuilt on every step of every request
            self._freqs = rope_frequencies(self.dim, c.rope_base, self.device)
        try:
            return fn(states, vectors, gpos, sel, n_total, c.relative_delta, c.relative_ell, self._freqs)
        except Exception as exc:  # noqa: BLE001 - a compile failure on this machine: eager from now on
            _FUSED["fn"], _FUSED["error"] = None, f"{type(exc).__name__}: {exc}"[:300]
            return None

    def _banned(self, sel: torch.Tensor, n: int, n_total: int) -> torch.Tensor:
        """[B, n] True at this shard's rows in each state row's selected set, built on the device
        (indexing with host lists would copy, and wait, once per state row)."""
        local = torch.div(sel, self.n_shards, rounding_mode="floor")
        mine = (sel < n_total) & (sel % self.n_shards == self.shard) & (local < n)
        banned = torch.zeros(len(sel), n + 1, dtype=torch.bool, device=sel.device)
        banned.scatter_(1, torch.where(mine, local, n), True)  # pads and other shards' rows land in column n
        return banned[:, :n]

    @torch.no_grad()
    def best_chunks_on_device(
        self, states: torch.Tensor, sel: torch.Tensor, n_total: int, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The device half of :meth:`best_chunks` for torch-scored shards (``n > 0``, ``k > 0``): each row's
        best ``min(k, n)`` Q, their local rows and their positions (None: positions off), left on
        the device (no host sync). ``states`` and ``sel`` (:func:`selected_matrix`) are on the device.
        The same arithmetic as the per-shard path, so the same picks and values."""
        n = self.rows_within(n_total)
        c = self.model
        gpos = self._gpos(n)
        if self._wants_fused():
            q = self._fused_scores(states, self.vectors[:n], gpos, sel, n_total)
            if q is not None:
                top_q, top_i = q.topk(min(k, n), dim=1)
                return (
                    top_q,
                    top_i,
                    positions_at("relative", gpos[top_i], sel, n_total, c.relative_delta, c.relative_ell),
                )
        pos = positions_at(c.positions, gpos, sel, n_total, c.relative_delta, c.relative_ell)
        q = score_chunks(
            states, self.vectors[:n], pos, c.rope_base, block=max(1, self.options.score_block // max(1, len(states)))
        )
        q.masked_fill_(self._banned(sel, n, n_total), float("-inf"))
        top_q, top_i = q.topk(min(k, n), dim=1)
        return top_q, top_i, None if pos is None else pos.gather(1, top_i)

    @staticmethod
    def _top(q: torch.Tensor, k: int, n: int, positions_of) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Each row's best ``k`` of ``n`` on the host; -1 for rows with fewer finite scores.
        ``positions_of(top_i)`` gives the chosen chunks' positions (None: positions off)."""
        top_q, top_i = q.topk(min(k, n), dim=1)
        top_pos = None if positions_of is None else positions_of(top_i).cpu().numpy()
        top_q, top_i = top_q.cpu().numpy(), top_i.cpu().numpy()
        return top_q, np.where(np.isfinite(top_q), top_i, -1), top_pos

    # The per-shard path (ShardOptions.batched off): its own selected set, exclusion by host
    # lists and three copies to the host per shard; kept as the reference the bench compares to.
    def _exact_best_chunks(self, states, selected, mine, n, n_total, k):
        vectors = self.vectors[:n]
        c = self.model
        if self._wants_fused():
            hits = self._fused_best_chunks(states, selected, vectors, n, n_total, k)
            if hits is not None:
                return hits
        pos = None
        if c.positions != "none":  # the selected set only matters through the chunks' positions
            gpos, sel = self._selected_rows(selected, n, n_total)
            pos = positions_at(c.positions, gpos, sel, n_total, c.relative_delta, c.relative_ell)
        q = score_chunks(
            states, vectors, pos, c.rope_base, block=max(1, self.options.score_block // max(1, len(states)))
        )
        for r, rows in enumerate(mine):
            if rows:
                q[r, rows] = float("-inf")
        return self._top(q, k, n, None if pos is None else lambda top_i: pos.gather(1, top_i))

    def _fused_best_chunks(self, states, selected, vectors, n, n_total, k):
        if _fused() is None:
            return None
        c = self.model
        gpos, sel = self._selected_rows(selected, n, n_total)
        q = self._fused_scores(states, vectors, gpos, sel, n_total)
        if q is None:
            return None
        return self._top(
            q, k, n, lambda top_i: positions_at("relative", gpos[top_i], sel, n_total, c.relative_delta, c.relative_ell)
        )

    def _faiss_best_chunks(self, states, mine, n, k):
        faiss_index = self._shard_faiss()
        extra = max((len(m) for m in mine), default=0) + (self.n - n)  # rows to filter out afterwards
        kk = min(self.n, k + extra)
        query = np.ascontiguousarray(states.cpu().numpy())
        while True:  # an append between catching up and searching: catch up again
            faiss_index.catch_up(n, self._approximate(), self._rows_from)
            found = faiss_index.search(query, kk, n)
            if found is not None:
                break
        dist, local = found
        out_q, out_i = best_unselected(dist, local, [set(m) for m in mine], min(k, n), n)
        return out_q / 2.0, out_i  # Q = mean of the twin halves = <s, a> / 2

    def _shard_ann(self) -> ShardAnn:
        if self.ann is None:
            with self._lock:
                if self.ann is None:
                    self.ann = ShardAnn(
                        _faiss(),
                        self.options.ann_settings,
                        self.device,
                        shard=self.shard,
                        folder=self.faiss_folder,
                        uid=self.uid or "",
                    )
        return self.ann

    def restore_ann(self) -> None:
        """Load the saved candidate index of this shard (what it covers of the loaded rows)."""
        if self.faiss_folder is not None and self.uses_ann and self.ann is None:
            self._shard_ann().restore(self._batches())

    def warm_ann(self) -> None:
        """Load or build the candidate index now (replica start) rather than at the first query."""
        if self.uses_ann and self.n > 0:
            self._shard_ann().catch_up(self.n, True, self._rows_from)

    def _ann_best_chunks(self, states, selected, n, n_total, k):
        """Candidates from the approximate index at each probe position, scored exactly."""
        ann, settings = self._shard_ann(), self.options.ann_settings
        queries, counts = probe_queries(states, [len(s) for s in selected], self.model, settings.probes)
        queries = queries.cpu().numpy()
        per_probe = max(settings.candidates, k + max((len(s) for s in selected), default=0))
        while True:  # an append between catching up and searching: catch up again
            ann.catch_up(n, True, self._rows_from)
            found = ann.search(queries, per_probe, n)
            if found is not None:
                break
        local = torch.from_numpy(candidate_rows(found, counts, n)).to(self.device)
        sel = torch.from_numpy(selected_matrix(selected, n_total)).to(self.device)
        top_q, top_rows, pos = rescore(
            states, self.vectors, local, sel, self.shard, self.n_shards, n_total, self.model, k
        )
        return top_q.cpu().numpy(), top_rows.cpu().numpy(), None if pos is None else pos.cpu().numpy()


def best_unselected(
    dist: np.ndarray, local: np.ndarray, banned: Sequence[set[int]], k: int, n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's best ``k`` of a FAISS answer (``dist``, ``local`` rows, best first) that are rows
    below ``n`` and not in the row's ``banned`` set; -inf and -1 pad rows with fewer."""
    out_q = np.full((len(dist), k), -np.inf, np.float32)
    out_i = np.full(out_q.shape, -1, np.int64)
    for r in range(len(dist)):
        keep = [(float(d), int(i)) for d, i in zip(dist[r], local[r]) if 0 <= i < n and int(i) not in banned[r]][:k]
        out_q[r, : len(keep)] = [d for d, _ in keep]
        out_i[r, : len(keep)] = [i for _, i in keep]
    return out_q, out_i


_FAISS: Any = None


def _faiss():
    """faiss when installed (the GPU bench machine may lack it: shards then score in torch)."""
    global _FAISS
    if _FAISS is None:
        try:
            import faiss  # noqa: PLC0415

            _FAISS = faiss
        except ImportError:
            _FAISS = False
    return _FAISS or None


@torch.no_grad()
def score_shards(
    shards: Sequence[ShardIndex],
    states: torch.Tensor | np.ndarray,
    selected: Sequence[Sequence[int]],
    n_total: int,
    k: int,
) -> list[ShardHits]:
    """Each shard's :meth:`ShardIndex.best_chunks`, in order. The torch-scored shards of a device are
    scored in one pass: the states and the selected set go to the device once, every shard's
    device half is launched, and all their results come back in one copy (a host sync per shard
    costs more than the scoring). FAISS shards, empty ones and those with ``batched`` off answer
    on their own, as before."""
    out: list[ShardHits | None] = [None] * len(shards)
    by_device: dict[torch.device, list[int]] = {}
    for j, shard in enumerate(shards):
        exact = not shard.uses_faiss and not shard.uses_ann
        if shard.options.batched and exact and k > 0 and shard.rows_within(n_total) > 0:
            by_device.setdefault(shard.device, []).append(j)
        else:
            out[j] = shard.best_chunks(states, selected, n_total, k)
    sel = selected_matrix(selected, n_total) if by_device else None
    for device, idx in by_device.items():
        st = states_on(states, device)
        results = None
        if device.type == "cuda" and all(shards[j].options.graphs for j in idx):
            results = score_graphs_for(device).replay_best_chunks([shards[j] for j in idx], st, sel, n_total, k)
        if results is None:
            sel_d = torch.from_numpy(sel).to(device)
            tops = [shards[j].best_chunks_on_device(st, sel_d, n_total, k) for j in idx]
            host = iter(to_host([t for top in tops for t in top if t is not None]))
            results = [(next(host), next(host), next(host) if top[2] is not None else None) for top in tops]
        for j, (q, top_i, pos) in zip(idx, results):
            out[j] = shards[j].hits(q, np.where(np.isfinite(q), top_i, -1), pos)  # -1: the row ran out of finite scores
    return out  # type: ignore[return-value]


class ShardUnhealthy(StoreError):
    def __init__(self, problems: Sequence[SegmentProblem]):
        self.problems = list(problems)
        super().__init__("; ".join(str(p) for p in self.problems))

    def __reduce__(self):  # picklable across processes (Ray)
        return (ShardUnhealthy, (self.problems,))


def as_devices(device: torch.device | str | Sequence[torch.device | str]) -> list[torch.device]:
    """One device or several (shards spread over GPUs: shard s on ``devices[s % n]``) as a list."""
    devices = [torch.device(d) for d in ([device] if isinstance(device, (str, torch.device)) else device)]
    if not devices:
        raise ValueError("shards need at least one device")
    return devices


class CorpusShards:
    """The shards ``slots`` of one corpus held by one process, kept in step with the store."""

    def __init__(
        self,
        store: CorpusStore,
        name: str,
        slots: Sequence[int],
        device: torch.device | Sequence[torch.device],
        options: ShardOptions | None = None,
    ):
        """``device``: where the shards live; several: shard s on ``device[s % len(device)]`` (the
        shards of a corpus spread over GPUs; each device's shards are scored in one pass)."""
        self.devices = as_devices(device)
        self.store, self.name, self.slots, self.device = store, name, list(slots), self.devices[0]
        self.options = options or ShardOptions()
        self.uid: str | None = None
        self.version = -1
        self.shards: dict[int, ShardIndex] = {}
        self.problems: list[SegmentProblem] = []
        self.loaded_rows = 0  # rows read from disk since start (the durability test reads it)
        self._sync_lock = threading.Lock()

    def sync(self, min_version: int = 0, uid: str | None = None) -> None:
        """Load what the manifest has and this process has not; reload a shard whose loaded
        segment was replaced. Raises :class:`ShardUnhealthy` rather than serve a bad shard."""
        if self.version >= min_version and (uid is None or uid == self.uid) and not self.problems:
            return
        with self._sync_lock:
            m = self.store.read(self.name)
            if uid is not None and m.uid != uid:
                raise CorpusNotFound(f"corpus {self.name!r} was deleted and re-created; retry")
            if m.uid != self.uid:
                self.shards, self.uid = {}, m.uid
            problems: list[SegmentProblem] = []
            for slot in self.slots:
                if slot >= m.shards:
                    continue
                shard = self.shards.get(slot)
                replaced = shard is not None and any(
                    b.id in shard.loaded and shard.loaded[b.id] != b.shards[slot].vectors.sha256 for b in m.batches
                )
                if shard is None or replaced:
                    shard = ShardIndex(
                        m.name, slot, m.shards, m.model_cfg, m.dim, self.devices[slot % len(self.devices)], self.options
                    )
                    shard.faiss_folder, shard.uid = self.store.path(self.name) / "faiss", m.uid
                new = [b for b in m.batches if b.id not in shard.loaded]
                shard.reserve(shard.n + sum(b.shards[slot].chunks for b in new))
                slot_problems = []
                for b in new:
                    segment, problem = self.store.read_segment(m, slot, b)
                    if problem is not None:
                        slot_problems.append(problem)
                        break  # later rows would land at the wrong positions
                    shard.add(segment, b.shards[slot].vectors.sha256)
                    self.loaded_rows += len(segment.positions)
                shard.restore_faiss()
                shard.restore_ann()
                self.shards[slot] = shard
                problems.extend(slot_problems)
            self.problems = problems
            self.version = m.version
            if problems:
                raise ShardUnhealthy(problems)

    def best_chunks(self, states, selected: Sequence[Sequence[int]], n_total: int, k: int) -> ShardHits:
        """Each state row's best ``k`` chunks of the shards held here (:func:`score_shards`, merged)."""
        shards = [self.shards[s] for s in self.slots if s in self.shards]
        if not shards:
            return ShardHits.empty(len(states), False)
        if not torch.is_tensor(states):  # one host-to-device copy for all the holder's shards
            states = torch.from_numpy(np.ascontiguousarray(states, dtype=np.float32)).to(shards[0].device)
        hits = score_shards(shards, states, selected, n_total, k)
        return merge_hits(hits, k) if len(hits) > 1 else hits[0]

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.shards.values())
