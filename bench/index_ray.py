"""Bulk indexing the way ``qrag index --address`` runs it on a Ray cluster
(qrag.distributed.bulk_index.index_on_cluster) on a corpus of N tokens built from the Gutenberg
novels, next to the bare encoder forward on the same chunks.

Which path runs is what qrag.index.bulk.cluster_path picks for ``--path`` (the same option as
``qrag index --path``):

* ``auto`` (the default): the lanes when the cluster has a GPU node, else Ray Data;
* ``lanes``: the lanes (qrag.index.lanes, a process per device) as one Ray task holding every GPU
  of the node (on the CPU without one), as index_on_cluster starts them;
* ``ray``: the Ray Data pipeline (qrag.distributed.bulk_index.bulk_index: read+tokenise actors,
  one encoder actor per GPU by default, the driver writing).

Writes the books (in name order, the last one cut so the corpus holds about --tokens tokens;
when the books hold fewer tokens, they are written again, pass after pass, each document of a
later pass with its own id, e.g. ``name#3~pass2``: identical text, which makes no difference to
a throughput measurement) as one JSONL file of documents of about --doc-tokens tokens (read in
parts of --file-part-mb, one task each on Ray Data), or with --format text as text files, one
document per book and pass. Indexes them on a local Ray (bound to loopback; $RAY_ADDRESS, when
set, is joined instead, as ensure_ray does), shuts Ray down, then times the action encoder's
forward alone on one device on the corpus's own chunk token ids (bench/serve_scale.py
bare_forward_tokens_per_s: padded batches already on the device, model calls only). Reports, as
one JSON line (and --out):

* ``path``: the path that ran; ``corpus``: documents, chunks, text and encoder tokens;
* ``indexing``: for either path the run's own end-to-end seconds, the lanes' startup (spawn to
  every lane ready; null on Ray Data, which does not report it), encoder tokens/s end to end and
  after the startup, the bare forward tokens/s of one device, and the shares of (bare x devices
  used: the lanes' distinct devices, or Ray Data's encoder actors); on Ray Data also its split of
  the time (read+tokenise CPU-seconds over the actors, embed seconds over the encoder actors, the
  driver's checksummed, fsynced writes, its wait for the pipeline);
* ``path_stats``: the path's own figures as index_on_cluster returned them (on the lanes:
  the corpus manifest's summary, and each lane's startup and stages).

--encode-batch, --encode-tokens and --commit-chunks left unset take the path's defaults
(qrag.index.bulk.PATH_DEFAULTS), as ``qrag index`` does; ``settings`` records what ran.

Needs Ray (Data), pyarrow, pandas, torch, transformers; no internet, MLflow or FAISS.
CPU check:  python bench/index_ray.py --tokens 50000 --chunk-tokens 64 --path lanes
GPU:        python bench/index_ray.py --tokens 10000000 --out bench/results/index_ray_<machine>.json
Ray Data:   python bench/index_ray.py --tokens 10000000 --path ray --out bench/results/index_ray_data_<machine>.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_common import machine_info, write_result  # noqa: E402
from qrag.data.sample import DataError  # noqa: E402
from qrag.distributed.bulk_index import ensure_ray, index_on_cluster  # noqa: E402
from qrag.index.bulk import PATHS, BulkIndexConfig  # noqa: E402
from qrag.retrieval.embedder import load_embedding_model, resolve_source, source_identity  # noqa: E402
from qrag.index.store import CorpusStore  # noqa: E402

try:  # the books reader of the library (BabiLong's background text)
    from qrag.data.haystack import book_files, read_document  # noqa: E402
except ImportError:  # older library: the same through split_files/read_documents
    from qrag.data.haystack import read_documents, split_files  # noqa: E402

    def book_files(path=None, split="all"):
        from qrag.data.paths import data_root

        return split_files(path if path is not None else data_root() / "gutenberg_novels", split)

    def read_document(path):
        return next(iter(read_documents([path])))


def args_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--books",
        default=None,
        help="folder, file or glob of .txt/.txt.gz books; default $QRAG_DATA_DIR/gutenberg_novels",
    )
    ap.add_argument(
        "--tokens",
        type=int,
        default=10_000_000,
        help="corpus size in tokens (books in name order, the last one cut; "
        "the books again, as further passes with their own ids, while they hold fewer)",
    )
    ap.add_argument(
        "--path",
        default="auto",
        choices=list(PATHS),
        help="as `qrag index --path` under a cluster address: auto (default) runs the lanes when the "
        "local Ray has a GPU, else Ray Data; lanes: the lanes as a Ray task on the node; ray: Ray Data",
    )
    ap.add_argument("--chunk-tokens", type=int, default=64)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--checkpoint", default=None, help="a checkpoint dir; default: the untrained bundled encoder")
    ap.add_argument("--encoder", default="minilm", help="encoder without checkpoint: 'minilm' or a HF directory")
    ap.add_argument(
        "--encode-batch", type=int, default=None, help="chunks per encoder call (default: the path's, as qrag index)"
    )
    ap.add_argument(
        "--encode-tokens",
        type=int,
        default=None,
        help="padded tokens per forward, also the bare forward's (default: the path's, as qrag index)",
    )
    ap.add_argument(
        "--commit-chunks",
        type=int,
        default=None,
        help="chunks per committed group (default: the path's, as qrag index)",
    )
    ap.add_argument("--lanes-per-device", type=int, default=None, help="lanes: lanes per device (default: qrag's)")
    ap.add_argument(
        "--lane-workers", type=int, default=None, help="lanes: tokenising processes per lane (default: qrag's)"
    )
    ap.add_argument(
        "--encoder-actors", type=int, default=None, help="Ray Data: encoder actors; default one per GPU (1 without GPU)"
    )
    ap.add_argument(
        "--tokenize-actors", type=int, default=None, help="Ray Data: default the CPUs the encoder actors leave"
    )
    ap.add_argument(
        "--format",
        default="jsonl",
        choices=["jsonl", "text"],
        help="the input: one JSONL file, or a text file per book and pass",
    )
    ap.add_argument(
        "--doc-tokens",
        type=int,
        default=32768,
        help="jsonl: documents of about this many tokens cut from the books at line ends",
    )
    ap.add_argument(
        "--file-part-mb",
        type=float,
        default=16.0,
        help="jsonl on Ray Data: the file is read as parts of about this many MiB",
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    ap.add_argument("--storage", default=None, help="index folder (default: a temporary one, removed at the end)")
    ap.add_argument("--out", default=None, help="also write the JSON here (a file under bench/results/)")
    return ap


def build_input(
    books: list[Path], tokens: int, folder: Path, tokenizer, fmt: str = "text", doc_tokens: int = 32768
) -> dict:
    """Books holding about ``tokens`` tokens (counted with the model's tokenizer) as text files,
    one per book, or as one ``docs.jsonl`` of documents cut from them at line ends; the last book
    is cut to the budget.

    When the books hold fewer tokens than ``tokens``, they are written again, pass after pass, until
    the budget is reached: a document of pass ``p`` >= 2 has the id of pass 1's with ``~pass{p}``
    appended (jsonl ``name#k~pass2``; text ``name~pass2.txt``), so the corpus holds no duplicate id.
    Its text is the same as pass 1's, which makes no difference to a throughput bench (the chunks
    are tokenised and embedded again all the same; nothing deduplicates them). ``passes`` in the
    result: how many passes were written."""
    from serve_scale import CHARS_PER_TOKEN, book_parts

    folder.mkdir(parents=True, exist_ok=True)
    total, docs, passes = 0, 0, 0
    used: set[Path] = set()
    counts: dict[Path, int] = {}  # each book's tokens, counted once
    with open(folder / "docs.jsonl", "w", encoding="utf-8") if fmt == "jsonl" else open(os.devnull, "w") as jsonl:
        while total < tokens:
            passes += 1
            before = total
            suffix = "" if passes == 1 else f"~pass{passes}"
            for path in books:
                text = read_document(path)
                if path not in counts:
                    counts[path] = len(
                        tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
                    )
                n = counts[path]
                if n == 0:
                    continue
                if total + n > tokens:
                    text = text[: int(len(text) * (tokens - total) / n)]
                    n = tokens - total
                name = path.name.split(".")[0]
                if fmt == "jsonl":
                    for k, part in enumerate(p for p in book_parts(text, doc_tokens * CHARS_PER_TOKEN) if p.strip()):
                        jsonl.write(json.dumps({"id": f"{name}#{k}{suffix}", "text": part}, ensure_ascii=False) + "\n")
                        docs += 1
                else:
                    (folder / f"{name}{suffix}.txt").write_text(text, encoding="utf-8")
                    docs += 1
                total += n
                used.add(path)
                if total >= tokens:
                    break
            if total == before:  # no book holds a token: another pass would add none either
                raise DataError(f"index_ray: the books ({len(books)}) hold no text to index")
    if fmt != "jsonl":
        (folder / "docs.jsonl").unlink(missing_ok=True)
    return {
        "books": len(used),
        "passes": passes,
        "documents": docs,
        "format": fmt,
        "approx_tokens": total,
        "bytes": sum(p.stat().st_size for p in folder.iterdir()),
    }


def corpus_token_ids(store: CorpusStore, name: str) -> list[np.ndarray]:
    m = store.read(name)
    ids = []
    for batch in m.batches:
        for s in range(m.shards):
            seg, problem = store.read_segment(m, s, batch)
            if problem is not None:
                raise SystemExit(f"index_ray: {problem}")
            ids.extend(seg.tokens)
    return ids


def _rate(count: float, seconds: float | None) -> float | None:
    return round(count / seconds, 1) if seconds else None


def _share(rate: float | None, bare: float, devices: int) -> float | None:
    return round(rate / (bare * devices), 3) if rate is not None and bare > 0 and devices > 0 else None


def summarise(stats: dict[str, Any], bare: float) -> dict[str, Any]:
    """Either path's figures (index_on_cluster's return) in one shape: ``path``, ``corpus``
    (documents, chunks, text_tokens, encoder_tokens), ``indexing`` (seconds, startup_seconds, encoder
    tokens/s end to end and after the startup, the bare forward tokens/s of one device and the
    shares of (bare x devices used)) and, per path, its own extra figures (``lanes`` or
    ``pipeline``). Devices used: the lanes' distinct devices; Ray Data's encoder actors."""
    path = stats["path"]
    seconds = stats["seconds"]
    extra: dict[str, Any]
    if path == "lanes":
        lanes, corpus = stats["lanes"], stats["corpus"]
        devices = len(set(stats["devices"]))
        figures = {
            "documents": corpus["documents"],
            "chunks": corpus["chunks"],
            "text_tokens": lanes["tokens"],
            "encoder_tokens": lanes["encoder_tokens"],
        }
        startup = lanes["startup_seconds"]
        after = _rate(lanes["encoder_tokens"], lanes["seconds"])  # every lane ready to the last commit
        extra = {
            "lanes": {
                "devices": stats["devices"],
                "lanes": lanes["lanes"],
                "node": stats.get("node"),
                "commits": lanes["commits"],
                "seconds_after_startup": lanes["seconds"],
                "spawn_to_last_commit_seconds": lanes["total_seconds"],
                "commit_seconds": lanes["commit_seconds"],
            }
        }
    elif path == "ray":
        devices = int(stats["encoder_actors"])
        figures = {
            "documents": stats["corpus_documents"],
            "chunks": stats["corpus_chunks"],
            "text_tokens": stats["tokens"],
            "encoder_tokens": stats["encoder_tokens"],
        }
        startup, after = None, None  # Ray Data reports no startup of its own
        extra = {
            "pipeline": {
                "encoder_actors": devices,
                "encoder_gpus_each": stats["encoder_gpus"],
                "commits": stats["commits"],
                "files": stats["files"],
                "read_tasks": stats["parts"],
            },
            "indexing": {  # Ray Data's split of the time
                "read_tokenize_cpu_seconds": stats["prep_seconds"],
                "embed_actor_seconds": stats["embed_seconds"],
                "write_seconds": stats["write_seconds"],
                "driver_wait_seconds": stats["wait_seconds"],
                "embed_tokens_per_s_per_actor": _rate(stats["encoder_tokens"], stats["embed_seconds"]),
            },
        }
    else:
        raise SystemExit(f"index_ray: index_on_cluster ran an unknown path {path!r}")
    end_to_end = _rate(figures["encoder_tokens"], seconds)
    indexing = {
        "seconds": seconds,
        "startup_seconds": startup,
        "devices_used": devices,
        "tokens_per_s": _rate(figures["text_tokens"], seconds),
        "encoder_tokens_per_s": end_to_end,
        "encoder_tokens_per_s_after_startup": after,
        "bare_forward_tokens_per_s": round(bare),
        "end_to_end_share_of_bare": _share(end_to_end, bare, devices),
        "share_of_bare_after_startup": _share(after, bare, devices),
        **extra.pop("indexing", {}),
    }
    return {"path": path, "corpus": figures, "indexing": indexing, **extra}


def main() -> int:
    args = args_parser().parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray
    import torch

    from serve_scale import bare_forward_tokens_per_s

    source = resolve_source(args.checkpoint, args.encoder)
    _, _, tokenizer, _ = source_identity(source)
    try:
        books = book_files(args.books)
    except DataError as exc:
        raise SystemExit(f"index_ray: {exc}") from None
    work = Path(tempfile.mkdtemp(prefix="qrag_index_ray_"))
    storage = Path(args.storage) if args.storage else work / "indexes"
    try:
        t = time.perf_counter()
        try:
            built = build_input(books, args.tokens, work / "books", tokenizer, args.format, args.doc_tokens)
        except DataError as exc:
            raise SystemExit(str(exc)) from None
        built["seconds"] = round(time.perf_counter() - t, 2)

        ensure_ray()  # a local Ray on 127.0.0.1 (or $RAY_ADDRESS's cluster); index_on_cluster joins it
        gpus = int(ray.cluster_resources().get("GPU", 0))
        cfg = BulkIndexConfig(
            corpus="bench",
            inputs=[str(work / "books")],
            format=args.format,
            checkpoint=args.checkpoint,
            encoder=args.encoder,
            storage=str(storage),
            chunk_tokens=args.chunk_tokens,
            shards=args.shards,
            dtype=args.dtype,
            path=args.path,
            encode_batch=args.encode_batch,
            encode_tokens=args.encode_tokens,
            commit_chunks=args.commit_chunks,
            lanes_per_device=args.lanes_per_device,
            lane_workers=args.lane_workers,
            encoder_actors=args.encoder_actors or max(1, gpus),
            tokenize_actors=args.tokenize_actors,
            file_part_bytes=max(1, int(args.file_part_mb * 2**20)),
        )
        t = time.perf_counter()
        stats = index_on_cluster(cfg, None)  # picks the path as `qrag index --address` does
        driver_seconds = time.perf_counter() - t
        ran = cfg.with_defaults(stats["path"])  # the settings the path ran with
        store = CorpusStore(storage)
        bytes_on_disk = store.disk_bytes("bench")
        ray.shutdown()  # the path's GPUs are free again for the bare forward

        model = load_embedding_model(source, "auto", encode_tokens=ran.encode_tokens, chunk_batch=ran.encode_batch)
        ids = corpus_token_ids(store, "bench")
        bare = float(np.median(bare_forward_tokens_per_s(model, ids, ran.encode_tokens, 3)))
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        summary = summarise(stats, bare)
        summary["indexing"]["driver_seconds"] = round(driver_seconds, 3)  # the bench's wait for index_on_cluster
        settings = {
            "gpus": gpus,
            "encode_batch": ran.encode_batch,
            "encode_tokens": ran.encode_tokens,
            "commit_chunks": ran.commit_chunks,
            "lanes_per_device": args.lanes_per_device or "auto",
            "lane_workers": args.lane_workers or "auto",
            "encoder_actors": cfg.encoder_actors,
            "tokenize_actors": args.tokenize_actors or "auto",
            "file_part_mb": args.file_part_mb,
        }
        if "pipeline" in summary:  # Ray Data: the keys its results have had
            summary["pipeline"].update(
                {k: settings[k] for k in ("gpus", "tokenize_actors", "encode_batch", "encode_tokens", "commit_chunks")},
                file_part_mb=args.file_part_mb,
            )
        result = {
            "bench": "index_ray",
            **machine_info(),
            "device": str(model.device),
            "ray": ray.__version__,
            "path": summary.pop("path"),
            "path_requested": args.path,
            "model": {"source": source.describe(), "dim": model.dim, "fingerprint": model.fingerprint},
            "input": built,
            "corpus": {
                **summary.pop("corpus"),
                "chunk_tokens": args.chunk_tokens,
                "shards": args.shards,
                "dtype": args.dtype,
                "bytes_on_disk": bytes_on_disk,
            },
            "settings": settings,
            **summary,
            "path_stats": stats,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    if args.out:
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
