"""``qrag index``: bulk indexing of files into a corpus through Ray Data (local Ray on loopback,
or the cluster of $RAY_ADDRESS); ``jobs/index_corpus.py`` runs the same as a Ray job. With
``--lanes`` it runs without Ray on the GPUs of this machine, a process per GPU
(:mod:`qrag.index.lanes`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from qrag import progress
from qrag.cli.commands import command, progress_option


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
    # Unset, these three take the Ray path's defaults (BulkIndexConfig) or, with --lanes, the lanes'
    # (qrag.index.lanes.LANE_*): the help names them without importing either.
    p.add_argument("--encode-batch", type=int, help="chunks per encoder call (default 4096, with --lanes 8192)")
    p.add_argument("--encode-tokens", type=int, help="padded tokens per forward pass (default 32768, with --lanes 131072)")
    p.add_argument("--commit-chunks", type=int, help="chunks per committed group (a crash loses at most one group; "
                   "default 65536, with --lanes 4096: a group is a lane's unit of work)")
    p.add_argument("--file-part-mb", type=float, default=16.0, help="large uncompressed JSONL and parquet files are read and tokenised "
                   "as parts of about this many MiB, one task each (default 16)")
    p.add_argument("--model-cache", default=".qrag_models", help="where MLflow checkpoints are downloaded to")
    p.add_argument("--lanes", metavar="DEVICES", help="no Ray: index on this machine with a process per device, e.g. cuda:0,cuda:1, "
                   "'gpus' (every GPU) or cpu (qrag.index.lanes; 10M tokens on one H100 at 3.2-3.7M tokens/s against 2.0M "
                   "for one process; 30M on 2 H100s at 6.3-7.6M)")
    p.add_argument("--lanes-per-device", type=int, help="with --lanes: processes feeding each device (default 3 on a GPU: on one "
                   "H100 with 16 cores, 3 lanes of 4 workers 2.8-3.6M tokens/s, 2 x 6 3.0-3.4M, 4 x 3 2.9M; 1 on cpu)")
    p.add_argument("--lane-workers", type=int, help="with --lanes: tokenising processes per lane (default: 3/4 of the cores shared out)")
    progress_option(p)  # without a terminal and without --progress: a line per commit instead of the bar


def index_config(args: argparse.Namespace):
    from qrag.distributed.bulk_index import BulkIndexConfig  # noqa: PLC0415 (Ray lives under qrag.distributed)

    given = {k: v for k, v in (("encode_batch", args.encode_batch), ("encode_tokens", args.encode_tokens),
                               ("commit_chunks", args.commit_chunks)) if v is not None}
    return BulkIndexConfig(corpus=args.corpus, inputs=args.inputs, format=args.format, checkpoint=args.checkpoint, encoder=args.encoder,
                           model_cache=args.model_cache, storage=args.storage, chunk_tokens=args.chunk_tokens, shards=args.shards,
                           dtype=args.dtype, encoder_actors=args.encoder_actors, encoder_gpus=args.encoder_gpus,
                           tokenize_actors=args.tokenize_actors, file_part_bytes=max(1, int(args.file_part_mb * 2**20)), **given)


def run_index(args: argparse.Namespace) -> int:
    """Check the input and the model, start or join Ray, index; the last stdout line is JSON."""
    from qrag.distributed.bulk_index import USER_ERRORS, bulk_index, ensure_ray, expand_inputs, print_progress  # noqa: PLC0415
    from qrag.retrieval.embedder import resolve_source  # noqa: PLC0415

    try:
        cfg = index_config(args)
        files = expand_inputs(cfg.inputs, cfg.format)  # a missing file fails here, before Ray starts
        source = resolve_source(cfg.checkpoint, cfg.encoder, cfg.model_cache)
        with progress.bar(input_documents(files) if progress.configure(args.progress) else None,
                          f"index {args.corpus}", "doc") as shown:
            if args.lanes:
                stats = index_in_lanes_here(args, files, source, on_commit(args, shown, None))
                print(json.dumps(stats))
                return 0
            ensure_ray()
            stats = bulk_index(cfg, progress=on_commit(args, shown, print_progress))
    except USER_ERRORS as exc:
        print(f"qrag index: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(stats))
    return 0


def input_documents(files: list[tuple[str, str]]) -> int | None:
    """Documents in the inputs, the bar's total: None when one is not a local file (counting
    would download it twice)."""
    from fsspec.core import url_to_fs
    from fsspec.implementations.local import LocalFileSystem

    from qrag.distributed.bulk_index import read_records  # readers only: Ray is not imported

    if not all(isinstance(url_to_fs(path)[0], LocalFileSystem) for path, _ in files):
        return None
    return sum(1 for path, fmt in files for _ in read_records(path, fmt))


def on_commit(args: argparse.Namespace, shown, line: Callable[[dict[str, Any]], None] | None) -> Callable[[dict[str, Any]], None] | None:
    """What each commit reports: the bar when it is on; else ``line`` (a log line per commit)
    unless --no-progress. Stats: ``documents`` committed by this run, ``already_committed``."""
    if not progress.enabled():
        return line if args.progress is None else None

    def advance(stats: dict[str, Any]) -> None:
        if shown.total and stats.get("already_committed") and shown.n == 0:
            shown.total = max(stats["documents"], shown.total - stats["already_committed"])  # a resumed run skips those
        shown.update(stats["documents"] - shown.n)
        if stats.get("seconds"):
            shown.set_postfix_str(f"{stats.get('chunks', 0)} chunks, {stats.get('tokens', 0) / stats['seconds']:,.0f} tokens/s")

    return advance


def lane_devices(spec: str, per_device: int | None) -> list[str]:
    """``--lanes`` -> one device name per lane (``per_device`` None: :func:`qrag.index.lanes.lanes_on`'s default)."""
    import torch

    from qrag.data.sample import DataError
    from qrag.index.lanes import lanes_on

    if per_device is not None and per_device < 1:
        raise DataError(f"--lanes-per-device must be at least 1, got {per_device}")
    if spec == "gpus":
        if not torch.cuda.is_available():
            raise DataError("--lanes gpus: this machine has no GPU (pass --lanes cpu)")
        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    else:
        devices = [d.strip() for d in spec.split(",") if d.strip()]
        for d in devices:
            try:
                dev = torch.device(d)
            except RuntimeError:
                raise DataError(f"--lanes: {d!r} is no device (cpu, cuda:0, ...)") from None
            if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
                raise DataError(f"--lanes: {d} is not on this machine")
    if not devices:
        raise DataError("--lanes: no device given")
    return lanes_on(devices, per_device)


def index_in_lanes_here(args: argparse.Namespace, files: list[tuple[str, str]], source,
                        report: Callable[[dict[str, Any]], None] | None = None) -> dict:
    """``qrag index --lanes``: the same corpus as the Ray path (documents the corpus holds are
    skipped, so a rerun after a crash embeds only the rest), on this machine's devices. ``files``:
    (path, format) of the inputs; ``source``: the resolved model; ``report``: the bar's
    :func:`on_commit` (None: a line per commit unless --no-progress)."""
    import functools
    import os
    import time

    from qrag.distributed.bulk_index import read_records  # readers only: Ray is not imported
    from qrag.index.lanes import LANE_CHUNK_BATCH, LANE_COMMIT_CHUNKS, LANE_ENCODE_TOKENS, LaneConfig, commit_chars_for, index_in_lanes
    from qrag.index.local import LocalIndex
    from qrag.index.store import CorpusNotFound, CorpusStore
    from qrag.retrieval.embedder import load_embedding_model

    devices = lane_devices(args.lanes, args.lanes_per_device)
    model = load_embedding_model(source, "cpu")  # fingerprint, dimensions, layout: the lanes load their own copies
    store = CorpusStore(args.storage)
    try:
        m = store.read(args.corpus)
        m.check_settings(chunk_tokens=args.chunk_tokens, shards=args.shards, dtype=args.dtype)
    except CorpusNotFound:
        m = LocalIndex(store, model).create(args.corpus, chunk_tokens=args.chunk_tokens or 64, shards=args.shards or 2,
                                            dtype=args.dtype or "float32")
    workers = args.lane_workers or max(1, (os.cpu_count() or 2) * 3 // 4 // len(devices))
    batch = args.encode_batch or LANE_CHUNK_BATCH
    cfg = LaneConfig(store_root=str(store.root), name=args.corpus,
                     make_model=functools.partial(load_embedding_model, source, encode_tokens=args.encode_tokens or LANE_ENCODE_TOKENS,
                                                  chunk_batch=batch),
                     tokenizer_dir=source.tokenizer_dir, layout=model.layout, chunk_tokens=m.chunk_tokens, workers=workers,
                     chunk_batch=batch)
    docs = (doc for path, fmt in files for _, doc in read_records(path, fmt))
    t0 = time.perf_counter()
    before = m.documents

    def committed(man) -> None:
        if report is not None:
            report({"documents": man.documents - before, "already_committed": before, "chunks": man.chunks})
        elif args.progress is None:
            print(f"qrag index: {man.name}: {man.documents - before} documents, {man.chunks} chunks in the corpus, "
                  f"{time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)

    commit_chars = commit_chars_for(args.commit_chunks or LANE_COMMIT_CHUNKS, m.chunk_tokens)
    m, stats = index_in_lanes(store, args.corpus, docs, cfg, devices, commit_chars=commit_chars,
                              resume=True, on_commit=committed)
    return {"corpus": m.summary(), "lanes": stats.summary(), "seconds": round(time.perf_counter() - t0, 3),
            "tokens_per_s": round(stats.encoder_tokens / stats.seconds) if stats.seconds else 0}


@command("index", "bulk-index files (JSONL, text, parquet; local or fsspec) into a corpus with Ray Data; resumable")(index_args)
def cmd_index(args: argparse.Namespace) -> int:
    return run_index(args)
