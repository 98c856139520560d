"""Training and serving on one Ray cluster of two GPUs (issue 8).

One local Ray cluster (127.0.0.1) runs `jobs/train_hotpot.py` while the Serve app (the same
`qrag.distributed.serving.build_app` that `serve/config.yaml` deploys) serves a 2-shard corpus of
at least 20M tokens, one shard per GPU (GPU fractions from `qrag.distributed.placement`). Steps:

1. build the corpus into --storage with the library (same files and model fingerprint that
   Serve's shards load; Gutenberg novels cycled until --tokens), in a child process;
2. `ray start --head` with the GPUs; train alone (--warmup + --updates updates);
3. deploy Serve with 1 shard deployment (both corpus shards on one GPU), time retrieval;
   redeploy with 2 (one per GPU), time retrieval; record which GPU each replica got;
4. train again while --concurrency clients keep retrieving (closed loop).

Prints one JSON line (and writes --out): training episodes/s alone and under serving load,
retrieval p50/p99 with 1 and 2 shards (idle, HTTP end to end) and during training, placement.

2-GPU machine, from the repository root, in one call that carries .whl (Ray 2.60 and the Serve stack
the GPU image lacks: bench/serve_gpu.sh packs it, and its `wheels` step installs it and runs
`--check-imports`), .carry/minilm16 (an encoder's config and tokenizer, no weights: the run times a
random-init model of MiniLM's shape; with room to spare, carry real weights and set QRAG_ENCODER
instead of --random-encoder), .carry/data (HotpotQA) and a folder of Gutenberg books:
    bash bench/serve_gpu.sh wheels && export PYTHONPATH=/tmp/site \\
      && QRAG_DATA_DIR=.carry/data HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 python3 bench/two_gpu.py \\
           --random-encoder .carry/minilm16 --corpus .carry/novels --out $OUT/two_gpu.json --ray-logs $OUT/raylogs
`--check-imports` names what is still missing.
CPU check (no GPU, tiny sizes; ~15 minutes on 2 busy cores, most of it embedding on the CPU):
    python bench/two_gpu.py --gpus 0 --cpus 3 --tokens 150000 --config configs/smoke.yaml --updates 2 --warmup 1 \\
        --runners 1 --queries 10 --concurrency 2 --corpus-workers 1 learner.episodes_per_update=8 \\
        learner.micro_batch=8 distributed.runner_cpus=0.5
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_common import free_port  # noqa: E402 - light (no torch, no Ray)

CORPUS = "two_gpu"


def corpus_and_ray_args(ap: argparse.ArgumentParser, tokens: int, shards: int) -> None:
    """The options :func:`corpus_in_child` passes on to :func:`build_corpus` (this script's and
    bench/serve_ray.py's), and Ray's head: one set, so the child always understands them."""
    ap.add_argument("--cpus", type=int, default=os.cpu_count(), help="logical CPUs for Ray")
    ap.add_argument(
        "--storage",
        default=None,
        help="corpus folder (default: a temporary one); an existing corpus of enough tokens is reused",
    )
    ap.add_argument(
        "--corpus", default=None, help="folder or glob of .txt/.txt.gz books (default $QRAG_DATA_DIR/gutenberg_novels)"
    )
    ap.add_argument(
        "--tokens",
        type=int,
        default=tokens,
        help=f"corpus size in tokens, books cycled until reached (default {tokens:,})",
    )
    ap.add_argument("--chunk-tokens", type=int, default=64)
    ap.add_argument("--shards", type=int, default=shards, help=f"index shards of the corpus (default {shards})")
    ap.add_argument(
        "--corpus-workers",
        type=int,
        default=max(1, min(12, (os.cpu_count() or 2) - 2)),
        help="processes chunking and tokenising books",
    )
    ap.add_argument(
        "--checkpoint", default=None, help="serve (and index with) this checkpoint; default the untrained encoder"
    )
    ap.add_argument(
        "--random-encoder",
        metavar="DIR",
        default=None,
        help="a folder with an encoder's config.json and tokenizer but no weights (e.g. MiniLM's, ~1 MB): "
        "train and serve a "
        "random-init model of that shape (same speed; fits a small upload); sets QRAG_ENCODER for every process",
    )
    ap.add_argument(
        "--ray-logs",
        metavar="DIR",
        help="copy the tails of Ray's own logs (raylet, GCS, agents, drivers) flat into DIR "
        "when the run ends or fails, e.g. $OUT/raylogs (files deeper than two folders under $OUT do not come back)",
    )
    ap.add_argument(
        "--dashboard",
        action="store_true",
        help="start Ray's dashboard (placement by actor needs its state API; off by "
        "default: with `ray start --block` a dashboard that dies takes the node down, as it did on the GPU image)",
    )


def args_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--gpus", type=int, default=None, help="GPUs for Ray (default: all that torch sees); 0 = a CPU check"
    )
    corpus_and_ray_args(ap, tokens=20_000_000, shards=2)  # 2 shards: one per GPU
    ap.add_argument("--config", default=str(ROOT / "configs" / "hotpot.yaml"), help="training preset")
    ap.add_argument("--updates", type=int, default=30, help="timed updates per training run")
    ap.add_argument("--warmup", type=int, default=3, help="updates left out of the figures")
    ap.add_argument("--runners", type=int, default=4, help="EpisodeFeeders (distributed.runners) of each training run")
    ap.add_argument(
        "--learner-gpus", type=float, default=0.2, help="GPU fraction of the learner (shares GPU 0 with a shard)"
    )
    ap.add_argument("--encoder-gpus", type=float, default=0.2, help="GPU fraction of the Serve encoder")
    ap.add_argument("--steps", type=int, default=2, help="retrieval steps per query")
    ap.add_argument("--queries", type=int, default=200, help="sequential queries timed per shard layout")
    ap.add_argument(
        "--concurrency", type=int, default=8, help="clients retrieving in a loop during the second training run"
    )
    ap.add_argument("--out", help="also write the JSON here, e.g. bench/results/two_gpu.json")
    ap.add_argument(
        "--ray-temp",
        metavar="DIR",
        help="Ray's temp dir; default: inside the run's temporary folder (keep it short: "
        "Ray's Unix sockets live under it)",
    )
    ap.add_argument(
        "--check-imports", action="store_true", help="only report which modules the run needs and lacks, then exit"
    )
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="training config overrides (key=value)")
    return ap


# What the run imports: Ray Train and Serve (with the dashboard's state API), the Serve app's
# HTTP stack, the library's model code. uvloop and httptools come with ray[serve] (uvicorn[standard]):
# Serve's proxy and replicas use them when present, so a run without them times a slower stack than
# users get.
NEEDED = (
    "ray",
    "ray.train.torch",
    "ray.serve",
    "ray.util.state",
    "ray.dashboard.modules.state.state_head",
    "aiohttp_cors",
    "opencensus",
    "fastapi",
    "starlette",
    "uvicorn",
    "uvloop",
    "httptools",
    "pydantic",
    "pyarrow",
    "torch",
    "transformers",
    "safetensors",
    "yaml",
    "qrag.distributed.serving",
    "qrag.distributed.train",
)


def missing_modules() -> dict[str, str]:
    import importlib

    out = {}
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - report every way an import can fail
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def random_encoder(config_dir: str, target: Path) -> str:
    """Weights drawn once (seed 0) and saved, so every process loads the same model."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    torch.manual_seed(0)
    AutoModel.from_config(AutoConfig.from_pretrained(config_dir)).save_pretrained(target, safe_serialization=True)
    AutoTokenizer.from_pretrained(config_dir).save_pretrained(target)
    return str(target)


def percentiles(seconds: list[float]) -> dict:
    ms = sorted(1000 * s for s in seconds)
    if not ms:
        return {"queries": 0}
    pick = lambda q: round(ms[min(len(ms) - 1, int(q * (len(ms) - 1) + 0.5))], 2)  # noqa: E731
    return {"queries": len(ms), "p50_ms": pick(0.5), "p99_ms": pick(0.99), "mean_ms": round(statistics.fmean(ms), 2)}


# -- 1. the corpus (a child process: its CUDA context must not stay on GPU 0) -------------------


def build_corpus(args) -> dict:
    """Index books (cycled, each repeat a new document id) until ``args.tokens``, in ``args.shards`` shards."""
    import numpy as np
    import torch

    from qrag.data.documents import Document, unpack_chunks
    from qrag.retrieval.embedder import load_embedding_model, resolve_source
    from qrag.index.local import LocalIndex
    from qrag.index.shards import ShardOptions
    from qrag.index.store import CorpusStore
    from qrag.data.haystack import book_files
    from serve_scale import _init_worker, _prepare, document_jobs

    store = CorpusStore(args.storage)
    if CORPUS in store.names():
        m = store.read(CORPUS)
        if m.tokens >= args.tokens and m.shards == args.shards:
            return {"reused": True, **m.summary(), "questions": questions_from_store(store)}
        store.delete(CORPUS)
    device = "cuda:0" if args.gpus else "cpu"
    source = resolve_source(args.checkpoint, "minilm")
    # As Serve's Encoder loads it (qrag.distributed.serving), so the fingerprints agree.
    model = load_embedding_model(source, device, chunk_batch=8192, encode_tokens=131072)
    tokenizer_dir = source.tokenizer_dir
    index = LocalIndex(CorpusStore(args.storage), model, model.device, ShardOptions(faiss="never"))
    index.create(CORPUS, chunk_tokens=args.chunk_tokens, shards=args.shards)
    files = book_files(args.corpus)
    jobs = document_jobs(files, args.chunk_tokens, doc_tokens=0)  # whole books, cycled, each repeat with its own ids
    rng = random.Random(0)
    samples: list[str] = []
    tokens = chunks_total = 0
    t0 = time.perf_counter()
    with ProcessPoolExecutor(
        args.corpus_workers, initializer=_init_worker, initargs=(tokenizer_dir, model.layout, 64)
    ) as pool:
        pending = [pool.submit(_prepare, next(jobs)) for _ in range(args.corpus_workers + 1)]
        while tokens < args.tokens:
            doc_id, packed = pending.pop(0).result()
            chunks, ids = unpack_chunks(packed)
            pending.append(pool.submit(_prepare, next(jobs)))
            vectors = np.concatenate([model.embed_chunks(ids[i : i + 8192]) for i in range(0, len(ids), 8192)])
            store.append(CORPUS, [Document(doc_id, "")], chunks, ids, vectors, model.fingerprint)
            tokens += sum(c.tokens for c in chunks)
            chunks_total += len(chunks)
            for c in rng.sample(chunks, min(3, len(chunks))):
                samples.append(c.text)
        for f in pending:
            f.cancel()
    if device != "cpu":
        torch.cuda.synchronize()
    m = store.read(CORPUS)
    return {
        "reused": False,
        **m.summary(),
        "build_seconds": round(time.perf_counter() - t0, 1),
        "questions": make_questions(samples, rng),
    }


def corpus_in_child(args) -> tuple[dict, list[str]]:
    """:func:`build_corpus` in a child process (its CUDA context must not stay on GPU 0): the
    corpus summary and questions drawn from its text."""
    child = subprocess.run(
        [
            sys.executable,
            __file__,
            "--build-only",
            f"--gpus={args.gpus}",
            f"--storage={args.storage}",
            f"--tokens={args.tokens}",
            f"--chunk-tokens={args.chunk_tokens}",
            f"--corpus-workers={args.corpus_workers}",
            f"--shards={args.shards}",
            *([f"--corpus={args.corpus}"] if args.corpus else []),
            *([f"--checkpoint={args.checkpoint}"] if args.checkpoint else []),
        ],
        capture_output=True,
        text=True,
    )
    if child.returncode:
        raise SystemExit(f"building the corpus failed: {child.stderr[-3000:]}")
    corpus = json.loads(child.stdout.strip().splitlines()[-1])
    questions = corpus.pop("questions")
    print(f"corpus {corpus}", file=sys.stderr, flush=True)
    return corpus, questions


def cluster_env() -> dict[str, str]:
    """The environment of the local cluster, its jobs and this driver: one token for Ray's token
    auth, no inherited RAY_ADDRESS, the library on the path."""
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=os.environ.get("RAY_AUTH_TOKEN") or secrets.token_hex(32))
    os.environ.pop("RAY_ADDRESS", None)
    return {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "platform"), os.environ.get("PYTHONPATH")) if p),
    }


