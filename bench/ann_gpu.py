"""The approximate candidate stage (qrag.index.ann) against exact scoring, at corpus sizes where brute
force runs out (issue 35, item 1).

Question: for shards beyond a brute-force budget, how much of the exact top-k does "FAISS candidates
at rotated probes, re-scored exactly" keep, and at what latency, with RoPE relative positions and
without positions?

Per corpus size (``--chunks``, ~50 tokens a chunk: 2M, 20M, 6M = 100M, 1B, 300M tokens), in
``--shards`` shards on one device, one set of :class:`qrag.index.shards.ShardIndex` objects:

- ``exact``: the shards' own path (``ann="never"``; on a GPU the compiled relative scorer replayed
  from CUDA graphs), the reference the recall is measured against;
- per ``--kinds`` entry (``ivf_pq``, ``ivf_flat``): the same shards with ``ann="always"``: one FAISS
  index per shard built over the stored vectors (build seconds reported), then per ``--probes``
  (positions a segment), ``--candidates`` (chunks a probe) and ``--nprobes`` value the latency of a
  retrieval step and the recall of the exact top-``k`` over ``--eval-states`` states, each holding
  ``--selected`` chunks already (so relative positions have that many + 1 segments), for positions
  ``relative`` and ``none``.

Vectors: ``synthetic`` (default) are unit vectors around ``chunks / 1000`` random centres (a state is
one more point around a random centre), the within-cluster cosine set by ``--spread``; no real
corpus: an inverted file's recall depends on the data, so ``--store DIR --corpus NAME`` reads the
vectors of an indexed corpus instead (``qrag index`` or ``bench/serve_scale.py --storage``; its size
replaces ``--chunks``; states are stored vectors of random chunks with the same spread of noise).

Each latency is the median of ``--repeats`` calls after warm-up, the picks on the host. Rows are
written to ``--out`` as they finish (a run cut short keeps what it measured); ``--budget-s`` skips
sizes and index kinds that would start after it.

GPU (FAISS set up by bench/faiss_gpu.sh, which runs this with ``BENCH=ann_gpu.py``):
    python3 ann_gpu.py --out $OUT/ann_gpu.json
CPU check (minutes): python bench/ann_gpu.py --device cpu --chunks 20000 --kinds ivf_flat --repeats 3
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import torch

from bench_common import machine_info, write_result
from faiss_gpu import median_ms
from qrag.config import ModelConfig
from qrag.index.ann import AnnSettings
from qrag.index.shards import ShardIndex, ShardOptions, score_shards
from qrag.index.store import Segment
from qrag.retrieval.hits import merge_hits


def clustered(n: int, centres: torch.Tensor, spread: float, g: torch.Generator) -> torch.Tensor:
    """``n`` unit vectors, each a random centre plus Gaussian noise of norm ~``spread``."""
    d = centres.shape[1]
    pick = torch.randint(len(centres), (n,), generator=g, device=centres.device)
    v = centres[pick] + torch.randn(n, d, generator=g, device=centres.device) * (spread / d**0.5)
    return v / v.norm(dim=1, keepdim=True)


def make_shards(vectors_of, n: int, n_shards: int, dim: int, device: torch.device) -> list[ShardIndex]:
    """Shards of ``n`` chunks; ``vectors_of(s, m)`` gives shard ``s``'s ``m`` rows (float32, host)."""
    shards, empty = [], np.zeros(0, np.int64)
    for s in range(n_shards):
        m = len(range(s, n, n_shards))
        shard = ShardIndex("bench", s, n_shards, ModelConfig(positions="relative"), dim, device, ShardOptions())
        shard.reserve(m)
        positions = (s + n_shards * np.arange(m)).astype(np.int64)
        shard.add(Segment(1, positions, vectors_of(s, m), [empty] * m, ["d"] * m, [""] * m))
        shards.append(shard)
    return shards


def set_mode(shards: list[ShardIndex], positions: str, options: ShardOptions) -> None:
    for shard in shards:
        shard.model = ModelConfig(positions=positions)
        shard.options = options


def set_nprobe(shards: list[ShardIndex], nprobe: int) -> None:
    for shard in shards:
        if shard.ann is not None and hasattr(shard.ann.index, "nprobe"):
            shard.ann.index.nprobe = nprobe


