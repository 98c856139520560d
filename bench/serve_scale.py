"""Scale of the serving path (library, no Ray/FAISS/MLflow needed): index a corpus of N tokens
(default 10M, ~156K chunks of 64 tokens) built from the Gutenberg novels, then time retrieval.

Reports, as one JSON line (and ``--out`` file):
* indexing tokens/s end to end (text -> sentence-aligned chunks -> token ids -> vectors ->
  checksummed shard files; CPU text work in ``--workers`` processes overlapping the GPU), next
  to the bare encoder's forward tokens/s on the same padded batches (model calls only);
* p50/p99 latency of ``--steps``-step retrieval at concurrency 1 (with per-stage means);
* throughput at concurrency B (B questions searched in lockstep in one process: one state-encoder
  call and one scoring pass over the shards per step, as Serve's @serve.batch does across requests),
  p50/p99 per batch, and the highest throughput whose p99 stays under ``--p99-ms``;
* vectors bytes and GPU memory per shard.

Three paths on the same corpus, questions and process, one after the other: ``baseline`` (eager
state encoder, blocked eager scoring, shards one by one), ``per_shard`` (CUDA-graph states and
fused scoring, each shard with its own host syncs), ``one_pass`` (the same, all shards of the device
scored in one pass with one device-to-host copy per step, ``ShardOptions.batched``) and the serving
path reported at the top level (the same step replayed from a CUDA graph, ``ShardOptions.graphs``).

CPU check:  python bench/serve_scale.py --tokens 200000 --queries 20
GPU (lead): see the report; needs only torch, transformers, numpy, safetensors on the machine.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_common import machine_info, write_result  # noqa: E402
from qrag.config import SearchConfig  # noqa: E402
from qrag.data.documents import Document, unpack_chunks  # noqa: E402
from qrag.data.haystack import book_files, read_document  # noqa: E402 - the books BabiLong reads, read alike
from qrag.data.sample import DataError  # noqa: E402
from qrag.retrieval.embedder import EmbeddingModel, load_embedding_model, resolve_source  # noqa: E402
from qrag.model.encoder import _bucket, autocast_for, resolve_encoder, split_ratio_for  # noqa: E402
from qrag.index import tokenise_workers  # noqa: E402
from qrag.index.lanes import CHARS_PER_TOKEN, LANE_COMMIT_CHUNKS, LANE_WORKER_NICE, commit_chars_for, lanes_on  # noqa: E402
from qrag.index.local import LocalIndex  # noqa: E402
from qrag.index.pipeline import Group, GroupBuilder, index_groups  # noqa: E402
from qrag.index.shards import ShardOptions  # noqa: E402
from qrag.model.state_graphs import shape_keyed  # noqa: E402
from qrag.index.store import CorpusStore  # noqa: E402


def args_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--corpus",
        default=None,
        help="folder (searched recursively) or glob of .txt/.txt.gz books; default $QRAG_DATA_DIR/gutenberg_novels",
    )
    ap.add_argument(
        "--tokens", type=int, default=10_000_000, help="corpus size in tokens (books in name order, the last one cut)"
    )
    ap.add_argument("--chunk-tokens", type=int, default=64)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument(
        "--checkpoint",
        default=None,
        help="a checkpoint dir (its positions mode is used); default: the untrained encoder",
    )
    ap.add_argument("--encoder", default="minilm", help="encoder without checkpoint: 'minilm' or a HF directory")
    ap.add_argument(
        "--positions",
        default="relative",
        choices=["none", "absolute", "relative"],
        help="positions of the untrained encoder (relative = the exact rotated scoring path)",
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--devices",
        default=None,
        help="several GPUs, e.g. cuda:0,cuda:1: indexing embeds commit groups on each (a model "
        "replica per device, groups round robin, committed in order) and shard s is held on device s %% n; the bare "
        "forward is timed on the first (the share reported is of n times it)",
    )
    ap.add_argument(
        "--bare-repeats",
        type=int,
        default=3,
        help="passes of the bare forward timed after indexing (the median is reported)",
    )
    ap.add_argument(
        "--bare-tokens",
        type=int,
        default=50_000_000,
        help="the bare forward runs on the corpus's first chunks up to this many tokens (all of a smaller corpus)",
    )
    ap.add_argument(
        "--variants",
        default="baseline,per_shard,one_pass,optimized",
        help="query paths timed (the serving path is 'optimized'; the others are earlier rounds' paths)",
    )
    ap.add_argument("--chunk-batch", type=int, default=8192, help="chunks per encoder call while indexing")
    ap.add_argument("--encode-tokens", type=int, default=131072, help="padded tokens per encoder forward")
    ap.add_argument(
        "--commit-chunks",
        type=int,
        default=None,
        help="chunks per committed batch (whole books; default 16384, with --lanes "
        "qrag.index.lanes.LANE_COMMIT_CHUNKS); 1 = one batch per book (the old bench)",
    )
    ap.add_argument("--depth", type=int, default=2, help="groups queued between the pipeline's stages")
    ap.add_argument("--sequential", action="store_true", help="the same groups, stages one after another (no overlap)")
    ap.add_argument(
        "--workers",
        type=int,
        default=max(1, min(16, (os.cpu_count() or 2) * 3 // 4)),
        help="processes for chunking and tokenising (default 3/4 of the cores: on 16 cores 12 indexed 10M tokens at "
        "1.91-1.96M tokens/s against 1.62-1.70M with 15, whose main process then lacked cores; "
        "bench/results/index_contention_workers_h100/)",
    )
    ap.add_argument(
        "--doc-tokens",
        type=int,
        default=32768,
        help="books are cut at line ends into documents of about this many tokens "
        "(one tokenising job each: 15 processes stay busy on ~40 books only with smaller jobs); "
        "0 = one document per book",
    )
    ap.add_argument(
        "--host-threads",
        type=int,
        default=1,
        help="torch's CPU threads in this process while it feeds the GPU "
        "(qrag.index.pipeline's default, 1); 0 = leave torch's default (one per core)",
    )
    ap.add_argument(
        "--switch-ms",
        type=float,
        default=0.2,
        help="the GIL's switch interval in this process while it feeds the GPU "
        "(qrag.index.pipeline's default, 0.2 ms: the feeding thread gets the GIL back sooner after each torch op); "
        "0 = Python's 5 ms",
    )
    ap.add_argument(
        "--no-chunk-graphs",
        action="store_true",
        help="embed chunks eagerly on a GPU (the default replays CUDA graphs "
        "of the chunk encoder: one launch per batch, qrag.model.state_graphs)",
    )
    ap.add_argument(
        "--tokenise-via-transformers",
        action="store_true",
        help="workers tokenise through transformers' tokenizer call "
        "(the baseline; the default calls the Rust tokenizer's encode_batch_fast, the same ids, twice as fast)",
    )
    ap.add_argument(
        "--writer",
        choices=["thread", "process"],
        default="process",
        help="where the pipeline writes the store: a child "
        "process (qrag.index.writer_process: this process's GIL is left to gathering and feeding; "
        "2.15M tokens/s against 1.76-2.11M for the thread, bench/results/index_contention_packed_h100/) "
        "or a thread of the GPU-feeding process",
    )
    ap.add_argument(
        "--no-word-cache",
        action="store_true",
        help="workers tokenise every sentence through the Rust tokenizer "
        "(the default looks ASCII words up in a cache of their WordPiece ids: qrag.data.word_cache, the same ids)",
    )
    ap.add_argument(
        "--worker-output",
        choices=["packed", "objects"],
        default="packed",
        help="how workers hand back a document's chunks: "
        "a few flat objects (qrag.data.documents.pack_chunks) or, the earlier rounds' way, "
        "DocumentChunks and token arrays one by one",
    )
    ap.add_argument(
        "--lanes",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="index with processes per device "
        "(qrag.index.lanes, as qrag index --lanes: each lane its own tokenising workers, GPU feeding and file writes; "
        "this process commits in order) or, --no-lanes, in this process feeding every device (default: lanes on GPUs, "
        "one process on the CPU)",
    )
    ap.add_argument(
        "--lanes-per-device",
        type=int,
        default=0,
        help="lanes on each device (--lanes; default as qrag index --lanes: 3 on "
        "a GPU, 1 on the CPU): more than one feeds a GPU from several processes, each with its own GIL",
    )
    ap.add_argument(
        "--lane-workers",
        type=int,
        default=0,
        help="tokenising processes per lane (default: --workers shared out among the lanes)",
    )
    ap.add_argument(
        "--worker-nice",
        type=int,
        default=None,
        help="scheduling niceness of the worker processes (e.g. 10: the main process's "
        "GPU-feeding thread gets a core first when every core is tokenising; default 0, "
        "with --lanes qrag.index.lanes.LANE_WORKER_NICE)",
    )
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--queries", type=int, default=200, help="questions timed at concurrency 1")
    ap.add_argument(
        "--batches", default="1,2,4,8,16,32,64", help="lockstep batch sizes (concurrency) for the throughput curve"
    )
    ap.add_argument("--rounds", type=int, default=20, help="batches timed per batch size")
    ap.add_argument("--p99-ms", type=float, default=100.0)
    ap.add_argument(
        "--index-only",
        action="store_true",
        help="index, time the bare forward, report the indexing figures and stop (no retrieval)",
    )
    ap.add_argument("--storage", default=None, help="index folder (default: a temporary one)")
    ap.add_argument("--out", default=None, help="also write the JSON here, e.g. bench/results/serve_scale_h100.json")
    ap.add_argument(
        "--random-weights",
        action="store_true",
        help="random-init encoder of --encoder's architecture "
        "(speed figures need no trained weights: carry only its config and tokenizer)",
    )
    ap.add_argument(
        "--plot",
        nargs="+",
        metavar="JSON",
        help="draw p50/p99 and GPU memory against corpus size from result files "
        "(e.g. bench/results/serve_scale_{1m,10m,100m}_h100.json) into --out (a .png), and exit",
    )
    ap.add_argument(
        "--export-encoder",
        metavar="DIR",
        help="write the bundled MiniLM (config, tokenizer, fp16 weights ~46 MB) to carry to a GPU machine, and exit",
    )
    return ap


def export_encoder(target: str) -> None:
    from transformers import AutoModel, AutoTokenizer

    src = resolve_encoder("minilm")
    model = AutoModel.from_pretrained(src)
    model.half().save_pretrained(target, safe_serialization=True)
    # Half the bytes on disk, but loaded as float32 like the bundled encoder (bf16 autocast on GPU).
    config = json.loads((Path(target) / "config.json").read_text())
    config["dtype"] = "float32"
    (Path(target) / "config.json").write_text(json.dumps(config, indent=2))
    AutoTokenizer.from_pretrained(src).save_pretrained(target)
    print(
        json.dumps({"exported": target, "bytes": sum(p.stat().st_size for p in Path(target).rglob("*") if p.is_file())})
    )


def random_weights_model(source, args) -> EmbeddingModel:
    """The encoder's architecture with random weights: same shapes, same speed."""
    from transformers import AutoConfig, AutoModel

    from qrag.retrieval.embedder import untrained_model_cfg
    from qrag.model.encoder import load_tokenizer, pick_device
    from qrag.model.qnet import QNetwork
    from qrag.data.tokens import TokenLayout

    path = resolve_encoder(args.encoder)
    torch.manual_seed(0)
    encoder = AutoModel.from_config(
        AutoConfig.from_pretrained(path)
    )  # transformers picks SDPA where the architecture has it
    model_cfg = untrained_model_cfg(args.encoder, args.positions)
    dev = pick_device(args.device)
    qnet = QNetwork.from_pretrained(encoder, model_cfg, use_target=False).to(dev)
    tokenizer = load_tokenizer(path)
    return EmbeddingModel(
        qnet,
        tokenizer,
        TokenLayout.from_tokenizer(tokenizer, model_cfg.max_state_tokens),
        dev,
        "random-weights",
        source,
        args.encode_tokens,
        64,
        args.chunk_batch,
    )