def make_questions(texts: list[str], rng: random.Random, n: int = 400) -> list[str]:
    out = []
    for _ in range(n):
        words = rng.choice(texts).split()
        start = rng.randrange(max(1, len(words) - 12))
        out.append("what happened when " + " ".join(words[start : start + 12]))
    return out


def questions_from_store(store) -> list[str]:
    """Questions from the stored chunk texts of a reused corpus (a few batches, both shards)."""
    m = store.read(CORPUS)
    texts = [
        t for batch in m.batches[:20] for shard in range(m.shards) for _, _, t in store.read_texts(m, shard, batch)
    ]
    return make_questions(texts, random.Random(0))


# -- 2. the Ray cluster ---------------------------------------------------------------------------


class RayHead:
    """`ray start --head --block` on 127.0.0.1 in its own process group."""

    def __init__(
        self,
        tmp: Path,
        gpus: int,
        cpus: int,
        env: dict[str, str],
        temp_dir: Path | None = None,
        dashboard: bool = True,
        metrics_port: int | None = None,
    ):
        self.gcs_port, dash = free_port(), free_port()
        while dash in (self.gcs_port, metrics_port):  # a released port can come back at once
            dash = free_port()
        self.env = env
        self.log = open(tmp / "ray_start.log", "w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ray.scripts.scripts",
                "start",
                "--head",
                "--block",
                "--node-ip-address=127.0.0.1",
                f"--port={self.gcs_port}",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={dash}",
                f"--num-cpus={cpus}",
                f"--num-gpus={gpus}",
                f"--temp-dir={temp_dir or tmp / 'ray'}",
                "--disable-usage-stats",
                *([f"--metrics-export-port={metrics_port}"] if metrics_port else []),
                # `--block` takes the whole node down when any Ray process dies, the dashboard included
                *([] if dashboard else ["--include-dashboard=false"]),
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.address = f"127.0.0.1:{self.gcs_port}"
        deadline = time.time() + 180
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.gcs_port)) == 0:
                    break
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"ray start failed: {(tmp / 'ray_start.log').read_text()[-2000:]}")
            time.sleep(1)
        time.sleep(3)  # raylet and dashboard come up just after the GCS

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def train(args, head: RayHead, out_dir: Path, name: str, use_gpu: bool) -> dict:
    """jobs/train_hotpot.py on the cluster; episodes/s from the learner's per-update lines."""
    cmd = [
        sys.executable,
        str(ROOT / "jobs" / "train_hotpot.py"),
        "--address",
        head.address,
        "--config",
        args.config,
        f"name={name}",
        f"out_dir={out_dir}",
        f"updates={args.warmup + args.updates}",
        "eval_every=0",
        "keep_best=false",
        "checkpoint_every=0",
        "eval_limit=50",
        "log_every=1",
        f"distributed.runners={args.runners}",
        "distributed.mlflow_uri=none",
        f"distributed.learner_gpu={'true' if use_gpu else 'false'}",
        f"distributed.learner_gpus={args.learner_gpus}",
        "learner.objective=pqn",  # the paper's learner, as the other training-speed figures
        *args.overrides,
    ]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, env=head.env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if res.returncode:
        raise RuntimeError(f"training failed ({res.returncode}): {(res.stdout + res.stderr)[-3000:]}")
    rows = {}
    for line in (res.stdout + res.stderr).splitlines():
        if '{"update":' in line and "perf/episodes_per_s" in line:
            row = json.loads(line[line.index('{"update":') :])
            rows[row["update"]] = row
    timed = [rows[u] for u in sorted(rows) if u > args.warmup]
    eps = [r["perf/episodes_per_s"] for r in timed]
    return {
        "updates": len(timed),
        "episodes_per_s_median": round(statistics.median(eps), 2) if eps else None,
        "episodes_per_s_mean": round(statistics.fmean(eps), 2) if eps else None,
        "runner_wait_share_last": timed[-1].get("perf/runner_wait_share") if timed else None,
        "job_wall_s": round(wall, 1),
    }


