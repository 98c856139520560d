"""`bench/serve_http.py`: HTTP end to end against the library path on one corpus (issue 14 item 3),
run for real on a tiny corpus that `bench/serve_scale.py` builds with a tiny random encoder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_http_and_library_paths_agree_and_are_timed(tiny_encoder, shared_data, tmp_path):
    storage = tmp_path / "idx"
    books = sorted((shared_data / "gutenberg_novels" / "small_collection_british_fiction").glob("*.txt.gz"))[:1]
    run(
        "serve_scale.py",
        "--tokens",
        "8000",
        "--encoder",
        tiny_encoder,
        "--corpus",
        str(books[0]),
        "--shards",
        "2",
        "--queries",
        "3",
        "--batches",
        "1",
        "--rounds",
        "1",
        "--storage",
        str(storage),
        "--workers",
        "1",
        "--device",
        "cpu",
    )
    out = tmp_path / "http.json"
    run(
        "serve_http.py",
        "--storage",
        str(storage),
        "--encoder",
        tiny_encoder,
        "--shards",
        "2",
        "--queries",
        "6",
        "--concurrency",
        "2",
        "--device",
        "cpu",
        "--state-batch",
        "1,8",
        "--out",
        str(out),
    )
    result = json.loads(out.read_text())
    assert result["corpus"]["chunks"] > 50
    # one holder per shard, then all shards in one; each without and with batching of concurrent states
    assert [(m["holders"], m["state_batch_size"]) for m in result["modes"]] == [(2, 1), (2, 8), (1, 1), (1, 8)]
    assert result["same_chunks_across_modes"] == 1.0
    for mode in result["modes"]:
        assert mode["same_chunks_http_vs_library"] == 1.0  # the same service behind both paths
        for key in ("library_concurrency_1", "http_concurrency_1"):
            assert mode[key]["queries"] == 6 and 0 < mode[key]["p50_ms"] <= mode[key]["p99_ms"]
        [loop] = mode["http_closed_loop"]
        assert loop["concurrency"] == 2 and loop["queries"] == 6 and loop["queries_per_s"] > 0


@pytest.mark.slow
def test_the_two_gpu_benchs_corpus_builder_runs_on_cpu(tiny_encoder, shared_data, tmp_path):
    """`bench/two_gpu.py --build-only` builds its corpus through serve_scale's tokenising workers:
    it sent them an outdated job shape and failed on the 2-GPU machine before anything was timed."""
    books = sorted((shared_data / "gutenberg_novels" / "small_collection_british_fiction").glob("*.txt.gz"))[:1]
    done = run(
        "two_gpu.py",
        "--build-only",
        "--gpus",
        "0",
        "--storage",
        str(tmp_path / "corpus"),
        "--tokens",
        "3000",
        "--corpus-workers",
        "1",
        "--shards",
        "2",
        "--corpus",
        str(books[0]),
        "--random-encoder",
        tiny_encoder,
    )
    corpus = json.loads(done.stdout.strip().splitlines()[-1])
    assert corpus["tokens"] >= 3000 and corpus["shards"] == 2 and corpus["chunks"] > 0 and corpus["questions"]


def test_index_stages_times_tokenising_per_worker_count(tiny_encoder, shared_data, tmp_path):
    """`bench/index_stages.py --prep-workers` (bench/index_lanes.sh, index_word_cache.sh): tokenising
    alone with each worker count, gathered into groups and raw, on the same tokens."""
    books = sorted((shared_data / "gutenberg_novels" / "small_collection_british_fiction").glob("*.txt.gz"))[:1]
    out = tmp_path / "stages.json"
    run(
        "index_stages.py",
        "--corpus",
        str(books[0]),
        "--encoder",
        tiny_encoder,
        "--tokens",
        "20000",
        "--doc-tokens",
        "2000",
        "--prep-workers",
        "1,2",
        "--device",
        "cpu",
        "--out",
        str(out),
    )
    stages = json.loads(out.read_text())["stages"]
    assert sorted(stages) == ["prep_1_workers", "prep_2_workers", "raw_1_workers", "raw_2_workers"]
    assert all(row["tokens_per_s"] > 0 and row["seconds"] > 0 for row in stages.values())