# -- worker processes: text -> chunks -> token ids ------------------------------------------------

_PACKED = True


def _init_worker(
    tokenizer_dir: str,
    layout,
    question_tokens: int,
    nice: int = 0,
    via_transformers: bool = False,
    packed: bool = True,
    word_cache: bool = True,
) -> None:
    global _PACKED
    tokenise_workers.init_worker(tokenizer_dir, layout, question_tokens, nice)
    _PACKED = packed
    if not word_cache:  # every sentence through the Rust tokenizer (the rounds before qrag.data.word_cache)
        tokenise_workers.tokenization().__dict__["_word_cache"] = None
    if (
        via_transformers
    ):  # the baseline: texts through transformers' tokenizer call, not the Rust backend's encode_batch_fast
        tokenise_workers.tokenization().__dict__["_fast_backend"] = None


def _prepare(job: tuple[str, str | None, str, int]):
    path, text, doc_id, budget = job
    doc = (doc_id, read_document(Path(path)) if text is None else text)
    # Packed: unpickling ~500 DocumentChunks and token arrays one by one per document kept the
    # main process's gathering thread busy (it shares one GIL with the GPU feeder and the writer).
    if _PACKED:
        return doc_id, tokenise_workers.prepare_block([doc], budget)
    return doc_id, tokenise_workers.tokenization().chunk_documents([Document(*doc)], budget)