# -- 3. Serve ---------------------------------------------------------------------------------------


def post(url: str, body: dict, timeout: float = 60) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def deploy(args, shards: int, port: int, gpu_count: int) -> str:
    from ray import serve

    from qrag.distributed.placement import gpu_plan_problems, shard_gpu_fraction
    from qrag.serving.service_config import ServeConfig
    from qrag.distributed.serving import build_app

    reserved = args.learner_gpus + args.encoder_gpus
    shard_gpus = shard_gpu_fraction(2, gpu_count, reserved=reserved) if gpu_count else 0.0
    if gpu_count:
        problems = gpu_plan_problems(
            shards, shard_gpus, gpu_count, {"learner": args.learner_gpus, "encoder": args.encoder_gpus}
        )
        if problems:
            raise SystemExit(f"two_gpu.py: the GPU plan does not spread: {problems}")
    device = "cuda" if gpu_count else "cpu"
    cfg = ServeConfig(
        checkpoint=args.checkpoint,
        storage=args.storage,
        shards=shards,
        encoder_device=device,
        shard_device=device,
        faiss="never",
        chunk_tokens=args.chunk_tokens,
        http_host="127.0.0.1",
    )  # what serve.start binds: the app refuses a public address without API keys
    # Serve's per-deployment options (what serve/config.yaml's deployments: section sets).
    deployments = [
        {"name": "Ingress", "max_ongoing_requests": 64, "max_queued_requests": 256},
        {"name": "Encoder", "ray_actor_options": {"num_cpus": 0, "num_gpus": args.encoder_gpus if gpu_count else 0.0}},
        *({"name": f"Shard{i}", "ray_actor_options": {"num_cpus": 0, "num_gpus": shard_gpus}} for i in range(shards)),
    ]
    serve.run(build_app(cfg, {}, deployments), name="qrag", route_prefix="/")
    return wait_healthy(f"http://127.0.0.1:{port}")


