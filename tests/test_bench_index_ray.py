"""`bench/index_ray.py`: bulk indexing the way ``qrag index --address`` runs it
(qrag.distributed.bulk_index.index_on_cluster), the lanes as a Ray task or Ray Data. Its input
builder cycles through the books until the token budget is reached; either path's figures come
out in one shape with the shares of the bare forward over the devices used; and the script runs
for real on CPU on a local Ray for ``--path lanes`` and ``--path ray``."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma delta river castle forest painter singer city novel film war king queen ship".split()


@pytest.fixture(scope="module")
def index_ray():
    sys.path.insert(0, str(ROOT / "bench"))
    import index_ray

    return index_ray


def write_books(folder: Path, names=("Aaa_One", "Bbb_Two"), lines: int = 60, seed: int = 0) -> list[Path]:
    """Small books of words, paragraphs one a line, as .txt files."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in names:
        text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) + "." for _ in range(lines))
        (folder / f"{name}.txt").write_text(text + "\n", encoding="utf-8")
        paths.append(folder / f"{name}.txt")
    return paths


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"])


@pytest.mark.parametrize("fmt", ["jsonl", "text"])
def test_build_input_cycles_through_the_books_with_new_ids(index_ray, tiny_encoder, tmp_path, fmt):
    """Books holding fewer tokens than asked for are written again, pass after pass, each document
    of a later pass under an id (jsonl) or file name (text) of its own, up to the budget."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_encoder)
    books = write_books(tmp_path / "books")
    held = sum(count_tokens(tokenizer, p.read_text()) for p in books)
    tokens = int(held * 2.5)
    out = tmp_path / "input"
    built = index_ray.build_input(books, tokens, out, tokenizer, fmt, doc_tokens=128)
    assert built["passes"] == 3 and built["books"] == 2 and built["approx_tokens"] == tokens
    if fmt == "jsonl":
        assert [p.name for p in out.iterdir()] == ["docs.jsonl"]
        docs = [json.loads(line) for line in (out / "docs.jsonl").read_text().splitlines()]
        ids = [d["id"] for d in docs]
        texts = [d["text"] for d in docs]
    else:
        files = sorted(out.iterdir())
        assert all(p.suffix == ".txt" for p in files)
        ids = [p.stem for p in files]
        texts = [p.read_text() for p in files]
    assert len(ids) == len(set(ids)) == built["documents"]  # no id twice across the passes
    assert {i for i in ids if "~pass" not in i} and any(i.endswith("~pass2") for i in ids)
    assert any(i.endswith("~pass3") for i in ids) and not any("~pass4" in i for i in ids)
    assert abs(sum(count_tokens(tokenizer, t) for t in texts) - tokens) <= 0.02 * tokens  # the last book cut

    one_pass = index_ray.build_input(books, held // 4, tmp_path / "small", tokenizer, fmt, doc_tokens=128)
    assert one_pass["passes"] == 1 and one_pass["books"] == 1  # within the first book: no cycling


def test_build_input_refuses_books_without_text(index_ray, tiny_encoder, tmp_path):
    from transformers import AutoTokenizer

    (tmp_path / "Empty.txt").write_text("")
    with pytest.raises(index_ray.DataError, match="no text"):
        index_ray.build_input(
            [tmp_path / "Empty.txt"], 100, tmp_path / "in", AutoTokenizer.from_pretrained(tiny_encoder), "jsonl"
        )


def lanes_stats(devices: list[str], per_device: int) -> dict:
    """index_on_cluster's figures of the lanes (qrag.index.bulk.index_files plus the node)."""
    from qrag.index.lanes import LaneStats

    lanes = [d for d in devices for _ in range(per_device)]
    stats = LaneStats(
        lanes=len(lanes),
        devices=lanes,
        commits=4,
        documents=10,
        chunks=1000,
        tokens=60_000,
        encoder_tokens=62_000,
        startup_seconds=6.0,
        seconds=4.0,
        total_seconds=10.0,
    )
    return {
        "path": "lanes",
        "devices": devices,
        "corpus": {"name": "bench", "documents": 10, "chunks": 1000, "tokens": 60_000},
        "lanes": stats.summary(),
        "seconds": 10.5,
        "tokens_per_s": round(stats.encoder_tokens / stats.seconds),
        "node": "127.0.0.1",
    }


def ray_stats(actors: int) -> dict:
    """index_on_cluster's figures of Ray Data (qrag.distributed.bulk_index.bulk_index)."""
    from qrag.distributed.bulk_index import BulkStats

    stats = BulkStats("bench", files=1, parts=3, documents=10, chunks=1000, tokens=60_000, encoder_tokens=62_000)
    stats.commits, stats.seconds, stats.embed_seconds = 2, 8.0, 5.0
    stats.encoder_actors, stats.encoder_gpus = actors, 1.0
    stats.corpus_documents, stats.corpus_chunks = 10, 1000
    return {"path": "ray", "devices": ["cuda"] * actors, **stats.summary()}


