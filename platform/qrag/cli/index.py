"""``qrag index``: bulk indexing of files into a corpus, the one command for it (``jobs/index_corpus.py``
runs the same as a Ray job). ``--path auto``, the default: lanes on this machine (every GPU, else
the CPU; :func:`qrag.index.bulk.index_files`, no Ray) unless a Ray cluster address is given; under
one, the lanes on a GPU node of the cluster, or Ray Data on a cluster without GPUs
(:mod:`qrag.distributed.bulk_index`). docs/indexing.md says which path when."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from qrag import progress
from qrag.cli.commands import command, distributed, progress_option

PATHS_TABLE = """\
Which path indexes (--path auto, the default):
  no Ray cluster address ($RAY_ADDRESS, --address)  lanes on this machine: every GPU, else the CPU
  a cluster address, the cluster has GPU nodes      the lanes on one GPU node of the cluster (a Ray task)
  a cluster address, no GPU node                    Ray Data (CPU actors read and tokenise, encoder actors embed)
--path lanes / --path ray force either; --lanes DEVICES runs the lanes here on those devices.
A rerun skips the documents the corpus holds. Which path when: docs/indexing.md."""


def index_args(p: argparse.ArgumentParser) -> None:
    p.epilog = PATHS_TABLE
    p.add_argument("--corpus", required=True, help="corpus name (created when missing; an existing one is appended to)")
    p.add_argument(
        "--input",
        dest="inputs",
        action="append",
        required=True,
        metavar="PATH_OR_GLOB",
        help="file, folder, glob or fsspec URL (s3://..., gs://...); repeat for several",
    )
    p.add_argument(
        "--format",
        default="auto",
        choices=["auto", "jsonl", "text", "parquet"],
        help="jsonl ({id, text} per line), text (a document per file, id = file name), parquet (id, text columns); "
        "auto = by suffix",
    )
    p.add_argument(
        "--checkpoint",
        metavar="DIR|URI",
        help="checkpoint directory or MLflow URI; default: the untrained bundled encoder",
    )
    p.add_argument("--encoder", default="minilm", help="encoder without checkpoint (default minilm)")
    p.add_argument(
        "--storage",
        default="qrag_indexes",
        metavar="DIR",
        help="corpora folder, the one the server uses (default qrag_indexes)",
    )
    p.add_argument("--chunk-tokens", type=int, help="token budget per chunk of a new corpus (default 64)")
    p.add_argument("--shards", type=int, help="shards of a new corpus (default 2)")
    p.add_argument("--dtype", choices=["float32", "float16"], help="vectors on disk of a new corpus (default float32)")
    p.add_argument("--model-cache", default=".qrag_models", help="where MLflow checkpoints are downloaded to")
    p.add_argument(
        "--path",
        default="auto",
        choices=["auto", "lanes", "ray"],
        help="auto (default): see the table below; lanes: the lanes (on a node of the cluster under an address); "
        "ray: Ray Data",
    )
    p.add_argument(
        "--address", metavar="HOST:PORT", help="Ray cluster to index on (default $RAY_ADDRESS; none: this machine)"
    )
    # Unset, these three take the path's defaults (qrag.index.bulk.PATH_DEFAULTS): the help names
    # them without importing it, so that `qrag --help` stays quick.
    p.add_argument("--encode-batch", type=int, help="chunks per encoder call (default 8192 in lanes, 4096 on Ray Data)")
    p.add_argument(
        "--encode-tokens", type=int, help="padded tokens per forward pass (default 131072 in lanes, 32768 on Ray Data)"
    )
    p.add_argument(
        "--commit-chunks",
        type=int,
        help="chunks per group of whole documents, the unit of a commit (a crash loses at most one group, or in "
        "lanes, whose commits hold several groups as the run grows, 1/16 of the groups the run committed; "
        "default 4096 in lanes, where a group is a lane's unit of work, 65536 on Ray Data)",
    )
    progress_option(p)  # without a terminal and without --progress: a line per commit instead of the bar
    lanes = p.add_argument_group(
        "the lanes (qrag.index.lanes: a process per device, each with its own tokenising processes)"
    )
    lanes.add_argument(
        "--lanes",
        metavar="DEVICES",
        help="run the lanes on this machine, on these devices: e.g. cuda:0,cuda:1, "
        "'gpus' (every GPU) or cpu (default with --path auto and no cluster address: gpus, else cpu)",
    )
    lanes.add_argument("--lanes-per-device", type=int, help="lanes feeding each device (default 3 on a GPU, 1 on cpu)")
    lanes.add_argument(
        "--lane-workers", type=int, help="tokenising processes per lane (default: 3/4 of the cores shared out)"
    )
    ray = p.add_argument_group("Ray Data (--path ray, or a cluster without GPU nodes)")
    ray.add_argument(
        "--encoder-actors", type=int, default=1, help="encoder actors (a GPU each when the cluster has GPUs)"
    )
    ray.add_argument(
        "--encoder-gpus", type=float, help="GPUs per encoder actor (default 1 when the cluster has a GPU, else 0)"
    )
    ray.add_argument(
        "--tokenize-actors", type=int, help="most read+tokenise actors (default: the CPUs the encoder actors leave)"
    )
    ray.add_argument(
        "--file-part-mb",
        type=float,
        default=16.0,
        help="large uncompressed JSONL and parquet files are read and tokenised "
        "as parts of about this many MiB, one task each (default 16)",
    )


def index_config(args: argparse.Namespace):
    from qrag.index.bulk import BulkIndexConfig  # noqa: PLC0415 (torch: not for `qrag --help`)

    return BulkIndexConfig(
        corpus=args.corpus,
        inputs=args.inputs,
        format=args.format,
        checkpoint=args.checkpoint,
        encoder=args.encoder,
        model_cache=args.model_cache,
        storage=args.storage,
        chunk_tokens=args.chunk_tokens,
        shards=args.shards,
        dtype=args.dtype,
        path=args.path,
        encode_batch=args.encode_batch,
        encode_tokens=args.encode_tokens,
        commit_chunks=args.commit_chunks,
        lanes=args.lanes,
        lanes_per_device=args.lanes_per_device,
        lane_workers=args.lane_workers,
        encoder_actors=args.encoder_actors,
        encoder_gpus=args.encoder_gpus,
        tokenize_actors=args.tokenize_actors,
        file_part_bytes=max(1, int(args.file_part_mb * 2**20)),
    )


def run_index(args: argparse.Namespace) -> int:
    """Check the input and the model, pick the path, index; the last stdout line is JSON (its
    ``path`` and ``devices`` say where it ran)."""
    from qrag.config import ConfigError  # noqa: PLC0415
    from qrag.data.records import expand_inputs  # noqa: PLC0415
    from qrag.index.bulk import USER_ERRORS, index_files, runs_here  # noqa: PLC0415
    from qrag.retrieval.embedder import resolve_source  # noqa: PLC0415

    try:
        cfg = index_config(args)
        files = expand_inputs(cfg.inputs, cfg.format)  # a missing file fails here, before any lane or Ray starts
        source = resolve_source(cfg.checkpoint, cfg.encoder, cfg.model_cache)
        address = args.address or os.environ.get("RAY_ADDRESS")
        with progress.bar(
            input_documents(files) if progress.configure(args.progress) else None, f"index {args.corpus}", "doc"
        ) as shown:
            report = on_commit(args, shown, print_progress)
            if runs_here(cfg, address):
                stats = index_files(cfg, files, source, report)
            else:
                stats = distributed("bulk_index").index_on_cluster(cfg, address, report)
    except (*USER_ERRORS, ConfigError) as exc:
        print(f"qrag index: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(stats))
    return 0


def input_documents(files: list[tuple[str, str]]) -> int | None:
    """The bar's total: the documents in the inputs, None when one is not a local file."""
    from qrag.data.records import count_documents  # noqa: PLC0415

    return count_documents(files)