def book_parts(text: str, part_chars: int) -> list[str]:
    """A book cut at line ends (the books' paragraphs) into parts of at least ``part_chars``
    characters (the last may be shorter); ``part_chars`` 0: the whole book."""
    if part_chars <= 0:
        return [text]
    parts, start = [], 0
    while start < len(text):
        cut = text.find("\n", start + part_chars)
        end = len(text) if cut < 0 else cut + 1
        parts.append(text[start:end])
        start = end
    return parts


def document_jobs(
    files: list[Path], chunk_tokens: int, doc_tokens: int, passes: int = 1000
) -> Iterator[tuple[str, str | None, str, int]]:
    """Tokenising jobs in corpus order, read lazily: whole books (read by the worker), or books
    cut into documents of about ``doc_tokens`` tokens (read here). Books are cycled ``passes``
    times (100M tokens is more text than the shipped books): each pass gets its own ids."""
    for r in range(passes):
        for p in files:
            base = p.name.split(".")[0] + (f"~{r}" if r else "")
            if doc_tokens <= 0:
                yield str(p), None, base, chunk_tokens
                continue
            for k, part in enumerate(book_parts(read_document(p), doc_tokens * CHARS_PER_TOKEN)):
                yield str(p), part, f"{base}#{k}", chunk_tokens


