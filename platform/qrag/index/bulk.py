"""A bulk load of files into a corpus: its settings (:class:`BulkIndexConfig`), the rule that picks
the path it runs on, and that path's default, the lanes on this machine (:func:`index_files`).

Which path (``qrag index --path``; docs/indexing.md has the table):

* ``lanes`` on this machine (:mod:`qrag.index.lanes`, a process per device, no Ray): every GPU
  here, else the CPU. The default without a Ray cluster address ($RAY_ADDRESS or ``--address``).
* under a cluster address, ``auto`` runs the same lanes on one GPU node of the cluster as a Ray
  task that holds that node's GPUs, or, on a cluster without GPU nodes, the Ray Data pipeline
  (:mod:`qrag.distributed.bulk_index`); ``--path lanes`` / ``--path ray`` force either.

Both paths read the inputs through :mod:`qrag.data.records`, skip the documents the corpus holds
(a rerun after a crash embeds only the rest) and make the same corpus. This module imports no Ray.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from qrag.data.records import FORMATS, read_documents
from qrag.data.sample import DataError
from qrag.index.lanes import LANE_CHUNK_BATCH, LANE_COMMIT_CHUNKS, LANE_ENCODE_TOKENS
from qrag.index.store import StoreError
from qrag.model.checkpoint import CheckpointError

PATHS = ("auto", "lanes", "ray")
USER_ERRORS = (DataError, StoreError, CheckpointError)  # a one-line error for the user, not a traceback
# Settings both paths take, left unset (None): each path's own. The lanes stream small groups to
# their device (a group is a lane's unit of work); Ray Data's encoder actors take bigger calls.
PATH_DEFAULTS: dict[str, dict[str, int]] = {
    "lanes": {
        "encode_batch": LANE_CHUNK_BATCH,
        "encode_tokens": LANE_ENCODE_TOKENS,
        "commit_chunks": LANE_COMMIT_CHUNKS,
    },
    "ray": {"encode_batch": 4096, "encode_tokens": 32768, "commit_chunks": 65536},
}


@dataclass
class BulkIndexConfig:
    corpus: str
    inputs: list[str]  # paths, globs, folders or fsspec URLs (s3://..., gs://..., memory://...)
    format: str = "auto"  # jsonl | text | parquet | auto (by file suffix)
    checkpoint: str | None = None  # checkpoint dir or MLflow URI; None = the untrained encoder
    encoder: str = "minilm"
    model_cache: str = ".qrag_models"
    mlflow_tracking_uri: str | None = None
    storage: str = "qrag_indexes"
    chunk_tokens: int | None = None  # None: the corpus's own, 64 for a new corpus
    shards: int | None = None  # None: the corpus's own, 2 for a new corpus
    dtype: str | None = None  # None: the corpus's own, float32 for a new corpus
    path: Literal["auto", "lanes", "ray"] = "auto"  # see the module doc; set lanes make it "lanes"
    # Both paths; None: the path's default (PATH_DEFAULTS)
    encode_batch: int | None = None  # chunks per encoder call
    encode_tokens: int | None = None  # padded tokens per forward pass
    # chunks per group (whole documents); a crash loses at most one group, or with the lanes up to
    # 1/COMMIT_SHARE of the groups the run committed (qrag.index.lanes: later commits hold several groups)
    commit_chunks: int | None = None
    # The lanes
    lanes: str | None = None  # devices on this machine: "cuda:0,cuda:1", "gpus" or "cpu"; None: every GPU, else cpu
    lanes_per_device: int | None = None  # None: qrag.index.lanes.lanes_on's default
    lane_workers: int | None = None  # tokenising processes per lane; None: 3/4 of the cores shared out
    # Ray Data
    encoder_actors: int = 1
    encoder_gpus: float | None = None  # per actor; None = 1 when the cluster has a GPU, else 0
    encoder_cpus: float = 1.0
    tokenize_cpus: float = 1.0
    tokenize_actors: int | None = (
        None  # most read+tokenise actors; None = the CPUs the encoder actors leave (autoscaled from 1)
    )
    docs_per_block: int = 256  # documents chunked and tokenised per tokenizer call (one file part's blocks)
    file_part_bytes: int = (
        16 << 20
    )  # large uncompressed JSONL and parquet files are read as parts of about this size (one task each)
    preserve_order: bool = True
    block_bytes: int | None = None  # Ray Data's target block size for this run; None: Ray Data's own
    max_files: int | None = None  # bench/tests: only the first N files

    def __post_init__(self) -> None:
        if isinstance(self.inputs, str):
            self.inputs = [self.inputs]
        if self.format not in (*FORMATS, "auto"):
            raise DataError(f"format must be one of {', '.join(FORMATS)} or auto, got {self.format!r}")
        if self.path not in PATHS:
            raise DataError(f"path must be one of {', '.join(PATHS)}, got {self.path!r}")
        if self.lanes:
            if self.path == "ray":
                raise DataError("--lanes runs the lanes on this machine; it does not go with --path ray")
            self.path = "lanes"
        for key in (
            "encoder_actors",
            "docs_per_block",
            "encode_batch",
            "encode_tokens",
            "commit_chunks",
            "file_part_bytes",
        ):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise DataError(f"{key} must be at least 1, got {value}")

    def with_defaults(self, path: Literal["lanes", "ray"]) -> BulkIndexConfig:
        """This config with the settings left unset at ``path``'s defaults."""
        return replace(self, **{k: v for k, v in PATH_DEFAULTS[path].items() if getattr(self, k) is None})

    def model_spec(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "encoder": self.encoder,
            "model_cache": self.model_cache,
            "mlflow_tracking_uri": self.mlflow_tracking_uri,
        }


