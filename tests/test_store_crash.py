"""Durability of the corpus store: a writer killed with SIGKILL at random points of its appends
leaves a corpus that reopens at the previous or the new version, never between, with every
acknowledged append present; temp files of the killed write are gone after reopening."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from qrag.config import ModelConfig
from qrag.data.documents import Document, DocumentChunk
from qrag.index.store import TMP_SUFFIX, CorpusStore

ROOT = Path(__file__).resolve().parents[1]
DIM, SHARDS, DOCS_PER_BATCH, CHUNKS_PER_DOC = 64, 3, 40, 25
KILLS = 24

# The writer: appends batch after batch, printing "ACK <batch>" once store.append returned (the
# moment a server would acknowledge the write to its client).
WRITER = """
import sys
import numpy as np
from qrag.data.documents import Document, DocumentChunk
from qrag.index.store import CorpusStore

root, first, n_docs, n_chunks, dim = sys.argv[1], *map(int, sys.argv[2:])
store = CorpusStore(root)
rng = np.random.default_rng(first)
for b in range(first, first + 1000):
    docs = [Document(f"b{b}-d{k}", "text") for k in range(n_docs)]
    chunks = [DocumentChunk(d.id, f"batch {b} doc {d.id} chunk {c}", 4) for d in docs for c in range(n_chunks)]
    ids = [np.asarray([101, b % 30000, c % 30000, 102], np.int32) for c in range(len(chunks))]
    store.append("c", docs, chunks, ids, rng.standard_normal((len(chunks), dim)).astype(np.float32), "fp")
    print(f"ACK {b}", flush=True)
"""


def check_whole(store: CorpusStore) -> tuple[int, list[int]]:
    """The corpus as a reader sees it: every listed file intact, every stored append whole and
    stored once, the version moved once per append; (version, the writer's batch numbers, in order)."""
    m = store.read("c")
    ids = store.doc_ids(m)
    assert len(ids) == len(set(ids)) == m.documents == sum(b.documents for b in m.batches)
    assert m.chunks == sum(b.chunks for b in m.batches) == len(m.batches) * DOCS_PER_BATCH * CHUNKS_PER_DOC
    assert m.version == len(m.batches)  # created at 0, then nothing but appends
    for batch in m.batches:
        for shard in range(m.shards):
            segment, problem = store.read_segment(m, shard, batch)
            assert problem is None, problem
    numbers = [int(i.split("-")[0][1:]) for i in ids[::DOCS_PER_BATCH]]  # ids "b<batch>-d<k>"
    assert ids == [f"b{b}-d{k}" for b in numbers for k in range(DOCS_PER_BATCH)], "an append stored in part"
    return m.version, numbers


def test_sigkill_during_appends_never_loses_an_acknowledged_write(tmp_path):
    store = CorpusStore(tmp_path)
    store.create("c", fingerprint="fp", model=ModelConfig(), dim=DIM, chunk_tokens=8, shards=SHARDS)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}
    rng = random.Random(13)
    acked: list[int] = []
    in_flight: set[int] = set()  # per kill, the batch after its last acknowledged one
    version, next_batch, mid_write = 0, 1, 0
    for _ in range(KILLS):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                WRITER,
                str(tmp_path),
                str(next_batch),
                str(DOCS_PER_BATCH),
                str(CHUNKS_PER_DOC),
                str(DIM),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        first = proc.stdout.readline()  # the first append is through: from now on, kill anywhere
        if not first.startswith("ACK"):
            proc.wait(timeout=30)
            raise AssertionError(proc.stderr.read())
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # The rest through the same file object: readline() may have buffered later ACK lines
        # (a parent that reads late finds several in the pipe), which communicate() would drop,
        # as it reads the descriptor itself.
        out = first + proc.stdout.read()
        proc.stdout.close()
        proc.stderr.close()
        batches = [int(line.split()[1]) for line in out.splitlines()]
        # The writer acknowledges its batches in order: a gap would be an ACK this test lost.
        assert batches == list(range(next_batch, next_batch + len(batches))), out
        acked += batches
        in_flight.add(batches[-1] + 1)
        leftovers = list(tmp_path.glob(f"c/*/.*{TMP_SUFFIX}")) + list(tmp_path.glob(f"c/.*{TMP_SUFFIX}"))
        mid_write += bool(leftovers)

        reopened = CorpusStore(tmp_path)  # what a restarted server does first
        assert not list(tmp_path.glob(f"c/**/.*{TMP_SUFFIX}")) and not list(tmp_path.glob(f"c/.*{TMP_SUFFIX}"))
        new_version, stored = check_whole(reopened)
        # The previous version plus the acknowledged appends, or that plus the one in flight
        # (killed after its commit, before its ACK was written).
        assert new_version - version in (len(batches), len(batches) + 1), (version, new_version, batches)
        lost = sorted(set(acked) - set(stored))
        assert not lost, f"acknowledged batches {lost} lost"
        # Every stored append is one the writer issued: acknowledged, or in flight at a kill.
        assert set(stored) <= set(acked) | in_flight, sorted(set(stored) - set(acked) - in_flight)
        version = new_version
        next_batch = max(acked) + 2  # the in-flight batch, if it landed, keeps its number
    assert len(acked) >= KILLS
    print(f"{KILLS} kills, {len(acked)} acknowledged appends, {mid_write} kills left a half-written file behind")


def test_appends_fsync_files_and_directories_before_returning(tmp_path, monkeypatch):
    """A rename is durable only once its directory is fsynced: the manifest's directory is
    the last thing synced before append returns."""
    store = CorpusStore(tmp_path)
    store.create("c", fingerprint="fp", model=ModelConfig(), dim=4, chunk_tokens=8, shards=2)
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    docs = [Document("d", "text")]
    store.append(
        "c",
        docs,
        [DocumentChunk("d", "a chunk", 2)] * 3,
        [np.asarray([1, 2], np.int32)] * 3,
        np.ones((3, 4), np.float32),
        "fp",
    )
    corpus = str(tmp_path / "c")
    assert synced[-2].startswith(corpus + "/.corpus.json.") and synced[-1] == corpus  # the manifest, then its directory
    for folder in ("docs", "shard_000", "shard_001"):
        assert str(tmp_path / "c" / folder) in synced  # every batch file's directory entry too


def test_reopening_removes_temp_and_stray_files_but_not_a_live_writers(tmp_path):
    store = CorpusStore(tmp_path)
    store.create("c", fingerprint="fp", model=ModelConfig(), dim=4, chunk_tokens=8, shards=1)
    debris = [
        tmp_path / "c" / ".corpus.json.ab12cd34.tmp",
        tmp_path / "c" / "shard_000" / ".batch_000001.jsonl.99.tmp",
        tmp_path / "c" / "shard_000" / "batch_000007.abc.safetensors",
    ]
    (tmp_path / "c" / "shard_000").mkdir()
    for path in debris:
        path.write_bytes(b"half")
    with store.lock("c"):  # a writer is busy: its files are left alone
        CorpusStore(tmp_path)
        assert all(p.exists() for p in debris)
    CorpusStore(tmp_path)
    assert not any(p.exists() for p in debris)
    assert store.read("c").version == 0
