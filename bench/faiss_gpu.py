"""FAISS on the GPU against the shards' torch scoring, positions off (issue 14, item 5).

One retrieval step scores a few state vectors against every chunk of a corpus and keeps each
state's best ``k``, leaving out the chunks it already holds. The serve shards do that exactly in
torch (:func:`qrag.index.shards.score_shards`: one pass over a device's shards, replayed from a
CUDA graph, one copy to the host). This bench times, on the same random unit vectors and the same
states, for corpora of 1M, 10M and 100M tokens (20K, 200K and 2M chunks of ~50 tokens):

- ``torch``: the shards' own path (``ShardOptions(faiss="never")``), float32 vectors;
- ``faiss_flat``: a ``GpuIndexFlatIP`` per shard (float32), searched for ``k`` plus the selected
  count, the selected rows filtered out afterwards (what ``ShardIndex._faiss_best_chunks`` does);
- ``faiss_flat_fp16``: the same with float16 storage (``useFloat16``);
- ``faiss_one_index``: one ``GpuIndexFlatIP`` over the whole corpus (FAISS at its best: no
  per-shard calls);
- ``faiss_ivf``: ``GpuIndexIVFFlat`` over the whole corpus (nlist ~ 4 sqrt(n), nprobe 32), the
  approximate index FAISS offers on the GPU, trained on a sample, with its recall against exact.

Each figure is the median of ``--repeats`` timed calls after warm-up, ending with the picks on
the host (numpy). Agreement: the fraction of states whose exact picks equal torch's.

On an H100, faiss-gpu-cu12 1.14.1 failed at its first GPU kernel (no compute capability 9.0 code;
bench/results/faiss_gpu_h100/); faiss-gpu 1.15.1 carries sm_90 code. The lent GPUs have CUDA 13
only; the CUDA 12 wheel needs CUDA 12's runtime (carried, 3 MB) and cuBLAS (a 600 MB wheel, not
carried): ``bench/cublas12/`` builds a stand-in libcublas.so.12 that forwards FAISS's eight cuBLAS
calls to CUDA 13's. ``bench/faiss_gpu.sh`` sets it all up, the wheel carried in parts.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable

import numpy as np
import torch

from bench_common import machine_info, write_result
from qrag.config import ModelConfig
from qrag.index.shards import ShardIndex, ShardOptions, best_unselected, score_shards
from qrag.index.store import Segment


def median_ms(fn: Callable[[], Any], repeats: int, warm: int = 5) -> float:
    for _ in range(warm):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1000)


def unit_vectors(n: int, dim: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    v = torch.randn(n, dim, generator=g, device=device)
    return v / v.norm(dim=1, keepdim=True)


def torch_shards(vectors: torch.Tensor, n_shards: int, device: torch.device) -> list[ShardIndex]:
    cfg = ModelConfig(positions="none")
    n = len(vectors)
    empty = np.zeros(0, np.int64)
    shards = []
    for s in range(n_shards):
        rows = torch.arange(s, n, n_shards, device=device)
        shard = ShardIndex("bench", s, n_shards, cfg, vectors.shape[1], device, ShardOptions(faiss="never"))
        m = len(rows)
        shard.reserve(m)
        shard.add(
            Segment(
                1,
                (s + n_shards * np.arange(m)).astype(np.int64),
                vectors[rows].cpu().numpy(),
                [empty] * m,
                ["d"] * m,
                [""] * m,
            )
        )
        shards.append(shard)
    return shards


def faiss_shards(faiss, res, vectors: np.ndarray, n_shards: int, fp16: bool) -> list[Any]:
    """``n_shards`` flat inner-product indexes on GPU 0 (``res`` None: on the host, a CPU smoke run)."""
    out = []
    for s in range(n_shards):
        if res is None:
            index = faiss.IndexFlatIP(vectors.shape[1])
            index.add(np.ascontiguousarray(vectors[s::n_shards]))
            out.append(index)
            continue
        cfg = faiss.GpuIndexFlatConfig()
        cfg.device = 0
        cfg.useFloat16 = fp16
        index = faiss.GpuIndexFlatIP(res, vectors.shape[1], cfg)
        index.add(np.ascontiguousarray(vectors[s::n_shards]))
        out.append(index)
    return out


def search_shards(
    indexes: list[Any], n_shards: int, states: np.ndarray, selected: list[list[int]], k: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per shard: search k + the selected count, drop the selected rows (global ids -> local)."""
    extra = max(len(s) for s in selected)
    res = []
    for s, index in enumerate(indexes):
        banned = [{g // n_shards for g in sel if g % n_shards == s} for sel in selected]
        dist, local = index.search(states, k + extra)
        res.append(best_unselected(dist, local, banned, k, index.ntotal))
    return res


def global_picks(per_shard: list[tuple[np.ndarray, np.ndarray]], n_shards: int, k: int) -> np.ndarray:
    """Each state's best ``k`` global ids over the shards' answers (sorted, for comparison)."""
    q = np.concatenate([p[0] for p in per_shard], axis=1)
    g = np.concatenate([np.where(p[1] >= 0, p[1] * n_shards + s, -1) for s, p in enumerate(per_shard)], axis=1)
    best = np.argsort(-q, axis=1, kind="stable")[:, :k]
    return np.sort(np.take_along_axis(g, best, axis=1), axis=1)


def torch_picks(hits, k: int) -> np.ndarray:
    """The same from the shards' own hits (global ids already)."""
    q = np.concatenate([h.q for h in hits], axis=1)
    g = np.concatenate([h.ids for h in hits], axis=1)
    best = np.argsort(-q, axis=1, kind="stable")[:, :k]
    return np.sort(np.take_along_axis(g, best, axis=1), axis=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--chunks",
        default="20000,200000,2000000",
        help="corpus sizes in chunks (~50 tokens each: 1M, 10M, 100M tokens)",
    )
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument(
        "--states", default="1,8", help="state rows per scoring call (1: one query's step; 8: batched queries)"
    )
    ap.add_argument("--k", type=int, default=8, help="picks per state (a search keeps max(beam, alternatives + 1))")
    ap.add_argument("--selected", type=int, default=3, help="chunks each state holds already (left out of its picks)")
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--ivf-nprobe", type=int, default=32)
    ap.add_argument("--device", default="cuda", help="cuda; cpu: a smoke run of this script (FAISS's CPU indexes)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import faiss  # noqa: PLC0415 - the CUDA-12 build, set up by bench/faiss_gpu.sh

    dev = torch.device(args.device)
    res = faiss.StandardGpuResources() if dev.type == "cuda" else None
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    for n in [int(x) for x in args.chunks.split(",")]:
        vectors = unit_vectors(n, args.dim, seed=n, device=dev)
        host = vectors.cpu().numpy()
        shards = torch_shards(vectors, args.shards, dev)
        t0 = time.perf_counter()
        flat = faiss_shards(faiss, res, host, args.shards, fp16=False)
        flat_add_s = time.perf_counter() - t0
        flat16 = faiss_shards(faiss, res, host, args.shards, fp16=True)
        one = faiss_shards(faiss, res, host, 1, fp16=False)[0]
        nlist = int(4 * np.sqrt(n))
        t0 = time.perf_counter()
        if res is None:
            ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(args.dim), args.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        else:
            ivf = faiss.GpuIndexIVFFlat(res, args.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        ivf.train(host[rng.choice(n, min(n, 64 * nlist), replace=False)])
        ivf.add(host)
        ivf.nprobe = args.ivf_nprobe
        ivf_build_s = time.perf_counter() - t0
        for b in [int(x) for x in args.states.split(",")]:
            states_t = unit_vectors(b, args.dim, seed=7 + b, device=dev)
            states = states_t.cpu().numpy()
            selected = [sorted(int(x) for x in rng.choice(n, args.selected, replace=False)) for _ in range(b)]
            k = args.k
            exact = torch_picks(score_shards(shards, states_t, selected, n, k), k)
            row: dict[str, Any] = {"chunks": n, "tokens_approx": n * 50, "states": b, "k": k, "shards": args.shards}
            row["torch_ms"] = median_ms(lambda: score_shards(shards, states_t, selected, n, k), args.repeats)
            row["faiss_flat_ms"] = median_ms(
                lambda: search_shards(flat, args.shards, states, selected, k), args.repeats
            )
            row["faiss_flat_fp16_ms"] = median_ms(
                lambda: search_shards(flat16, args.shards, states, selected, k), args.repeats
            )
            row["faiss_one_index_ms"] = median_ms(lambda: search_shards([one], 1, states, selected, k), args.repeats)
            row["faiss_ivf_ms"] = median_ms(lambda: search_shards([ivf], 1, states, selected, k), args.repeats)
            agree = lambda picks: float(np.mean([set(a) == set(b_) for a, b_ in zip(picks, exact)]))  # noqa: E731
            row["agreement_with_torch"] = {
                "faiss_flat": agree(
                    global_picks(search_shards(flat, args.shards, states, selected, k), args.shards, k)
                ),
                "faiss_flat_fp16": agree(
                    global_picks(search_shards(flat16, args.shards, states, selected, k), args.shards, k)
                ),
                "faiss_one_index": agree(global_picks(search_shards([one], 1, states, selected, k), 1, k)),
            }
            ivf_picks = global_picks(search_shards([ivf], 1, states, selected, k), 1, k)
            row["faiss_ivf_recall"] = float(np.mean([len(set(a) & set(b_)) / k for a, b_ in zip(ivf_picks, exact)]))
            row["faiss_flat_add_s"] = round(flat_add_s, 3)
            row["faiss_ivf_build_s"] = round(ivf_build_s, 3)
            row["torch_shard_bytes"] = int(sum(s.vectors.numel() * 4 for s in shards) // args.shards)
            rows.append(row)
            print(json.dumps(row), flush=True)
        shards = flat = flat16 = one = ivf = vectors = None  # this size's memory goes before the next size's
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    result = {
        "bench": "faiss_gpu",
        **machine_info(),
        "faiss": faiss.__version__,
        "faiss_gpus": faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0,
        "device": str(dev),
        "settings": {k: getattr(args, k) for k in ("dim", "shards", "k", "selected", "repeats", "ivf_nprobe")},
        "cublas_note": f"faiss {faiss.__version__} with CUDA 12.9's runtime; "
        "its cuBLAS calls forwarded to CUDA 13's (bench/cublas12/)",
        "rows": rows,
    }
    if args.out:
        write_result(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


if __name__ == "__main__":
    main()