def wait_healthy(url: str, timeout: float = 300) -> str:
    """``url`` once its /healthz answers 200."""
    deadline = time.time() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
                if r.status == 200:
                    return url
        except (urllib.error.URLError, OSError):
            pass
        if time.time() > deadline:
            raise RuntimeError("the Serve app did not become healthy")
        time.sleep(1)


def time_queries(url: str, questions: list[str], n: int, steps: int) -> dict:
    for q in questions[:5]:  # warm-up: the shards load on first use
        post(f"{url}/v1/retrieve", {"corpus": CORPUS, "question": q, "max_steps": steps}, timeout=600)
    lat = []
    for q in itertools.islice(itertools.cycle(questions[5:]), n):
        t = time.perf_counter()
        post(f"{url}/v1/retrieve", {"corpus": CORPUS, "question": q, "max_steps": steps})
        lat.append(time.perf_counter() - t)
    return percentiles(lat)


class Load:
    """``clients`` threads retrieving in a closed loop until stopped."""

    def __init__(self, url: str, questions: list[str], clients: int, steps: int):
        self.url, self.questions, self.steps = url, questions, steps
        self.stop_event, self.lock = threading.Event(), threading.Lock()
        self.lat: list[float] = []
        self.errors = 0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, i: int) -> None:
        rng = random.Random(i)
        while not self.stop_event.is_set():
            t = time.perf_counter()
            try:
                post(
                    f"{self.url}/v1/retrieve",
                    {"corpus": CORPUS, "question": rng.choice(self.questions), "max_steps": self.steps},
                )
                with self.lock:
                    self.lat.append(time.perf_counter() - t)
            except (urllib.error.URLError, OSError, ValueError):
                with self.lock:
                    self.errors += 1

    def __enter__(self) -> Load:
        self.t0 = time.perf_counter()
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=120)
        self.seconds = time.perf_counter() - self.t0

    def summary(self) -> dict:
        return {
            "clients": len(self.threads),
            **percentiles(self.lat),
            "queries_per_s": round(len(self.lat) / self.seconds, 2),
            "errors": self.errors,
        }