def prepared_groups(
    pool,
    jobs: Iterator[tuple[str, str | None, str, int]],
    workers: int,
    tokens: int,
    commit_chunks: int,
    packed_output: bool = True,
) -> Iterator[Group]:
    """Commit groups of whole documents, in corpus order, of ``jobs`` chunked and tokenised in
    ``pool`` (two jobs per worker in flight: a worker never waits for the next one to be sent),
    until ``tokens`` text tokens (the last document cut there)."""
    builder = GroupBuilder(commit_chunks)
    pending = [pool.submit(_prepare, job) for job in itertools.islice(jobs, 2 * workers)]
    done = 0
    while pending and done < tokens:
        doc_id, packed = pending.pop(0).result()  # documents stay in corpus order
        chunks, ids = unpack_chunks(packed) if packed_output else packed
        job = next(jobs, None)
        if job is not None:
            pending.append(pool.submit(_prepare, job))
        keep = int(np.searchsorted(np.cumsum([c.tokens for c in chunks]), tokens - done) + 1)
        chunks, ids = chunks[:keep], ids[:keep]
        done += sum(c.tokens for c in chunks)
        group = builder.add(Document(doc_id, ""), chunks, ids)
        if group is not None:
            yield group
    for f in pending:
        f.cancel()
    group = builder.flush()
    if group is not None:
        yield group


def index_corpus(index: LocalIndex, model, files: list[Path], args, tokenizer_dir: str) -> dict:
    """Chunk + tokenise books in worker processes; the library pipeline (qrag.index.pipeline)
    embeds one commit group on the device while the next is gathered from the workers and the
    previous one is written and committed on the writer thread (``--sequential``: one after another)."""
    name = "bench"
    index.create(name, chunk_tokens=args.chunk_tokens, shards=args.shards)
    all_ids: list[np.ndarray] = []

    def groups(pool):  # runs on the pipeline's prep thread
        jobs = document_jobs(files, args.chunk_tokens, args.doc_tokens)
        for group in prepared_groups(
            pool, jobs, args.workers, args.tokens, args.commit_chunks, args.worker_output == "packed"
        ):
            all_ids.extend(group.ids)
            yield group

    t0 = time.perf_counter()
    with ProcessPoolExecutor(
        args.workers,
        initializer=_init_worker,
        initargs=(
            tokenizer_dir,
            model.layout,
            64,
            args.worker_nice,
            args.tokenise_via_transformers,
            args.worker_output == "packed",
            not args.no_word_cache,
        ),
    ) as pool:
        _, stats = index_groups(
            index.store,
            name,
            model,
            groups(pool),
            chunk_batch=args.chunk_batch,
            pipelined=not args.sequential,
            depth=args.depth,
            host_threads=args.host_threads or None,
            switch_s=args.switch_ms / 1000 if args.switch_ms else None,
            writer=args.writer,
            replicas=index.replicas,
        )
    wall = time.perf_counter() - t0
    m = index.store.read(name)
    st = stats.summary()
    return {
        "name": name,
        "chunks": stats.chunks,
        "text_tokens": stats.tokens,
        "encoder_tokens": stats.encoder_tokens,
        "documents": m.documents,
        "seconds": wall,
        "embed_seconds": stats.embed_seconds,
        "store_seconds": stats.write_seconds,
        "indexing_tokens_per_s": stats.encoder_tokens / wall,
        "embed_only_tokens_per_s": stats.encoder_tokens / max(stats.embed_seconds, 1e-9),
        "bytes_on_disk": index.store.disk_bytes(name),
        "ids": all_ids,
        "stages": {
            "pipelined": stats.pipelined,
            "depth": stats.depth,
            "commits": stats.commits,
            "commit_chunks": args.commit_chunks,
            "pipeline_seconds": st["seconds"],
            "prep_busy_seconds": st["prep_seconds"],
            "embed_busy_seconds": st["embed_seconds"],
            "write_busy_seconds": st["write_seconds"],
            "embed_waiting_for_prep_seconds": st["embed_waiting_for_prep"],
            "embed_waiting_for_writer_seconds": st["embed_waiting_for_writer"],
            "writer_waiting_for_embed_seconds": st["writer_waiting_for_embed"],
            "devices": st["devices"],
            "busy_over_wall": st["overlap"],
            "note": "busy seconds of each stage; pipelined they overlap (busy_over_wall > 1). prep = the main process "
            "gathering the workers' chunks + token ids (the workers' own CPU time is not counted)",
        },
    }


def lane_model(device: str, source, args) -> EmbeddingModel:
    """A lane's model (qrag.index.lanes spawns a process per device and builds its model there)."""
    lane_args = argparse.Namespace(**{**vars(args), "device": device})
    if args.random_weights:
        model = random_weights_model(source, lane_args)
    else:
        model = load_embedding_model(
            source,
            device,
            positions=None if args.checkpoint else args.positions,
            encode_tokens=args.encode_tokens,
            chunk_batch=args.chunk_batch,
        )
    if args.no_chunk_graphs:
        model.chunk_encoder = None
    return model


def lane_documents(files: list[Path], args) -> Iterator[Document]:
    """The books cut into documents as for the one-process path, until about ``--tokens`` tokens
    (by characters: a lane run does not see token counts before it embeds)."""
    chars = 0
    for _, text, doc_id, _ in document_jobs(files, args.chunk_tokens, max(args.doc_tokens, 1)):
        if chars >= args.tokens * CHARS_PER_TOKEN:
            return
        chars += len(text)
        yield Document(doc_id, text)


