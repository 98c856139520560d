"""Bulk indexing through Ray Data (qrag.distributed.bulk_index, what `qrag index` runs) on a corpus
of N tokens built from the Gutenberg novels, next to the bare encoder forward on the same batches.

Writes the books (in name order, the last one cut so the corpus holds about --tokens tokens) as
one JSONL file of documents of about --doc-tokens tokens (read in parts of --file-part-mb, one
task each), or with --format text as text files, one document per book; indexes them on a local
Ray (loopback; every GPU of the machine, one encoder actor per GPU by default), then times the
action encoder's forward alone on the corpus's own chunk token ids (bench/serve_scale.py
bare_forward_tokens_per_s: padded batches already on the device, model calls only). Reports, as
one JSON line (and --out):

* end-to-end tokens/s (files -> chunks -> token ids -> vectors -> committed shard files) and the
  split of the time: read+tokenise (CPU-seconds over the actors), embed (seconds over the encoder
  actors), write (the driver's checksummed, fsynced appends), the driver's wait for the pipeline;
* the bare forward tokens/s of one GPU and the end-to-end share of (bare x encoder actors).

Needs Ray (Data), pyarrow, pandas, torch, transformers; no internet, MLflow or FAISS.
CPU check:  python bench/index_ray.py --tokens 50000 --chunk-tokens 64
GPU:        python bench/index_ray.py --tokens 10000000 --out bench/results/index_ray_h100.json
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_common import machine_info, write_result  # noqa: E402
from qrag.data.sample import DataError  # noqa: E402
from qrag.distributed.bulk_index import BulkIndexConfig, bulk_index, ensure_ray  # noqa: E402
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
        "--tokens", type=int, default=10_000_000, help="corpus size in tokens (books in name order, the last one cut)"
    )
    ap.add_argument("--chunk-tokens", type=int, default=64)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--checkpoint", default=None, help="a checkpoint dir; default: the untrained bundled encoder")
    ap.add_argument("--encoder", default="minilm", help="encoder without checkpoint: 'minilm' or a HF directory")
    ap.add_argument("--encoder-actors", type=int, default=None, help="default: one per GPU (1 without GPU)")
    ap.add_argument("--tokenize-actors", type=int, default=None, help="default: the CPUs the encoder actors leave")
    ap.add_argument("--encode-batch", type=int, default=8192, help="chunks per encoder-actor call")
    ap.add_argument("--encode-tokens", type=int, default=131072, help="padded tokens per forward")
    ap.add_argument("--commit-chunks", type=int, default=65536)
    ap.add_argument(
        "--format",
        default="jsonl",
        choices=["jsonl", "text"],
        help="the input: one JSONL file, or a text file per book",
    )
    ap.add_argument(
        "--doc-tokens",
        type=int,
        default=32768,
        help="jsonl: documents of about this many tokens cut from the books at line ends",
    )
    ap.add_argument(
        "--file-part-mb", type=float, default=16.0, help="jsonl: the file is read as parts of about this many MiB"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    ap.add_argument("--storage", default=None, help="index folder (default: a temporary one, removed at the end)")
    ap.add_argument("--out", default=None, help="also write the JSON here, e.g. bench/results/index_ray_h100.json")
    return ap


def build_input(
    books: list[Path], tokens: int, folder: Path, tokenizer, fmt: str = "text", doc_tokens: int = 32768
) -> dict:
    """Books holding about ``tokens`` tokens (counted with the model's tokenizer) as text files,
    one per book, or as one ``docs.jsonl`` of documents cut from them at line ends."""
    from serve_scale import CHARS_PER_TOKEN, book_parts

    folder.mkdir(parents=True, exist_ok=True)
    total, used, docs = 0, 0, 0
    with open(folder / "docs.jsonl", "w", encoding="utf-8") if fmt == "jsonl" else open(os.devnull, "w") as jsonl:
        for path in books:
            text = read_document(path)
            n = len(tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"])
            if total + n > tokens:
                text = text[: int(len(text) * (tokens - total) / max(n, 1))]
                n = tokens - total
            name = path.name.split(".")[0]
            if fmt == "jsonl":
                for k, part in enumerate(p for p in book_parts(text, doc_tokens * CHARS_PER_TOKEN) if p.strip()):
                    jsonl.write(json.dumps({"id": f"{name}#{k}", "text": part}, ensure_ascii=False) + "\n")
                    docs += 1
            else:
                (folder / f"{name}.txt").write_text(text, encoding="utf-8")
                docs += 1
            total, used = total + n, used + 1
            if total >= tokens:
                break
    if fmt != "jsonl":
        (folder / "docs.jsonl").unlink(missing_ok=True)
    return {
        "books": used,
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
        built = build_input(books, args.tokens, work / "books", tokenizer, args.format, args.doc_tokens)
        built["seconds"] = round(time.perf_counter() - t, 2)

        ensure_ray()
        gpus = int(ray.cluster_resources().get("GPU", 0))
        actors = args.encoder_actors or max(1, gpus)
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
            encoder_actors=actors,
            tokenize_actors=args.tokenize_actors,
            encode_batch=args.encode_batch,
            encode_tokens=args.encode_tokens,
            commit_chunks=args.commit_chunks,
            file_part_bytes=max(1, int(args.file_part_mb * 2**20)),
        )
        stats = bulk_index(cfg)
        store = CorpusStore(storage)
        bytes_on_disk = store.disk_bytes("bench")
        ray.shutdown()  # the encoder actors' GPUs are free again for the bare forward

        model = load_embedding_model(source, "auto", encode_tokens=args.encode_tokens, chunk_batch=args.encode_batch)
        ids = corpus_token_ids(store, "bench")
        bare = float(np.median(bare_forward_tokens_per_s(model, ids, args.encode_tokens, 3)))
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        result = {
            "bench": "index_ray",
            **machine_info(),
            "device": str(model.device),
            "ray": ray.__version__,
            "model": {"source": source.describe(), "dim": model.dim, "fingerprint": model.fingerprint},
            "input": built,
            "corpus": {
                "documents": stats["corpus_documents"],
                "chunks": stats["corpus_chunks"],
                "text_tokens": stats["tokens"],
                "encoder_tokens": stats["encoder_tokens"],
                "chunk_tokens": args.chunk_tokens,
                "shards": args.shards,
                "dtype": args.dtype,
                "bytes_on_disk": bytes_on_disk,
            },
            "pipeline": {
                "encoder_actors": actors,
                "encoder_gpus_each": stats["encoder_gpus"],
                "gpus": gpus,
                "tokenize_actors": args.tokenize_actors or "auto",
                "encode_batch": args.encode_batch,
                "encode_tokens": args.encode_tokens,
                "commit_chunks": args.commit_chunks,
                "commits": stats["commits"],
                "files": stats["files"],
                "read_tasks": stats["parts"],
                "file_part_mb": args.file_part_mb,
            },
            "indexing": {
                "seconds": stats["seconds"],
                "tokens_per_s": stats["tokens_per_s"],
                "encoder_tokens_per_s": stats["encoder_tokens_per_s"],
                "read_tokenize_cpu_seconds": stats["prep_seconds"],
                "embed_actor_seconds": stats["embed_seconds"],
                "write_seconds": stats["write_seconds"],
                "driver_wait_seconds": stats["wait_seconds"],
                "embed_tokens_per_s_per_actor": round(stats["encoder_tokens"] / stats["embed_seconds"])
                if stats["embed_seconds"]
                else None,
                "bare_forward_tokens_per_s": round(bare),
                "end_to_end_share_of_bare": round(stats["encoder_tokens_per_s"] / (bare * actors), 3),
            },
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    if args.out:
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