# ---------------------------------------------------------------------------------------------
# Which path


def runs_here(cfg: BulkIndexConfig, address: str | None) -> bool:
    """True: the lanes on this machine, without Ray (``--lanes DEVICES``, or no cluster address
    unless ``--path ray``). False: Ray, the cluster of ``address`` (a local one when None), where
    :func:`cluster_path` picks."""
    return bool(cfg.lanes) or (cfg.path != "ray" and not address)


def cluster_path(cfg: BulkIndexConfig, node_gpus: int) -> Literal["lanes", "ray"]:
    """On a Ray cluster whose largest node has ``node_gpus`` GPUs: the lanes on such a node (auto,
    when it has any), else Ray Data; ``--path`` forces either."""
    if cfg.path == "auto":
        return "lanes" if node_gpus > 0 else "ray"
    return cfg.path


# ---------------------------------------------------------------------------------------------
# The lanes on this machine


def default_lanes() -> str:
    """``--lanes`` unset: every GPU of this machine, else the CPU."""
    import torch

    return "gpus" if torch.cuda.is_available() else "cpu"


def lane_devices(spec: str, per_device: int | None) -> list[str]:
    """``--lanes`` -> one device name per lane (``per_device`` None: :func:`qrag.index.lanes.lanes_on`'s default)."""
    import torch

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


def index_files(
    cfg: BulkIndexConfig,
    files: Sequence[tuple[str, str]],
    source,
    on_commit: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Index ``files`` ((path, format) from :func:`qrag.data.records.expand_inputs`) into corpus
    ``cfg.corpus`` (created when missing) in lanes on this machine's devices (``cfg.lanes``,
    default :func:`default_lanes`). Documents the corpus holds are skipped. ``source``: the resolved
    model. ``on_commit`` gets this run's figures after every commit (the keys of the Ray path's:
    corpus, documents, already_committed, chunks, tokens, commits, seconds). Returns the run's
    figures, ``path`` and ``devices`` first."""
    from qrag.index import lanes as lane_module  # looked up at the call: tests stand a fake index_in_lanes in
    from qrag.index.local import LocalIndex
    from qrag.index.store import CorpusNotFound, CorpusStore
    from qrag.retrieval.embedder import load_embedding_model

    cfg = cfg.with_defaults("lanes")
    devices = lane_devices(cfg.lanes or default_lanes(), cfg.lanes_per_device)
    model = load_embedding_model(source, "cpu")  # fingerprint, dimensions, layout: the lanes load their own copies
    store = CorpusStore(cfg.storage)
    try:
        m = store.read(cfg.corpus)
        m.check_settings(chunk_tokens=cfg.chunk_tokens, shards=cfg.shards, dtype=cfg.dtype)
    except CorpusNotFound:
        m = LocalIndex(store, model).create(
            cfg.corpus, chunk_tokens=cfg.chunk_tokens or 64, shards=cfg.shards or 2, dtype=cfg.dtype or "float32"
        )
    workers = cfg.lane_workers or max(1, (os.cpu_count() or 2) * 3 // 4 // len(devices))
    lane_cfg = lane_module.LaneConfig(
        store_root=str(store.root),
        name=cfg.corpus,
        make_model=functools.partial(
            load_embedding_model, source, encode_tokens=cfg.encode_tokens, chunk_batch=cfg.encode_batch
        ),
        tokenizer_dir=source.tokenizer_dir,
        layout=model.layout,
        chunk_tokens=m.chunk_tokens,
        workers=workers,
        chunk_batch=cfg.encode_batch,
    )
    t0 = time.perf_counter()
    before = (m.documents, m.chunks, m.tokens)
    commits = 0

    def committed(man) -> None:
        nonlocal commits
        commits += 1
        if on_commit is not None:
            on_commit(
                {
                    "corpus": man.name,
                    "documents": man.documents - before[0],
                    "already_committed": before[0],
                    "chunks": man.chunks - before[1],
                    "tokens": man.tokens - before[2],
                    "commits": commits,
                    "seconds": round(time.perf_counter() - t0, 3),
                }
            )

    m, stats = lane_module.index_in_lanes(
        store,
        cfg.corpus,
        read_documents(files),
        lane_cfg,
        devices,
        resume=True,
        on_commit=committed,
        commit_chars=lane_module.commit_chars_for(cfg.commit_chunks, m.chunk_tokens),
    )
    return {
        "path": "lanes",
        "devices": list(dict.fromkeys(devices)),
        "corpus": m.summary(),
        "lanes": stats.summary(),
        "seconds": round(time.perf_counter() - t0, 3),
        "tokens_per_s": round(stats.encoder_tokens / stats.seconds) if stats.seconds else 0,
    }