def gpu_assignment() -> dict | None:
    """Which physical GPU each Ray actor's process uses (nvidia-smi), and memory per GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    from ray.util.state import list_actors

    def smi(query: str, what: str) -> list[list[str]]:
        out = subprocess.run(
            ["nvidia-smi", f"--query-{what}={query}", "--format=csv,noheader,nounits"], capture_output=True, text=True
        )
        return [[x.strip() for x in line.split(",")] for line in out.stdout.strip().splitlines() if line.strip()]

    gpus = {uuid: int(idx) for idx, uuid, _ in smi("index,uuid,memory.used", "gpu")}
    memory = {int(idx): int(mem) for idx, _, mem in smi("index,uuid,memory.used", "gpu")}
    by_pid: dict[int, list[int]] = {}
    for pid, uuid, _ in smi("pid,gpu_uuid,used_memory", "compute-apps"):
        by_pid.setdefault(int(pid), []).append(gpus.get(uuid, -1))
    try:  # the state API needs the dashboard
        alive = list_actors(filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
    except Exception as exc:  # noqa: BLE001 - placement is a diagnostic, not a figure
        return {"actors": None, "actors_error": f"{type(exc).__name__}: {exc}"[:300], "memory_used_mib": memory}
    actors = {f"{a.class_name}#{a.pid}": sorted(by_pid[a.pid]) for a in alive if a.pid in by_pid}
    return {"actors": actors, "memory_used_mib": memory}


# -- the run ------------------------------------------------------------------------------------------


RAY_LOGS = (
    "raylet.out",
    "raylet.err",
    "gcs_server.out",
    "gcs_server.err",
    "dashboard.log",
    "dashboard.err",
    "dashboard_agent.log",
    "runtime_env_agent.log",
    "ray_process_exit.log",
    "python-core-driver-*.log",
)


def copy_ray_logs(temp_dir: Path, dest: Path, tail_bytes: int = 200_000) -> list[str]:
    """The last ``tail_bytes`` of each of Ray's own logs of the latest session, flat in ``dest``."""
    logs = temp_dir / "session_latest" / "logs"
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for pattern in RAY_LOGS:
        for f in sorted(logs.glob(pattern)):
            with open(f, "rb") as fh:
                fh.seek(max(0, f.stat().st_size - tail_bytes))
                (dest / f.name).write_bytes(fh.read())
            copied.append(f.name)
    return copied