def stored_token_ids(store: CorpusStore, name: str, limit_tokens: int | None = None) -> list[np.ndarray]:
    """The chunks' token ids from the corpus's files (the bare forward's input after a lane run), in
    corpus order: every chunk, or the committed batches up to about ``limit_tokens`` tokens."""
    m = store.read(name)
    rows: dict[int, np.ndarray] = {}
    tokens = 0
    for batch in m.batches:
        for s in range(m.shards):
            seg, problem = store.read_segment(m, s, batch)
            if problem is not None:
                raise RuntimeError(str(problem))
            rows.update(zip(seg.positions.tolist(), seg.tokens))
            tokens += sum(len(t) for t in seg.tokens)
        if limit_tokens is not None and tokens >= limit_tokens:
            break
    return [rows[p] for p in sorted(rows)]


def bare_sample(ids: list[np.ndarray], limit_tokens: int) -> list[np.ndarray]:
    """The first chunks up to ``limit_tokens`` tokens: a rate needs no more, and padding a billion
    tokens' batches on the device would cost more GPU memory and time than the indexing."""
    total = 0
    for i, seq in enumerate(ids):
        total += len(seq)
        if total >= limit_tokens:
            return ids[: i + 1]
    return ids


class CommitProgress:
    """Commits so far on stderr every ``every_s`` seconds: a run stopped by its call's time limit
    still says how far and how fast it got."""

    def __init__(self, every_s: float = 15.0):
        self.every_s = every_s
        self.t0 = self.last = time.perf_counter()

    def __call__(self, manifest) -> None:
        now = time.perf_counter()
        if now - self.last < self.every_s:
            return
        self.last = now
        tokens = manifest.tokens
        print(
            f"serve_scale: {manifest.chunks} chunks (~{tokens / 1e6:.0f}M tokens) committed in {now - self.t0:.0f} s "
            f"(~{tokens / (now - self.t0) / 1e6:.2f}M tokens/s with start-up)",
            file=sys.stderr,
            flush=True,
        )


