"""How much of one GPU several processes get when each feeds it its own chunk batches.

Lanes (qrag.index.lanes) put several processes on one GPU, each with its own CUDA context. Kernels of
different contexts never run at once: the GPU switches between them. This measures that cost alone,
with no tokenising and no store: N processes (N = 1, 2, 3, ...) each embed ready-made slices of
``--chunk-batch`` random chunks of ``--length`` ids through the indexing path
(EmbeddingModel.embed_chunks_start, one slice queued ahead), all starting together; the figure is
their summed tokens/s against one process's.

    python bench/gpu_share.py --encoder .carry/idx/minilm16 --processes 1,2,3 --out bench/results/x.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _one(args, barrier, results) -> None:
    import numpy as np
    import torch

    from qrag.retrieval.embedder import resolve_source
    from serve_scale import random_weights_model

    model = random_weights_model(
        resolve_source(None, args.encoder),
        argparse.Namespace(
            encoder=args.encoder,
            positions="relative",
            device=args.device,
            encode_tokens=args.encode_tokens,
            chunk_batch=args.chunk_batch,
        ),
    )
    rng = np.random.default_rng(os.getpid())
    slices = [
        [rng.integers(1000, 30000, args.length, dtype=np.int32) for _ in range(args.chunk_batch)] for _ in range(4)
    ]
    for s in slices:  # graphs captured, kernels chosen
        model.embed_chunks_start(s)()
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    barrier.wait()
    t0 = time.perf_counter()
    done, k, queued = 0, 0, []
    while time.perf_counter() - t0 < args.seconds:
        queued.append(model.embed_chunks_start(slices[k % len(slices)]))
        k += 1
        if len(queued) > 1:
            queued.pop(0)()
            done += 1
    for wait in queued:
        wait()
        done += 1
    results.put((done * args.chunk_batch * args.length, time.perf_counter() - t0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--encoder", default="minilm")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--processes", default="1,2,3,4")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--chunk-batch", type=int, default=8192)
    ap.add_argument("--encode-tokens", type=int, default=131072)
    ap.add_argument("--length", type=int, default=66, help="ids per chunk (64 tokens + [CLS] and [SEP])")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from bench_common import machine_info, write_result

    ctx = mp.get_context("spawn")
    rows = []
    for n in [int(x) for x in args.processes.split(",")]:
        barrier, results = ctx.Barrier(n), ctx.Queue()
        procs = [ctx.Process(target=_one, args=(args, barrier, results)) for _ in range(n)]
        for p in procs:
            p.start()
        got = [results.get(timeout=300) for _ in procs]
        for p in procs:
            p.join()
        tokens = sum(t for t, _ in got)
        seconds = max(s for _, s in got)
        rows.append(
            {"processes": n, "tokens_per_s": round(tokens / seconds), "per_process": [round(t / s) for t, s in got]}
        )
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["of_first_row"] = round(r["tokens_per_s"] / base, 3)
    result = {"bench": "gpu_share", **machine_info(), "settings": vars(args), "rows": rows}
    if args.out:  # before printing: a closed stdout (a pipe into head) must not lose the file
        write_result(args.out, result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