def save_partial(args, result: dict) -> None:
    """Write what is measured so far ("complete": false): a later phase can take the process down
    with it (Ray aborts a driver that loses the GCS), and the earlier figures must survive."""
    if args.out:
        from bench_common import write_result

        write_result(args.out, {**result, "complete": False})


def main() -> None:
    args = args_parser().parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.check_imports:
        missing = missing_modules()
        print(json.dumps({"missing": missing}))
        raise SystemExit(1 if missing else 0)
    if args.gpus is None:
        import torch

        args.gpus = torch.cuda.device_count()
    tmp = Path(tempfile.mkdtemp(prefix="qrag_two_gpu_"))
    args.storage = str(Path(args.storage).resolve()) if args.storage else str(tmp / "indexes")
    if args.build_only:
        print(json.dumps(build_corpus(args)))
        return
    if args.gpus == 1:
        raise SystemExit("two_gpu.py: needs 2 GPUs (or --gpus 0 for a CPU check)")

    from bench_common import machine_info, write_result

    if args.random_encoder:
        os.environ["QRAG_ENCODER"] = random_encoder(args.random_encoder, tmp / "encoder")
    corpus, questions = corpus_in_child(args)
    env = cluster_env()
    ray_temp = Path(args.ray_temp).resolve() if args.ray_temp else tmp / "ray"
    head = RayHead(tmp, args.gpus, args.cpus, env, ray_temp, dashboard=args.dashboard)
    result: dict = {
        "bench": "two_gpu",
        **machine_info(),
        "gpus": args.gpus,
        "corpus": corpus,
        "encoder": f"random-init, shape of {args.random_encoder}"
        if args.random_encoder
        else os.environ.get("QRAG_ENCODER", "minilm (bundled)"),
    }
    try:
        import ray
        from ray import serve

        use_gpu = args.gpus > 0
        result["training_alone"] = train(args, head, tmp / "runs", "alone", use_gpu)
        print(f"two_gpu.py: training alone {result['training_alone']}", file=sys.stderr, flush=True)
        save_partial(args, result)

        # The driver joins on loopback too: left to itself it looks its node up by the machine's address.
        ray.init(
            address=head.address, _node_ip_address="127.0.0.1", logging_level="ERROR", log_to_driver=False
        )  # replicas log every request
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        latency = {}
        for shards in (1, 2):
            url = deploy(args, shards, port, args.gpus)
            latency[f"shards_{shards}"] = time_queries(url, questions, args.queries, args.steps)
            latency[f"shards_{shards}"]["placement"] = gpu_assignment()
            print(f"two_gpu.py: {shards} shard(s) {latency[f'shards_{shards}']}", file=sys.stderr, flush=True)
            if shards == 1:
                serve.delete("qrag")
        result["retrieval_latency_idle"] = latency
        save_partial(args, result)

        with Load(url, questions, args.concurrency, args.steps) as load:
            result["training_with_serving_load"] = train(args, head, tmp / "runs", "loaded", use_gpu)
            result["placement_during_training"] = gpu_assignment()
        result["retrieval_during_training"] = load.summary()
        alone = result["training_alone"]["episodes_per_s_median"]
        loaded = result["training_with_serving_load"]["episodes_per_s_median"]
        result["training_slowdown_under_load"] = round(alone / loaded, 3) if alone and loaded else None
        result["settings"] = {
            "config": Path(args.config).name,
            "overrides": args.overrides,
            "runners": args.runners,
            "learner_gpus": args.learner_gpus,
            "encoder_gpus": args.encoder_gpus,
            "steps": args.steps,
            "concurrency": args.concurrency,
            "updates": args.updates,
            "warmup": args.warmup,
        }
        result["complete"] = True
        serve.shutdown()
        ray.shutdown()
    finally:
        head.stop()
        if args.ray_logs:
            print(
                f"two_gpu.py: Ray logs copied: {copy_ray_logs(ray_temp, Path(args.ray_logs))}",
                file=sys.stderr,
                flush=True,
            )
        shutil.rmtree(tmp / "runs", ignore_errors=True)
    print(json.dumps(result))
    if args.out:
        write_result(args.out, result)


if __name__ == "__main__":
    main()