def test_either_path_in_one_shape_shares_over_the_devices_used(index_ray):
    """The lanes: shares over their distinct devices (not their lanes), after the startup too; Ray
    Data: over its encoder actors, no startup of its own."""
    bare = 1000.0
    lanes = index_ray.summarise(lanes_stats(["cuda:0", "cuda:1"], per_device=3), bare)
    assert lanes["path"] == "lanes"
    assert lanes["corpus"] == {"documents": 10, "chunks": 1000, "text_tokens": 60_000, "encoder_tokens": 62_000}
    run = lanes["indexing"]
    assert run["devices_used"] == 2 and run["seconds"] == 10.5 and run["startup_seconds"] == 6.0
    assert run["encoder_tokens_per_s"] == pytest.approx(62_000 / 10.5, abs=0.1)
    assert run["encoder_tokens_per_s_after_startup"] == pytest.approx(62_000 / 4.0)
    assert run["end_to_end_share_of_bare"] == round(62_000 / 10.5 / (bare * 2), 3)
    assert run["share_of_bare_after_startup"] == round(62_000 / 4.0 / (bare * 2), 3)
    assert lanes["lanes"]["lanes"] == 6 and lanes["lanes"]["node"] == "127.0.0.1"

    ray = index_ray.summarise(ray_stats(actors=3), bare)
    assert ray["path"] == "ray" and ray["corpus"]["encoder_tokens"] == 62_000
    run = ray["indexing"]
    assert run["devices_used"] == 3 and run["startup_seconds"] is None
    assert run["encoder_tokens_per_s_after_startup"] is None and run["share_of_bare_after_startup"] is None
    assert run["end_to_end_share_of_bare"] == round(62_000 / 8.0 / (bare * 3), 3)
    assert run["embed_actor_seconds"] == 5.0 and ray["pipeline"]["read_tasks"] == 3


@pytest.mark.ray
@pytest.mark.parametrize("path", ["lanes", "ray"])
def test_the_script_indexes_on_a_local_ray_by_either_path(tiny_encoder, tmp_path, path):
    """The real script on CPU: a local Ray on loopback, the path asked for, the books cycled to
    the budget, the figures of either path with their shares of the bare forward."""
    from qrag.index.bulk import PATH_DEFAULTS

    books = tmp_path / "books"
    write_books(books)
    out = tmp_path / "result.json"
    ray_tmp = tempfile.mkdtemp(prefix="qrag-ray-", dir="/tmp")  # short: Ray's Unix socket paths
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform"), "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    try:
        done = subprocess.run(
            [
                sys.executable,
                str(ROOT / "bench" / "index_ray.py"),
                "--books",
                str(books),
                "--encoder",
                tiny_encoder,
                "--tokens",
                "3000",
                "--chunk-tokens",
                "64",
                "--doc-tokens",
                "256",
                "--shards",
                "2",
                "--path",
                path,
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result == json.loads(done.stdout.strip().splitlines()[-1])
    assert result["path"] == result["path_requested"] == result["path_stats"]["path"] == path
    assert result["input"]["passes"] >= 2  # the two small books hold fewer tokens than asked for
    corpus, run = result["corpus"], result["indexing"]
    assert corpus["documents"] == result["input"]["documents"] and corpus["chunks"] > 0
    assert 0 < corpus["text_tokens"] <= corpus["encoder_tokens"]
    assert run["devices_used"] == 1 and run["seconds"] > 0 and run["bare_forward_tokens_per_s"] > 0
    assert run["encoder_tokens_per_s"] == pytest.approx(corpus["encoder_tokens"] / run["seconds"], rel=1e-3)
    assert run["end_to_end_share_of_bare"] == pytest.approx(
        run["encoder_tokens_per_s"] / run["bare_forward_tokens_per_s"], abs=1e-3
    )
    assert result["settings"]["commit_chunks"] == PATH_DEFAULTS[path]["commit_chunks"]  # unset: as qrag index
    if path == "lanes":
        assert result["path_stats"]["node"] == "127.0.0.1"  # the local Ray on loopback only
        assert result["lanes"]["devices"] == ["cpu"] and 0 < run["startup_seconds"] < run["seconds"]
        assert run["encoder_tokens_per_s_after_startup"] > run["encoder_tokens_per_s"]
        assert run["share_of_bare_after_startup"] > 0
    else:
        assert run["startup_seconds"] is None and run["share_of_bare_after_startup"] is None
        assert result["pipeline"]["encoder_actors"] == 1 and result["pipeline"]["encoder_gpus_each"] == 0.0
