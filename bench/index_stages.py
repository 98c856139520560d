"""Indexing on one device, stage by stage (issue 14): which stage keeps end-to-end indexing far
from the bare encoder forward. The pipelined run and the run with its stages one after another
took the same time (bench/results/index_contention_10m_h100/), so this times each stage alone on
the same 10M tokens, then the embedding stage again while the tokeniser processes are busy:

* ``prep``: chunk + tokenise in ``--workers`` processes, gathered in corpus order (no device work);
  and one process alone on the first two books (the per-process rate);
* ``embed``: the pipeline's embedding stage (``embed_group``: host padding, forwards, pooling,
  vectors back to the host) on the prepared groups, nothing else running;
* ``embed_busy_cpu``: the same while ``--workers`` processes tokenise the books again;
* ``embed_threads1``: alone, with torch's intra-op threads set to 1 in this process;
* ``bare``: the encoder forward alone on the same padded batches (serve_scale's figure);
* ``write``: the store appends of the groups (files, checksums, fsync, manifest) alone.

Each row has its wall seconds, tokens/s and this process's CPU seconds (user + system, all threads).

CPU check:  python bench/index_stages.py --tokens 300000 --workers 1
GPU:        QRAG_COMMIT=<sha> python bench/index_stages.py --corpus .carry/idx/novels \\
                --encoder .carry/idx/minilm16 --out $OUT/index_stages.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_common import machine_info, write_result  # noqa: E402
from qrag.data.haystack import book_files  # noqa: E402
from qrag.index.pipeline import embed_group  # noqa: E402
from qrag.index.store import CorpusStore  # noqa: E402
from qrag.model.encoder import resolve_encoder  # noqa: E402
from qrag.retrieval.embedder import resolve_source  # noqa: E402
from serve_scale import (  # noqa: E402
    _init_worker,
    _prepare,
    bare_forward_tokens_per_s,
    document_jobs,
    prepared_groups,
    random_weights_model,
)  # noqa: E402


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Timer:
    """Wall and this process's CPU seconds of a block (device work waited for at the end)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        self._sync()
        self.wall, self.cpu = time.perf_counter(), cpu_seconds()
        return self

    def __exit__(self, *exc):
        self._sync()
        self.wall, self.cpu = time.perf_counter() - self.wall, cpu_seconds() - self.cpu

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def row(self, tokens: int) -> dict:
        return {
            "seconds": round(self.wall, 3),
            "tokens_per_s": round(tokens / self.wall),
            "process_cpu_seconds": round(self.cpu, 3),
        }


