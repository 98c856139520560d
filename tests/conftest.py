"""Shared fixtures: a tiny random-init encoder (real tokenizer, no hub) and tiny datasets."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No Arrow data cache under ~/.cache from test runs; tests/test_data_cache.py sets its own folder.
os.environ.setdefault("QRAG_DATA_CACHE", "none")
# Every Ray the tests start stays on 127.0.0.1 (qrag.distributed.loopback): set before Ray is imported, so
# the clusters the tests start with `ray start` and the drivers that join them agree on the node's address.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


def build_tiny_encoder(directory: Path, hidden: int = 32, layers: int = 2, seed: int = 0, arch: str = "bert") -> Path:
    """A random-init BERT (or MPNet: eager attention only, like all-mpnet-base-v2) with the bundled
    MiniLM tokenizer ($QRAG_ENCODER's where set, as on a GPU machine without the package): fast,
    offline, real tokenisation."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel, MPNetConfig, MPNetModel

    from qrag.model.encoder import resolve_encoder

    torch.manual_seed(seed)
    src = resolve_encoder("minilm")
    tokenizer = AutoTokenizer.from_pretrained(str(src))
    config_cls, model_cls = {"bert": (BertConfig, BertModel), "mpnet": (MPNetConfig, MPNetModel)}[arch]
    config = config_cls(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=hidden * 2,
        max_position_embeddings=512 if arch == "bert" else 514,  # MPNet offsets positions by 2
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=tokenizer.pad_token_id,
    )
    model_cls(config).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_encoder(tmp_path_factory) -> str:
    return str(build_tiny_encoder(tmp_path_factory.mktemp("tiny_encoder")))


@pytest.fixture(scope="session")
def tiny_mpnet(tmp_path_factory) -> str:
    return str(build_tiny_encoder(tmp_path_factory.mktemp("tiny_mpnet"), arch="mpnet"))


WORDS = "alpha beta gamma delta river castle forest painter singer city novel film war king queen ship".split()


def make_hotpot_records(n: int, seed: int = 0, paragraphs: int = 6) -> list[dict]:
    """Synthetic records in the official HotpotQA layout; the question names its two gold titles."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        titles = [f"Title {i}-{j} {rng.choice(WORDS)}" for j in range(paragraphs)]
        gold = rng.sample(range(paragraphs), 2)
        context = [
            [t, [f" {t} is a {rng.choice(WORDS)} of {rng.choice(WORDS)}.", f" It has {rng.choice(WORDS)} {k}."]]
            for k, t in enumerate(titles)
        ]
        records.append(
            {
                "_id": f"q{i:04d}",
                "question": f"What links {titles[gold[0]]} and {titles[gold[1]]}?",
                "answer": rng.choice(WORDS),
                "supporting_facts": [[titles[gold[0]], 0], [titles[gold[1]], 1]],
                "context": context,
                "type": "bridge",
                "level": "hard",
            }
        )
    return records


@pytest.fixture(scope="session")
def hotpot_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("hotpot") / "tiny_hotpot.json"
    path.write_text(json.dumps(make_hotpot_records(60)))
    return str(path)


@pytest.fixture
def tiny_cfg(tiny_encoder, hotpot_file, tmp_path):
    """A TrainConfig that trains in seconds on CPU."""
    from qrag.config import load_config

    return load_config(
        None,
        [
            f"model.encoder={tiny_encoder}",
            f"data.path={hotpot_file}",
            f"out_dir={tmp_path / 'runs'}",
            "name=tiny",
            "updates=4",
            "learner.episodes_per_update=6",
            "learner.micro_batch=3",
            "learner.warmup_updates=2",
            "learner.lr=1e-3",
            "eval_limit=8",
            "log_every=1",
            "data.chunk_tokens=48",
        ],
    )


def shared_data_dir() -> Path | None:
    for c in (ROOT.parent / "shared" / "data", ROOT / "shared" / "data"):
        if c.is_dir():
            return c
    env = os.environ.get("QRAG_DATA_DIR")
    return Path(env) if env else None


@pytest.fixture(scope="session")
def shared_data() -> Path:
    d = shared_data_dir()
    if d is None:
        pytest.skip("shared benchmark data not available")
    return d


def processes_of(work: Path) -> list[int]:
    """Ids of the live processes whose command line names ``work`` (a benchmark script's runs do)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(work).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone meanwhile
            pass
    return found


def stop_like_timeout(script: subprocess.Popen, work: Path) -> str:
    """SIGTERM to a benchmark script alone (what `timeout` sends at a call's limit): it must stop every run
    it started (their command lines name ``work``) and exit 124. Returns what it printed."""
    try:
        script.send_signal(signal.SIGTERM)
        printed, _ = script.communicate(timeout=60)
        assert script.returncode == 124, printed
        deadline = time.monotonic() + 5
        while processes_of(work) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not processes_of(work), "runs left running"
        return printed
    finally:
        kill_leftovers(script, work)


def kill_leftovers(script: subprocess.Popen, work: Path) -> None:
    for pid in processes_of(work):
        os.kill(pid, signal.SIGKILL)
    if script.poll() is None:
        script.kill()


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports free on 127.0.0.1 right now (for servers a test starts)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


# The longest files by measured wall time under `make test` (pytest --durations), longest first: a
# scheduling hint only (a stale entry costs time, never a result).
LONGEST_FIRST = (
    "test_distributed_ray.py",
    "test_hotpot_seeds.py",
    "test_sweep_ray.py",
    "test_infra_mlflow.py",
    "test_serve_app.py",
    "test_mlflow_portable.py",
    "test_longctx_bench.py",
    "test_serve_http_bench.py",
    "test_bulk_index.py",
    "test_index_lanes.py",
    "test_cli.py",
    "test_entry_points.py",
    "test_bench_index_ray.py",
)


def pytest_collection_modifyitems(config, items):
    """The longest files first, then the other files with a Ray or slow test, then the rest.
    In one process this is the run's order. Under `make test` (pytest-xdist, --dist loadfile,
    --no-loadscope-reorder) xdist hands out whole files in this order, so the long ones start
    first and the short ones fill both workers' ends (xdist's own order, most tests first, left
    a few long one-test files to the end of one worker). The order is the same on every worker
    (xdist needs it)."""
    heavy = {item.path for item in items if item.get_closest_marker("ray") or item.get_closest_marker("slow")}

    def rank(item) -> int:
        if item.path.name in LONGEST_FIRST:
            return LONGEST_FIRST.index(item.path.name)
        return len(LONGEST_FIRST) + (item.path not in heavy)

    items.sort(key=rank)  # stable: collection order within a rank