def picks(shards, states, selected, n, k):
    return merge_hits(score_shards(shards, states, selected, n, k), k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", default="2000000,20000000,6000000", help="corpus sizes in chunks (synthetic)")
    ap.add_argument("--store", default=None, help="a qrag storage folder: real vectors of --corpus instead")
    ap.add_argument("--corpus", default="bench")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--spread", type=float, default=0.8, help="noise norm around a centre (unit centres)")
    ap.add_argument("--kinds", default="ivf_flat,ivf_pq")
    ap.add_argument("--nprobes", default="16,64")
    ap.add_argument("--probes", default="2,8", help="positions per segment (AnnSettings.probes), each measured")
    ap.add_argument("--candidates", default="64,256", help="chunks kept per probe (AnnSettings.candidates), each")
    ap.add_argument("--positions", default="relative,none")
    ap.add_argument("--states", default="1,8", help="state rows per timed call")
    ap.add_argument("--eval-states", type=int, default=128, help="states the recall is measured on")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--selected", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="no new size after this many seconds")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import faiss  # noqa: PLC0415 - installed by bench/faiss_gpu.sh on the GPU machines

    dev = torch.device(args.device)
    t_start = time.perf_counter()
    result: dict[str, Any] = {
        "bench": "ann_gpu",
        **machine_info(),
        "faiss": faiss.__version__,
        "faiss_gpus": faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0,
        "device": str(dev),
        "settings": {
            k: getattr(args, k)
            for k in ("store", "corpus", "dim", "shards", "spread", "kinds", "nprobes", "probes", "candidates", "k")
        }
        | {"selected": args.selected, "eval_states": args.eval_states, "repeats": args.repeats},
        "rows": [],
    }
    sizes = [None] if args.store else [int(x) for x in args.chunks.split(",")]
    for size in sizes:
        if time.perf_counter() - t_start > args.budget_s:
            result.setdefault("skipped", []).append({"chunks": size})
            continue
        g = torch.Generator(device=dev).manual_seed(size or 0)
        t0 = time.perf_counter()
        if args.store:
            from qrag.index.store import CorpusStore  # noqa: PLC0415

            from qrag.index.shards import CorpusShards  # noqa: PLC0415

            cs = CorpusShards(CorpusStore(args.store), args.corpus, range(64), dev, ShardOptions())
            cs.sync()
            shards = [cs.shards[s] for s in sorted(cs.shards)]
            n, dim = sum(s.n for s in shards), shards[0].dim
            vectors = torch.cat([s.vectors for s in shards])
            source = "store"
        else:
            n, dim = size, args.dim
            centres = torch.randn(max(1, n // 1000), dim, generator=g, device=dev)
            centres /= centres.norm(dim=1, keepdim=True)
            shards = make_shards(
                lambda s, m: clustered(m, centres, args.spread, g).cpu().numpy(), n, args.shards, dim, dev
            )
            source = "synthetic"
        load_s = time.perf_counter() - t0
        rng = np.random.default_rng(size or 0)
        if args.store:
            states_all = vectors[torch.from_numpy(rng.choice(n, args.eval_states)).to(dev)]
            states_all = states_all + torch.randn(states_all.shape, generator=g, device=dev) * (args.spread / dim**0.5)
            states_all = states_all / states_all.norm(dim=1, keepdim=True)
        else:
            states_all = clustered(args.eval_states, centres, args.spread, g)
        selected_all = [sorted(int(x) for x in rng.choice(n, args.selected, replace=False)) for _ in states_all]
        batches = [int(x) for x in args.states.split(",")]
        step = max(batches)
        parts = range(0, len(states_all), step)

        def all_picks():
            return [picks(shards, states_all[i : i + step], selected_all[i : i + step], n, args.k) for i in parts]

        def step_ms(b: int) -> float:
            return round(median_ms(lambda: picks(shards, states_all[:b], selected_all[:b], n, args.k), args.repeats), 3)

        modes = args.positions.split(",")
        exact: dict[str, Any] = {}
        for positions in modes:
            set_mode(shards, positions, ShardOptions(ann="never", faiss="never"))
            exact[positions] = (all_picks(), {str(b): step_ms(b) for b in batches})
        for kind in args.kinds.split(","):
            if time.perf_counter() - t_start > args.budget_s:
                result.setdefault("skipped", []).append({"chunks": n, "kind": kind})
                continue
            settings = AnnSettings(kind=kind)
            options = ShardOptions(ann="always", faiss="never", ann_settings=settings)
            set_mode(shards, modes[0], options)
            for s in shards:
                s.ann = None  # the previous kind's indexes go first
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            t0 = time.perf_counter()
            for s in shards:
                s.warm_ann()  # one index per shard over the stored vectors: the same for every positions mode
            build_s = time.perf_counter() - t0
            grid = [
                (positions, probes, candidates, nprobe)
                for positions in modes
                for probes in ([int(x) for x in args.probes.split(",")] if positions != "none" else [1])
                for candidates in [int(x) for x in args.candidates.split(",")]
                for nprobe in [int(x) for x in args.nprobes.split(",")]
            ]
            for positions, probes, candidates, nprobe in grid:
                settings.probes, settings.candidates = probes, candidates  # read at each search: no rebuild
                set_mode(shards, positions, options)
                want, exact_ms = exact[positions]
                set_nprobe(shards, nprobe)
                got = all_picks()
                pairs = [(a, b) for e, h in zip(want, got) for a, b in zip(e.ids, h.ids)]
                row = {
                    "chunks": n,
                    "tokens_approx": n * 50,
                    "vectors": source,
                    "positions": positions,
                    "kind": kind,
                    "nprobe": nprobe,
                    "probes_per_segment": probes,
                    "candidates_per_probe": candidates,
                    "recall_at_k": round(float(np.mean([len(set(a) & set(b)) / args.k for a, b in pairs])), 4),
                    "top1_agreement": round(float(np.mean([a[0] == b[0] for a, b in pairs])), 4),
                    "build_s": round(build_s, 2),
                    "load_s": round(load_s, 2),
                    "ms": {str(b): step_ms(b) for b in batches},
                    "exact_ms": exact_ms,
                }
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    write_result(args.out, result)
            for s in shards:
                s.ann = None
        shards = vectors = centres = states_all = None  # this size's memory goes before the next's
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    if args.out:
        write_result(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


if __name__ == "__main__":
    main()
