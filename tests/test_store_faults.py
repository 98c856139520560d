"""Fault injection (issue 32, item 4): every write of the store and of the job records is stopped at
each of its fault points (before and after each write, fsync, rename and removal:
``qrag.index.store.fault_point``), by SIGKILL in a forked child and by a simulated power loss that
drops every write not yet fsynced (:mod:`power_loss`). After each, the storage must open at the old
or the new version, whole, with every acknowledged write there, and a retry of the operation (what
a client does after the failure; for a re-index, the restarted job) must finish it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import qrag.index.store as store_module
from qrag.config import ModelConfig
from qrag.data.documents import Document, DocumentChunk
from qrag.index.jobs import Job, JobBoard
from qrag.index.store import (
    FAULT_ENV,
    TMP_SUFFIX,
    Batch,
    CorpusNotFound,
    CorpusStore,
    Manifest,
    fault_hook_from_env,
    listed_files,
    segment_positions,
)

from power_loss import DurableState, PowerLoss

ROOT = Path(__file__).resolve().parents[1]
DIM, SHARDS, FP, FP2 = 4, 2, "fp-old", "fp-new"
JOB_ID = "0123456789abcdef"
Ack = Callable[[str], None]


def batch(tag: str, base: float) -> tuple[list[Document], list[DocumentChunk], list[np.ndarray], np.ndarray]:
    """Two documents of two chunks; chunk k's vector is ``base + k`` in every component."""
    docs = [Document(f"{tag}-{k}", "text") for k in range(2)]
    chunks = [DocumentChunk(d.id, f"{tag} chunk {c} of {d.id}", 2) for d in docs for c in range(2)]
    ids = [np.asarray([101, c, 102], np.int32) for c in range(len(chunks))]
    return docs, chunks, ids, np.repeat(np.arange(len(chunks), dtype=np.float32)[:, None] + base, DIM, axis=1)


def whole(store: CorpusStore, name: str) -> Manifest:
    """The corpus as a restarted server reads it: every listed file intact, no debris left."""
    m = store.read(name)
    ids = store.doc_ids(m)
    assert len(ids) == len(set(ids)) == m.documents and m.chunks == sum(b.chunks for b in m.batches)
    for b in m.batches:
        for s in range(m.shards):
            assert store.read_segment(m, s, b)[1] is None, store.read_segment(m, s, b)[1]
            staged = b.shards[s].next
            assert (
                staged is None
                or store._read_checked(store.path(name) / staged.vectors.file, staged.vectors.sha256) is not None
            )
    files = {f"{p.parent.name}/{p.name}" for p in store.path(name).glob("*/*") if p.is_file()}
    assert files == listed_files(m) and not list(store.path(name).glob(f"**/*{TMP_SUFFIX}"))
    return m


def vectors_of(store: CorpusStore, m: Manifest) -> dict[tuple[int, int], np.ndarray]:
    return {(b.id, s): store.read_segment(m, s, b)[0].vectors for b in m.batches for s in range(m.shards)}


def new_vectors(m: Manifest, shard: int, b: Batch) -> np.ndarray:
    """What the re-index and the repair write for a segment: recognisable, one value per segment."""
    return np.full((len(segment_positions(m, shard, b)), DIM), 1000.0 + 10 * b.id + shard, np.float32)


def tokens_for(m: Manifest, shard: int, b: Batch) -> list[np.ndarray]:
    return [np.asarray([101, 7, 102], np.int32)] * len(segment_positions(m, shard, b))


def setup_corpus(root: Path) -> None:
    store = CorpusStore(root)
    store.create("c", fingerprint=FP, model=ModelConfig(), dim=DIM, chunk_tokens=8, shards=SHARDS)
    store.append("c", *batch("a", 0.0), FP)


# -- the operations: each acknowledges ("new") once it returned, as the server would answer ----------


def op_create(store: CorpusStore, ack: Ack) -> None:
    store.create(
        "n", fingerprint=FP, model=ModelConfig(), dim=DIM, chunk_tokens=8, shards=SHARDS, first=batch("n", 50.0)
    )
    ack("new")


def op_append(store: CorpusStore, ack: Ack) -> None:
    store.append("c", *batch("b", 100.0), FP, uid=store.read("c").uid)
    ack("new")


def op_delete(store: CorpusStore, ack: Ack) -> None:
    store.delete("c")
    ack("new")


def op_reindex(store: CorpusStore, ack: Ack) -> int:
    """The service's re-index, store calls only; returns how many segments it re-embedded."""
    uid = store.read("c").uid
    m = store.begin_reindex("c", uid, FP2, DIM, ModelConfig())
    staged, todo = 0, store.reindex_todo(m)
    while True:
        for b, s in todo:
            store.stage_vectors("c", uid, FP2, s, b.id, new_vectors(m, s, b), tokens_for(m, s, b))
            staged += 1
        m, todo = store.finish_reindex("c", uid, FP2)
        if not todo:
            break
    ack("new")
    return staged


