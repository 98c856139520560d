"""``qrag index``: bulk indexing of files into a corpus through Ray Data (local Ray on loopback,
or the cluster of $RAY_ADDRESS); ``jobs/index_corpus.py`` runs the same as a Ray job."""

from __future__ import annotations

import argparse
import json
import sys

from qrag.cli.commands import command


def index_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", required=True, help="corpus name (created when missing; an existing one is appended to)")
    p.add_argument("--input", dest="inputs", action="append", required=True, metavar="PATH_OR_GLOB",
                   help="file, folder, glob or fsspec URL (s3://..., gs://...); repeat for several")
    p.add_argument("--format", default="auto", choices=["auto", "jsonl", "text", "parquet"],
                   help="jsonl ({id, text} per line), text (a document per file, id = file name), parquet (id, text columns); auto = by suffix")
    p.add_argument("--checkpoint", metavar="DIR|URI", help="checkpoint directory or MLflow URI; default: the untrained bundled encoder")
    p.add_argument("--encoder", default="minilm", help="encoder without checkpoint (default minilm)")
    p.add_argument("--storage", default="qrag_indexes", metavar="DIR", help="corpora folder, the one the server uses (default qrag_indexes)")
    p.add_argument("--chunk-tokens", type=int, help="token budget per chunk of a new corpus (default 64)")
    p.add_argument("--shards", type=int, help="shards of a new corpus (default 2)")
    p.add_argument("--dtype", choices=["float32", "float16"], help="vectors on disk of a new corpus (default float32)")
    p.add_argument("--encoder-actors", type=int, default=1, help="encoder actors (a GPU each when the cluster has GPUs)")
    p.add_argument("--encoder-gpus", type=float, help="GPUs per encoder actor (default 1 when the cluster has a GPU, else 0)")
    p.add_argument("--tokenize-actors", type=int, help="most read+tokenise actors (default: the CPUs the encoder actors leave)")
    p.add_argument("--encode-batch", type=int, default=4096, help="chunks per encoder call")
    p.add_argument("--encode-tokens", type=int, default=32768, help="padded tokens per forward pass")
    p.add_argument("--commit-chunks", type=int, default=65536, help="chunks per committed group (a crash loses at most one group)")
    p.add_argument("--file-part-mb", type=float, default=16.0, help="large uncompressed JSONL and parquet files are read and tokenised "
                   "as parts of about this many MiB, one task each (default 16)")
    p.add_argument("--model-cache", default=".qrag_models", help="where MLflow checkpoints are downloaded to")
    p.add_argument("--no-progress", action="store_true", help="no progress line per commit")


def index_config(args: argparse.Namespace):
    from qrag.distributed.bulk_index import BulkIndexConfig  # noqa: PLC0415 (Ray lives under qrag.distributed)

    return BulkIndexConfig(corpus=args.corpus, inputs=args.inputs, format=args.format, checkpoint=args.checkpoint, encoder=args.encoder,
                           model_cache=args.model_cache, storage=args.storage, chunk_tokens=args.chunk_tokens, shards=args.shards,
                           dtype=args.dtype, encoder_actors=args.encoder_actors, encoder_gpus=args.encoder_gpus,
                           tokenize_actors=args.tokenize_actors, encode_batch=args.encode_batch, encode_tokens=args.encode_tokens,
                           commit_chunks=args.commit_chunks, file_part_bytes=max(1, int(args.file_part_mb * 2**20)))


def run_index(args: argparse.Namespace) -> int:
    """Check the input and the model, start or join Ray, index; the last stdout line is JSON."""
    from qrag.distributed.bulk_index import USER_ERRORS, bulk_index, ensure_ray, expand_inputs, print_progress  # noqa: PLC0415
    from qrag.retrieval.embedder import resolve_source  # noqa: PLC0415

    try:
        cfg = index_config(args)
        expand_inputs(cfg.inputs, cfg.format)  # a missing file fails here, before Ray starts
        resolve_source(cfg.checkpoint, cfg.encoder, cfg.model_cache)
        ensure_ray()
        stats = bulk_index(cfg, progress=None if args.no_progress else print_progress)
    except USER_ERRORS as exc:
        print(f"qrag index: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(stats))
    return 0


@command("index", "bulk-index files (JSONL, text, parquet; local or fsspec) into a corpus with Ray Data; resumable")(index_args)
def cmd_index(args: argparse.Namespace) -> int:
    return run_index(args)
