"""Commit cost of a bulk load against the number of batches already committed, driving the real code
(docs/benchmarks.md, "Indexing": why a 1B-token load commits several groups at once).

The lanes path (qrag index's default, serve_scale --lanes): the caller holds CorpusStore.hold() for
the whole run and hands each written group to qrag.index.lanes._Run.wrote, which commits it
(CorpusStore.commit_written: add_written + _write_manifest). Here each group's files are written by
the real CorpusStore.write_batch_files (random dim-384 vectors, a few chunks: a batch's manifest
entry does not depend on its size) and handed to the real _Run.wrote; its time is what the lanes'
caller spends committing (LaneStats.commit_seconds). Manifest writes are counted by wrapping
CorpusStore._write_manifest (the real one still runs). At each checkpoint it also times one bare
commit_written of a batch (the per-manifest-write cost at that size) and store.read (a reader's
parse of corpus.json). At the end: hold() entry (read + _remove_strays) and one store.append
(the pipeline / Ray path's per-group call: hold + doc_ids + files + manifest), at the final size.

    python bench/index_commit_cost.py --batches 4000 --shards 4 --out bench/results/index_commit_cost_cpu/after.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from bench_common import machine_info, write_result  # noqa: E402

from qrag.config import ModelConfig  # noqa: E402
from qrag.data.documents import Document, DocumentChunk  # noqa: E402
from qrag.index import lanes  # noqa: E402
from qrag.index.store import CorpusStore  # noqa: E402

DIM = 384


def make_batch(rng, b: int, docs_per_batch: int, chunks_per_doc: int):
    docs = [Document(f"b{b}-d{k}", "x") for k in range(docs_per_batch)]
    chunks = [
        DocumentChunk(d.id, f"batch {b} {d.id} chunk {c} " + "w" * 40, 64) for d in docs for c in range(chunks_per_doc)
    ]
    ids = [np.arange(64, dtype=np.int32) for _ in chunks]
    vecs = rng.standard_normal((len(chunks), DIM)).astype(np.float32)
    return docs, chunks, ids, vecs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=4000)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--checkpoints", default="100,1000,2000,4000")
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--chunks-per-doc", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    checkpoints = sorted(int(x) for x in args.checkpoints.split(","))
    rng = np.random.default_rng(0)
    root = tempfile.mkdtemp(prefix="qrag_commit_cost_")
    store = CorpusStore(root)
    store.create("c", fingerprint="fp", model=ModelConfig(), dim=DIM, chunk_tokens=64, shards=args.shards)

    writes: list[tuple[int, int]] = []  # (batches in the manifest, bytes) per manifest write
    real_write = CorpusStore._write_manifest

    def counted(self, m):
        real_write(self, m)
        writes.append((len(m.batches), (self.path(m.name) / "corpus.json").stat().st_size))

    CorpusStore._write_manifest = counted
    per_wrote: list[float] = []  # seconds of _Run.wrote per group
    rows = []
    t_run = time.perf_counter()
    with store.hold("c") as m:
        run = lanes._Run(store, m, ["cpu"], None)
        for k in range(args.batches):
            docs, chunks, ids, vecs = make_batch(rng, k, args.docs, args.chunks_per_doc)
            # Positions as _Run.count hands them out: groups start where the previous ones end.
            first = k * args.docs * args.chunks_per_doc
            batch = store.write_batch_files(m, run.base_id + 1 + k, first, docs, chunks, ids, vecs, fingerprint="fp")
            t0 = time.perf_counter()
            run.wrote(k, batch, len(chunks) * 64)
            per_wrote.append(time.perf_counter() - t0)
            b = k + 1
            if b in checkpoints:
                # One manifest write at this size, bare (a copy of the manifest, the real commit path)
                mm = store.read("c")
                mm.batches = list(m.batches)
                t0 = time.perf_counter()
                real_write(store, mm)
                one_write_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                store.read("c")
                read_s = time.perf_counter() - t0
                rows.append(
                    {
                        "groups": b,
                        "segments": b * args.shards,
                        "one_manifest_write_ms": round(1e3 * one_write_s, 1),
                        "manifest_kib": round((store.path("c") / "corpus.json").stat().st_size / 1024, 1),
                        "store_read_ms": round(1e3 * read_s, 1),
                        "manifest_writes_so_far": len(writes),
                        "cumulative_commit_s": round(sum(per_wrote), 2),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
        t0 = time.perf_counter()
        run.flush()  # the run's last groups, committed at its end
        per_wrote.append(time.perf_counter() - t0)
    assert len(store.read("c").batches) == args.batches, "every group committed"
    CorpusStore._write_manifest = real_write
    t0 = time.perf_counter()
    with store.hold("c"):
        pass
    hold_s = time.perf_counter() - t0
    docs, chunks, ids, vecs = make_batch(rng, args.batches + 1, args.docs, args.chunks_per_doc)
    t0 = time.perf_counter()
    store.append("c", docs, chunks, ids, vecs, "fp")
    append_s = time.perf_counter() - t0
    summary = {
        "groups": args.batches,
        "shards": args.shards,
        "manifest_writes": len(writes),
        "total_commit_s": round(sum(per_wrote), 2),
        "lanes_commit_seconds": round(run.stats.commit_seconds, 2),
        "total_manifest_mb_written": round(sum(n for _, n in writes) / 1e6, 1),
        "run_s": round(time.perf_counter() - t_run, 1),
        "hold_entry_ms_at_end": round(1e3 * hold_s, 1),
        "store_append_ms_at_end": round(1e3 * append_s, 1),
        "root": root,
    }
    print(json.dumps(summary), flush=True)
    if args.out:
        result = {"bench": "index_commit_cost", "rows": rows, "summary": summary, "writes": writes}
        write_result(args.out, {**result, "commit_share": lanes.COMMIT_SHARE, **machine_info()})


if __name__ == "__main__":
    main()