def op_repair(store: CorpusStore, ack: Ack) -> None:
    m = store.read("c")
    b = m.batches[0]
    store.replace_vectors("c", 0, b.id, new_vectors(m, 0, b), tokens_for(m, 0, b), FP, uid=m.uid)
    ack("new")


def op_jobs(store: CorpusStore, ack: Ack) -> None:
    board = JobBoard(store.root)
    job = Job(JOB_ID, "c", "append")
    for state in ("queued", "running", "done"):
        job.state = state
        board.save(job)
        ack(state)


# -- which version the storage is at (asserting it is whole) -------------------------------------------


def state_create(store: CorpusStore) -> str:
    whole(store, "c")
    try:
        m = whole(store, "n")
    except CorpusNotFound:
        assert "n" not in store.names()
        return "old"
    assert store.doc_ids(m) == ["n-0", "n-1"] and m.chunks == 4
    return "new"


def state_append(store: CorpusStore) -> str:
    ids = store.doc_ids(whole(store, "c"))
    assert ids in (["a-0", "a-1"], ["a-0", "a-1", "b-0", "b-1"]), ids
    return "old" if len(ids) == 2 else "new"


def state_delete(store: CorpusStore) -> str:
    if "c" not in store.names():
        with pytest.raises(CorpusNotFound):
            store.read("c")
        return "new"
    whole(store, "c")
    return "old"


def state_vectors(store: CorpusStore, new_at: Callable[[Manifest, int, Batch], bool]) -> str:
    """'old' when every segment holds the vectors of setup_corpus, 'new' when those ``new_at`` names
    hold new_vectors; anything else is a mix."""
    m = whole(store, "c")
    got = vectors_of(store, m)
    old = {(b.id, s): batch("a", 0.0)[3][segment_positions(m, s, b)] for b in m.batches for s in range(m.shards)}
    if all(np.array_equal(got[k], v) for k, v in old.items()):
        return "old"
    new = {
        (b.id, s): new_vectors(m, s, b) if new_at(m, s, b) else old[(b.id, s)]
        for b in m.batches
        for s in range(m.shards)
    }
    assert all(np.array_equal(got[k], v) for k, v in new.items()), "a mix of old and new vectors"
    return "new"


def state_reindex(store: CorpusStore) -> str:
    version = state_vectors(store, lambda m, s, b: True)
    m = store.read("c")
    assert m.fingerprint == (FP if version == "old" else FP2) and (version == "old" or m.reindex is None), (
        version,
        m.fingerprint,
    )
    return version


def state_repair(store: CorpusStore) -> str:
    return state_vectors(store, lambda m, s, b: s == 0)


def state_jobs(store: CorpusStore) -> str:
    board = JobBoard(store.root)
    job = board.get(JOB_ID)
    if job is None:
        return "none"
    if job.state == "done":
        assert board.active() == []
    return job.state


@dataclass
class Scenario:
    op: Callable[[CorpusStore, Ack], object]
    state: Callable[[CorpusStore], str]
    versions: tuple[str, ...] = ("old", "new")


SCENARIOS = {
    "create": Scenario(op_create, state_create),
    "append": Scenario(op_append, state_append),
    "delete": Scenario(op_delete, state_delete),
    "reindex": Scenario(op_reindex, state_reindex),
    "repair": Scenario(op_repair, state_repair),
    "job records": Scenario(op_jobs, state_jobs, ("none", "queued", "running", "done")),
}


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("template")
    setup_corpus(root)
    return root


def fresh(template: Path, tmp_path: Path, n: int) -> Path:
    root = tmp_path / f"run{n}"
    shutil.copytree(template, root)
    return root


def fault_points(template: Path, tmp_path: Path, scenario: Scenario) -> list[str]:
    """The fault points the operation passes, in order (each run passes the same ones)."""
    seen: list[str] = []
    previous = store_module.set_fault_hook(seen.append)
    try:
        scenario.op(CorpusStore(fresh(template, tmp_path, 0)), lambda label: None)
    finally:
        store_module.set_fault_hook(previous)
    return seen


def check_after_crash(root: Path, scenario: Scenario, acked: list[str], where: str) -> None:
    """Reopened (as a restarted server does): the old or the new version, whole, every acknowledged
    step there; then a retry of the operation finishes it."""
    store = CorpusStore(root)
    version = scenario.state(store)
    last = scenario.versions.index(acked[-1]) if acked else 0
    assert scenario.versions.index(version) >= last, f"{where}: acknowledged {acked[-1]!r}, found {version!r}"
    if version != scenario.versions[-1]:
        staged = (
            len(store.reindex_todo(store.read("c"))) if scenario.op is op_reindex and store.read("c").reindex else None
        )
        done = scenario.op(CorpusStore(root), lambda label: None)
        if staged is not None:
            assert done == staged, f"{where}: the restarted re-index re-embedded {done} segments, {staged} were left"
    assert scenario.state(CorpusStore(root)) == scenario.versions[-1], where