def on_commit(
    args: argparse.Namespace, shown, line: Callable[[dict[str, Any]], None] | None
) -> Callable[[dict[str, Any]], None] | None:
    """What each commit reports: the bar when it is on; else ``line`` (a log line per commit)
    unless --no-progress. Stats: ``documents`` committed by this run, ``already_committed``."""
    if not progress.enabled():
        return line if args.progress is None else None

    def advance(stats: dict[str, Any]) -> None:
        if shown.total and stats.get("already_committed") and shown.n == 0:
            shown.total = max(stats["documents"], shown.total - stats["already_committed"])  # a resumed run skips those
        shown.update(stats["documents"] - shown.n)
        if stats.get("seconds"):
            shown.set_postfix_str(
                f"{stats.get('chunks', 0)} chunks, {stats.get('tokens', 0) / stats['seconds']:,.0f} tokens/s"
            )

    return advance


def print_progress(stats: dict[str, Any]) -> None:
    """A commit as one line on stderr (a job's log)."""
    print(
        f"qrag index: {stats['corpus']}: +{stats['documents']} documents, +{stats['chunks']} chunks, "
        f"{stats['tokens']} tokens "
        f"in {stats['seconds']:.1f}s ({stats['tokens'] / max(stats['seconds'], 1e-9):,.0f} tokens/s), "
        f"{stats['commits']} commits",
        file=sys.stderr,
        flush=True,
    )


@command(
    "index",
    "bulk-index files (JSONL, text, parquet; local or fsspec) into a corpus: lanes on this machine, or on a Ray "
    "cluster; resumable",
)(index_args)
def cmd_index(args: argparse.Namespace) -> int:
    return run_index(args)