def index_corpus_in_lanes(index: LocalIndex, model, files: list[Path], args, tokenizer_dir: str, source) -> dict:
    """``--lanes``: one process per device (qrag.index.lanes), the same corpus as index_corpus."""
    from qrag.index.lanes import LaneConfig, index_in_lanes

    name = "bench"
    index.create(name, chunk_tokens=args.chunk_tokens, shards=args.shards)
    devices = lanes_on([str(d) for d in index.devices], args.lanes_per_device or None)
    per_device = len(devices) // len(index.devices)
    workers = args.lane_workers or max(1, args.workers // len(devices))
    cfg = LaneConfig(
        store_root=str(index.store.root),
        name=name,
        make_model=functools.partial(lane_model, source=source, args=args),
        tokenizer_dir=tokenizer_dir,
        layout=model.layout,
        chunk_tokens=args.chunk_tokens,
        workers=workers,
        chunk_batch=args.chunk_batch,
        depth=args.depth,
        worker_nice=args.worker_nice,
        block_chars=max(1, args.doc_tokens) * CHARS_PER_TOKEN,
    )
    commit_chars = commit_chars_for(args.commit_chunks, args.chunk_tokens)
    _, stats = index_in_lanes(
        index.store,
        name,
        lane_documents(files, args),
        cfg,
        devices,
        commit_chars=commit_chars,
        on_commit=CommitProgress(),
    )
    m = index.store.read(name)
    st = stats.summary()
    embed_s = max((row["embed_seconds"] for row in stats.per_lane), default=0.0)
    write_s = max((row["write_seconds"] for row in stats.per_lane), default=0.0)
    return {
        "name": name,
        "chunks": stats.chunks,
        "text_tokens": stats.tokens,
        "encoder_tokens": stats.encoder_tokens,
        "documents": m.documents,
        "seconds": stats.seconds,
        "embed_seconds": embed_s,
        "store_seconds": write_s,
        "indexing_tokens_per_s": stats.encoder_tokens / stats.seconds,
        "embed_only_tokens_per_s": stats.encoder_tokens / max(embed_s * len(index.devices), 1e-9),
        "bytes_on_disk": index.store.disk_bytes(name),
        "ids": stored_token_ids(index.store, name, args.bare_tokens),
        "stages": {
            "pipelined": True,
            "lanes": len(devices),
            "lanes_per_device": per_device,
            "workers_per_lane": workers,
            "commits": stats.commits,
            "commit_chars": commit_chars,
            "startup_seconds": st["startup_seconds"],
            "total_seconds": st["total_seconds"],
            "lane_startup": st["lane_startup"],
            "commit_seconds": st["commit_seconds"],
            "per_lane": st["per_lane"],
            "note": "seconds: every lane ready (model loaded, workers up; groups are sent from then) "
            "to the last commit; "
            "startup_seconds: spawn to every lane ready; total_seconds: spawn to the last commit; "
            "per_lane: each lane's pipeline stages (busy seconds, as for the one-process path)",
        },
    }


def chunk_graph_info(model) -> dict | None:
    """How the chunks were embedded: CUDA-graph replays, shapes captured, shapes that fell back."""
    graphed = getattr(model, "chunk_encoder", None)
    if graphed is None:
        return None
    return {
        "replays": graphed.replays,
        "eager_calls": graphed.eager_calls,
        "shapes": [f"{b}x{n}" for b, n in graphed.captured_shapes],
        "fallbacks": shape_keyed(graphed.fallbacks),
    }


def serving_path_report(graphs, variants: dict[str, dict], answers: dict[str, list]) -> dict:
    """What the serving path used (graphs, fused and batched scoring, their fallbacks) and whether
    each other path picked the same chunks, as JSON can hold it."""
    from qrag.index.score_graphs import graph_stats
    from qrag.index.shards import _FUSED

    def agree(a: str, b: str) -> float | None:
        if a not in answers or b not in answers:
            return None
        same = [x == y for x, y in zip(answers[a], answers[b])]
        return round(float(np.mean(same)), 4) if same else None

    return {
        "state_graphs": graphs is not None,
        "graph_replays": getattr(graphs, "replays", 0),
        "graph_fallbacks": shape_keyed(getattr(graphs, "fallbacks", {})),
        "fused_scoring": _FUSED.get("fn") is not None,
        "fused_error": _FUSED.get("error"),
        "batched_scoring": True,
        "same_chunks_as_baseline": agree("baseline", "optimized"),
        "same_chunks_as_per_shard": agree("per_shard", "optimized"),
        "same_chunks_as_one_pass": agree("one_pass", "optimized"),
        "score_graphs": graph_stats(),
        "score_ms_per_query": {v: variants[v]["latency_concurrency_1"]["mean_stage_ms"]["score"] for v in variants},
    }


@torch.no_grad()
def bare_forward_tokens_per_s(model, ids: list[np.ndarray], encode_tokens: int, repeats: int = 1) -> list[float]:
    """The action encoder's forward alone on the same length-bucketed batches (padded on the
    device beforehand; no host work timed): tokens/s of each of ``repeats`` passes. One pass
    moved from 3.4M to 4.8M tokens/s between runs of one call (index_contention_packed_h100/)."""
    dev = model.device
    lengths = np.fromiter((len(s) for s in ids), dtype=np.int64, count=len(ids))
    batches = []
    for idx in _bucket(lengths, encode_tokens, ratio=split_ratio_for(dev)):
        width = int(-(-lengths[idx].max() // 8) * 8)
        arr = np.full((len(idx), width), model.layout.pad_id, dtype=np.int64)
        for row, j in enumerate(idx):
            arr[row, : lengths[j]] = ids[j]
        ids_t = torch.from_numpy(arr).to(dev)
        batches.append((ids_t, (ids_t != model.layout.pad_id).long()))
    encoder = model.qnet.action_encoder
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with autocast_for(dev):
        encoder(input_ids=batches[0][0][:8], attention_mask=batches[0][1][:8])  # warm-up
    sync()
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with autocast_for(dev):
            for ids_t, mask in batches:
                encoder(input_ids=ids_t, attention_mask=mask).last_hidden_state.sum()
        sync()
        rates.append(int(lengths.sum()) / (time.perf_counter() - t0))
    return rates


def questions_from(index: LocalIndex, n: int, seed: int = 0) -> list[str]:
    """Questions made of words from random chunks (so they resemble the corpus)."""
    rng = np.random.default_rng(seed)
    cs = index.shards("bench")
    out = []
    for _ in range(n):
        shard = cs.shards[int(rng.integers(len(cs.shards)))]
        words = shard.texts[int(rng.integers(shard.n))].split()
        start = int(rng.integers(max(1, len(words) - 12)))
        out.append("what happened when " + " ".join(words[start : start + 12]))
    return out


def measure_queries(
    index: LocalIndex, questions: list[str], cfg: SearchConfig, args, dev
) -> tuple[dict, list[list[int]]]:
    """Latency at concurrency 1 (per-stage means) and the lockstep throughput curve; the chunks
    each timed question got (to check that the variants agree)."""
    for q in questions[:10]:  # warm-up (kernels, graphs, compilation, allocator)
        index.retrieve("bench", q, cfg)
    gpus = [d for d in index.devices if d.type == "cuda"]
    for d in gpus:
        torch.cuda.reset_peak_memory_stats(d)
    lat, stages, chosen = [], {"tokenize": [], "encode": [], "score": [], "merge": []}, []
    for q in questions[10:]:
        r, _, t = index.retrieve("bench", q, cfg)
        lat.append(t.total)
        chosen.append([s.chunk for s in r.steps])
        for k in stages:
            stages[k].append(getattr(t, k))
    peak = sum(torch.cuda.max_memory_allocated(d) for d in gpus) if gpus else None  # all devices together
    curve = []
    for b in (int(x) for x in args.batches.split(",")):
        times = []
        for r in range(args.rounds + 1):
            qs = [questions[(r * b + i) % len(questions)] for i in range(b)]
            t = time.perf_counter()
            index.retrieve_many("bench", qs, cfg)
            if r:  # the first round warms up this batch shape
                times.append(time.perf_counter() - t)
        curve.append(
            {
                "concurrency": b,
                "p50_ms": percentile_ms(times, 50),
                "p99_ms": percentile_ms(times, 99),
                "queries_per_s": round(b / float(np.mean(times)), 2),
            }
        )
    latency = {
        "steps": args.steps,
        "queries": len(lat),
        "p50_ms": percentile_ms(lat, 50),
        "p99_ms": percentile_ms(lat, 99),
        "mean_stage_ms": {k: round(1000 * float(np.mean(v)), 3) for k, v in stages.items()},
        "peak_gpu_bytes": peak,
    }
    return {"latency_concurrency_1": latency, "throughput_curve": curve}, chosen


def percentile_ms(values: list[float], p: float) -> float:
    return round(float(np.percentile(np.asarray(values) * 1000.0, p)), 3)


def plot_growth(paths: list[str], out: str) -> str:
    """How latency and memory grow with the corpus: one point per result file, every path it timed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted((json.loads(Path(p).read_text()) for p in paths), key=lambda d: d["corpus"]["text_tokens"])
    tokens = [d["corpus"]["text_tokens"] for d in rows]
    fig, (lat, mem) = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("baseline", "per_shard", "one_pass", "serving path"):
        got = [
            (
                t,
                (
                    d["latency_concurrency_1"]
                    if name == "serving path"
                    else d.get(name, {}).get("latency_concurrency_1")
                ),
            )
            for t, d in zip(tokens, rows)
        ]
        got = [(t, r) for t, r in got if r]
        if got:
            (line,) = lat.plot(
                [t for t, _ in got],
                [r["p50_ms"] for _, r in got],
                marker="o",
                label=f"{name} p50" + (" (each file's commit)" if name == "serving path" else ""),
            )
            lat.plot(
                [t for t, _ in got],
                [r["p99_ms"] for _, r in got],
                marker="x",
                ls="--",
                color=line.get_color(),
                label=f"{name} p99",
            )
    lat.set(
        xscale="log",
        yscale="log",
        xlabel="corpus tokens",
        ylabel="ms per 4-step query",
        title="latency at concurrency 1",
    )
    lat.legend(fontsize=7)
    mem.plot(
        tokens,
        [d["latency_concurrency_1"]["peak_gpu_bytes"] / 2**30 for d in rows],
        marker="o",
        label="peak GPU memory",
    )
    mem.plot(
        tokens,
        [sum(s["vector_bytes"] for s in d["shards"]) / 2**30 for d in rows],
        marker="o",
        label="shard memory (vectors + rows)",
    )
    mem.set(xscale="log", yscale="log", xlabel="corpus tokens", ylabel="GiB", title="memory")
    mem.legend(fontsize=7)
    fig.suptitle(", ".join(sorted({f"{d['gpu']} @ {d['commit']}" for d in rows})), fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return out


def indexing_defaults(args, devices: list[torch.device]) -> None:
    """Lanes on GPUs unless told (the way `qrag index --lanes` indexes on one machine), with the
    lanes' defaults where not given; one process on the CPU, with its measured ones."""
    if args.lanes is None:
        args.lanes = all(d.type == "cuda" for d in devices)
    if args.commit_chunks is None:
        args.commit_chunks = LANE_COMMIT_CHUNKS if args.lanes else 16384
    if args.worker_nice is None:
        args.worker_nice = LANE_WORKER_NICE if args.lanes else 0


def main() -> None:
    args = args_parser().parse_args()
    if args.plot:
        print(plot_growth(args.plot, args.out or "serve_scale_growth.png"))
        return
    if args.export_encoder:
        export_encoder(args.export_encoder)
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    devices = [torch.device(d) for d in args.devices.split(",")] if args.devices else None
    if devices:
        args.device = str(devices[0])
    source = resolve_source(args.checkpoint, args.encoder)
    if args.random_weights:
        model = random_weights_model(source, args)
    else:
        model = load_embedding_model(
            source,
            args.device,
            positions=None if args.checkpoint else args.positions,
            encode_tokens=args.encode_tokens,
            chunk_batch=args.chunk_batch,
        )
    dev = model.device
    indexing_defaults(args, devices or [dev])
    tokenizer_dir = source.tokenizer_dir
    storage = args.storage or tempfile.mkdtemp(prefix="qrag_serve_scale_")
    replicas = [model.replica(d) for d in devices[1:]] if devices else []
    if args.no_chunk_graphs:
        for m in (model, *replicas):
            m.chunk_encoder = None
    index = LocalIndex(
        CorpusStore(storage),
        model,
        devices or dev,
        ShardOptions(faiss="never"),
        chunk_batch=args.chunk_batch,
        replicas=replicas,
    )
    try:
        files = book_files(args.corpus)
    except DataError as exc:
        raise SystemExit(f"serve_scale: {exc}") from None

    if args.lanes:
        built = index_corpus_in_lanes(index, model, files, args, tokenizer_dir, source)
    else:
        built = index_corpus(index, model, files, args, tokenizer_dir)
    ids = bare_sample(built.pop("ids"), args.bare_tokens)
    bare_runs = bare_forward_tokens_per_s(model, ids, args.encode_tokens, args.bare_repeats)
    bare = float(np.median(bare_runs))
    head = {
        "bench": "serve_scale",
        **machine_info(),
        "device": str(dev),
        "devices": [str(d) for d in index.devices],
        "model": {
            "source": source.describe(),
            "positions": model.model_cfg.positions,
            "dim": model.dim,
            "fingerprint": model.fingerprint,
            "random_weights": args.random_weights,
        },
        "corpus": {
            "files": len(files),
            "chunk_tokens": args.chunk_tokens,
            "shards": args.shards,
            **{
                k: v
                for k, v in built.items()
                if k in ("chunks", "text_tokens", "encoder_tokens", "documents", "bytes_on_disk")
            },
        },
        "indexing": {
            "seconds": round(built["seconds"], 2),
            "tokens_per_s": round(built["indexing_tokens_per_s"]),
            "embed_only_tokens_per_s": round(built["embed_only_tokens_per_s"]),
            "bare_forward_tokens_per_s": round(bare),
            "bare_forward_runs": [round(r) for r in bare_runs],
            "bare_forward_tokens": int(sum(len(t) for t in ids)),
            "end_to_end_share_of_bare": round(built["indexing_tokens_per_s"] / (bare * len(index.devices)), 3),
            "bare_forward_note": "median of --bare-repeats passes, timed on the first device; "
            "the share is of the device count times it",
            "embed_seconds": round(built["embed_seconds"], 2),
            "store_seconds": round(built["store_seconds"], 2),
            "lanes": args.lanes,
            "workers": args.workers,
            "doc_tokens": args.doc_tokens,
            "host_threads": args.host_threads,
            "switch_ms": args.switch_ms,
            "tokenise_via_transformers": args.tokenise_via_transformers,
            "word_cache": not args.no_word_cache,
            "worker_output": args.worker_output,
            "writer": args.writer,
            "pipelined": built["stages"]["pipelined"],
            "stages": built["stages"],
            "chunk_graphs": chunk_graph_info(model),
            "replica_chunk_graphs": [chunk_graph_info(r) for r in replicas],
        },
    }
    if args.index_only:
        print(json.dumps(head))
        if args.out:
            write_result(args.out, head)
        return

    # Shards on the device: memory per shard.
    gpus = [d for d in index.devices if d.type == "cuda"]
    base = {}
    for d in gpus:
        torch.cuda.synchronize(d)
        base[d] = torch.cuda.memory_allocated(d)
    cs = index.shards("bench")
    per_shard = [
        {"shard": s, "device": str(sh.device), "rows": sh.n, "vector_bytes": sh.nbytes()} for s, sh in cs.shards.items()
    ]
    for d in gpus:
        torch.cuda.synchronize(d)
        on_d = [row for row in per_shard if torch.device(row["device"]) == d]
        for row in on_d:  # the device's growth, shared out among its shards
            row["gpu_bytes_allocated"] = int((torch.cuda.memory_allocated(d) - base[d]) / len(on_d))

    cfg = SearchConfig(max_steps=args.steps)
    questions = questions_from(index, args.queries + 10)
    # The baseline (eager state encoder, blocked eager scoring), the previous serving path
    # (CUDA-graph states, fused scoring, shards one by one) and the serving path (the same, shards
    # batched: one host sync per step) on the same corpus, questions and process.
    graphs = model.state_encoder
    variants = {}
    answers = {}
    for variant in args.variants.split(","):
        model.state_encoder = None if variant == "baseline" else graphs
        index.options.fused = variant != "baseline"
        index.options.batched = variant in ("one_pass", "optimized")
        index.options.graphs = variant == "optimized"
        variants[variant], answers[variant] = measure_queries(index, questions, cfg, args, dev)

    lat_row = variants["optimized"]["latency_concurrency_1"]
    curve = variants["optimized"]["throughput_curve"]
    ok = [c for c in curve if c["p99_ms"] < args.p99_ms]
    serving_path = serving_path_report(graphs, variants, answers)

    result = {
        **head,
        "latency_concurrency_1": lat_row,
        "baseline": variants.get("baseline"),
        "per_shard": variants.get("per_shard"),
        "one_pass": variants.get("one_pass"),
        "serving_path": serving_path,
        "throughput": {
            "method": "in-process lockstep batches of B concurrent questions "
            "(one state-encoder call and one scoring pass over the shards per step)",
            "curve": curve,
            "p99_limit_ms": args.p99_ms,
            "max_queries_per_s_with_p99_under_limit": max((c["queries_per_s"] for c in ok), default=None),
        },
        "shards": per_shard,
    }
    print(json.dumps(result))
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