def run_killed(root: Path, scenario: Scenario, n: int) -> tuple[int, list[str]]:
    """The operation in a forked child that $QRAG_FAULT_POINT=n kills at its n-th fault point;
    (wait status, the steps it acknowledged before it died)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read_end)
            os.environ[FAULT_ENV] = str(n)
            fault_hook_from_env()
            scenario.op(CorpusStore(root), lambda label: os.write(write_end, f"{label}\n".encode()))
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as fh:
        acked = fh.read().split()
    return os.waitpid(pid, 0)[1], acked


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_sigkill_at_every_fault_point(name, template, tmp_path):
    scenario = SCENARIOS[name]
    points = fault_points(template, tmp_path, scenario)
    assert len(points) >= 4, points
    for n, point in enumerate(points, 1):
        root = fresh(template, tmp_path, n)
        status, acked = run_killed(root, scenario, n)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"{name}: not killed at {point}"
        check_after_crash(root, scenario, acked, f"{name}, SIGKILL at {n}/{len(points)} ({point})")
        shutil.rmtree(root)


class PowerCut:
    """A fault hook: at its ``n``-th point the power goes (what is on disk then is kept in ``left``)."""

    def __init__(self, disk: DurableState, n: int):
        self.disk, self.n, self.seen, self.left = disk, n, 0, None

    def __call__(self, point: str) -> None:
        self.seen += 1
        if self.seen == self.n:
            self.left = self.disk.survivors()
            raise PowerLoss(point)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_power_loss_at_every_fault_point(name, template, tmp_path, monkeypatch):
    """The power goes at each point, and once more after the operation returned: only what was
    fsynced (files) and what a directory fsync made durable (names) is left."""
    scenario = SCENARIOS[name]
    points = fault_points(template, tmp_path, scenario)
    for n in range(1, len(points) + 2):
        root = fresh(template, tmp_path, n)
        cut, acked = PowerCut(DurableState(root), n), []
        with monkeypatch.context() as patched:
            cut.disk.install(patched)
            previous = store_module.set_fault_hook(cut)
            try:
                scenario.op(CorpusStore(root), acked.append)
            except PowerLoss:
                pass
            finally:
                store_module.set_fault_hook(previous)
            cut.disk.restore(cut.left if cut.left is not None else cut.disk.survivors())
        where = (
            f"{name}, power lost at {n}/{len(points)} ({points[n - 1] if n <= len(points) else 'after it returned'})"
        )
        check_after_crash(root, scenario, acked, where)
        shutil.rmtree(root)


def test_a_missing_fsync_of_a_segment_is_found(template, tmp_path, monkeypatch):
    """The simulation sees what SIGKILL cannot: vectors renamed into place without an fsync are
    empty after a power loss, and the committed manifest would name them."""
    real = store_module.write_atomic

    def no_fsync_for_vectors(path, data, durable=True):
        real(path, data, durable=durable and not path.name.endswith(".safetensors"))

    monkeypatch.setattr(store_module, "write_atomic", no_fsync_for_vectors)
    root = fresh(template, tmp_path, 1)
    disk = DurableState(root)
    with monkeypatch.context() as patched:
        disk.install(patched)
        op_append(CorpusStore(root), lambda label: None)
        disk.restore(disk.survivors())
    with pytest.raises(AssertionError, match="checksum mismatch|missing"):
        state_append(CorpusStore(root))


def test_the_fault_point_variable_kills_a_real_process(template, tmp_path):
    """$QRAG_FAULT_POINT in a fresh interpreter (as a server would be started under test)."""
    root = fresh(template, tmp_path, 1)
    points = fault_points(template, tmp_path, SCENARIOS["append"])
    code = (
        f"from qrag.index.store import CorpusStore\nimport test_store_faults as t\n"
        f"t.op_append(CorpusStore({str(root)!r}), print)"
    )
    env = {
        **os.environ,
        FAULT_ENV: str(len(points) // 2),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), str(ROOT / "tests")]),
    }
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL and "new" not in proc.stdout, proc.stderr
    assert state_append(CorpusStore(root)) == "old"
    env[FAULT_ENV] = "soon"
    proc = subprocess.run(
        [sys.executable, "-c", "import qrag.index.store"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1 and "QRAG_FAULT_POINT must be a positive integer" in proc.stderr