def busy_tokenisers(pool, jobs, workers: int, stop: threading.Event) -> threading.Thread:
    """Keep every worker tokenising (results dropped) until ``stop``."""

    def run() -> None:
        pending = [pool.submit(_prepare, job) for job in jobs[:workers]]
        i = workers
        while not stop.is_set():
            pending.pop(0).result()
            pending.append(pool.submit(_prepare, jobs[i % len(jobs)]))
            i += 1
        for f in pending:
            f.cancel()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def prep_rates(jobs: list, workers: int, init: tuple, args, dev) -> tuple[dict, dict]:
    """Tokenising ``--tokens`` with ``workers`` processes: gathered into groups, then raw."""
    with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=init) as pool:
        list(pool.map(int, range(workers)))
        with Timer(dev) as t:
            groups = list(prepared_groups(pool, iter(jobs), workers, args.tokens, args.commit_chunks))
        gathered = t.row(sum(len(x) for g in groups for x in g.ids))
        n_jobs = sum(1 for _ in groups for _ in _.docs)
        with Timer(dev) as t:
            pending = [pool.submit(_prepare, job) for job in jobs[: 2 * workers]]
            tokens, k = 0, 2 * workers
            for _ in range(n_jobs):
                _, packed = pending.pop(0).result()
                tokens += int(packed[4].sum())
                if k < len(jobs):
                    pending.append(pool.submit(_prepare, jobs[k]))
                    k += 1
            for f in pending:
                f.cancel()
        raw = t.row(tokens)
    return gathered, raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=None, help="books folder (default $QRAG_DATA_DIR/gutenberg_novels)")
    ap.add_argument(
        "--encoder", default="minilm", help="'minilm' or a HF directory (random weights of its architecture)"
    )
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--workers", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)))
    ap.add_argument("--chunk-tokens", type=int, default=64)
    ap.add_argument(
        "--doc-tokens",
        type=int,
        default=0,
        help="documents of about this many tokens cut from the books (serve_scale's --doc-tokens); 0 = whole books",
    )
    ap.add_argument("--chunk-batch", type=int, default=8192)
    ap.add_argument("--encode-tokens", type=int, default=131072)
    ap.add_argument("--commit-chunks", type=int, default=16384)
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--prep-workers",
        default=None,
        metavar="N,N,...",
        help="only the tokenising stage, with each of these worker "
        "counts: gathered into commit groups as the pipeline does (unpacked chunks), "
        "and raw (the packed results only), "
        "to tell the workers' ceiling from the gathering process's",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.positions = "relative"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    model = random_weights_model(resolve_source(None, args.encoder), args)
    dev = model.device
    tokenizer_dir = resolve_encoder(args.encoder)
    files = book_files(args.corpus)
    jobs = list(document_jobs(files, args.chunk_tokens, args.doc_tokens, passes=3))
    rows: dict[str, dict] = {}
    init = (tokenizer_dir, model.layout, 64, 0)
    if args.prep_workers:
        for n in [int(x) for x in args.prep_workers.split(",")]:
            rows[f"prep_{n}_workers"], rows[f"raw_{n}_workers"] = prep_rates(jobs, n, init, args, dev)
        result = {
            "bench": "index_stages",
            **machine_info(),
            "device": str(dev),
            "cpu_count": os.cpu_count(),
            "stages": rows,
            "settings": {k: getattr(args, k) for k in ("tokens", "commit_chunks", "chunk_tokens", "doc_tokens")},
        }
        print(json.dumps(result))
        if args.out:
            write_result(args.out, result)
        return

    with ProcessPoolExecutor(1, initializer=_init_worker, initargs=init) as pool:
        pool.submit(int).result()  # the worker's start is not the rate
        with Timer(dev) as t:
            one = list(prepared_groups(pool, iter(jobs[:2]), 1, 10**12, args.commit_chunks))
        rows["prep_one_process"] = t.row(sum(len(x) for g in one for x in g.ids))
    with ProcessPoolExecutor(args.workers, initializer=_init_worker, initargs=init) as pool:
        list(pool.map(int, range(args.workers)))
        with Timer(dev) as t:
            groups = list(prepared_groups(pool, iter(jobs), args.workers, args.tokens, args.commit_chunks))
    tokens = sum(len(x) for g in groups for x in g.ids)  # encoder tokens: every rate below is of these
    rows["prep"] = t.row(tokens)

    def embed_all() -> list[np.ndarray]:
        return [embed_group(model, g.ids, args.chunk_batch, model.dim) for g in groups]

    embed_all()  # warm-up: kernels, allocator, every bucket shape
    with Timer(dev) as t:
        vectors = embed_all()
    rows["embed"] = t.row(tokens)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with Timer(dev) as t:
        embed_all()
    rows["embed_threads1"] = t.row(tokens)
    torch.set_num_threads(threads)
    with ProcessPoolExecutor(args.workers, initializer=_init_worker, initargs=init) as pool:
        list(pool.map(int, range(args.workers)))
        stop = threading.Event()
        busy = busy_tokenisers(pool, jobs, args.workers, stop)
        time.sleep(1.0)
        with Timer(dev) as t:
            embed_all()
        stop.set()
        busy.join()
    rows["embed_busy_cpu"] = t.row(tokens)
    rows["bare"] = {
        "tokens_per_s": round(
            float(
                np.median(bare_forward_tokens_per_s(model, [x for g in groups for x in g.ids], args.encode_tokens, 3))
            )
        )
    }
    with tempfile.TemporaryDirectory() as storage:
        store = CorpusStore(storage)
        store.create(
            "bench",
            fingerprint=model.fingerprint,
            model=model.model_cfg,
            dim=model.dim,
            chunk_tokens=args.chunk_tokens,
            shards=4,
        )
        with Timer(dev) as t:
            for g, v in zip(groups, vectors):
                store.append("bench", g.docs, g.chunks, g.ids, v, model.fingerprint)
        rows["write"] = t.row(tokens)
    result = {
        "bench": "index_stages",
        **machine_info(),
        "device": str(dev),
        "encoder_tokens": tokens,
        "chunks": sum(len(g.ids) for g in groups),
        "groups": len(groups),
        "workers": args.workers,
        "torch_threads": threads,
        "settings": {
            k: getattr(args, k) for k in ("chunk_batch", "encode_tokens", "commit_chunks", "chunk_tokens", "doc_tokens")
        },
        "stages": rows,
    }
    print(json.dumps(result))
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
