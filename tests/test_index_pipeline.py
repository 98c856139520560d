"""The pipelined library indexing path (qrag.index.pipeline via LocalIndex.add_documents): the same
files as the sequential path, byte for byte; a writer failure is raised in the caller with the
corpus committed up to the last whole batch, and resume finishes it without re-embedding."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

from qrag.index.local import LocalIndex
from qrag.index.pipeline import Group, GroupBuilder, document_groups, index_groups
from qrag.index.store import CorpusStore
from qrag.retrieval.embedder import load_embedding_model, resolve_source
from test_index import corpus_rows, make_documents

SHARDS = 3


@pytest.fixture(scope="module")
def model(tiny_encoder):
    return load_embedding_model(resolve_source(None, tiny_encoder), "cpu", positions="relative")


def build(model, root, docs, *, pipelined=True, commit_chunks=10, chunk_batch=4, name="c", **kw):
    store = CorpusStore(root)
    index = LocalIndex(store, model, chunk_batch=chunk_batch, commit_chunks=commit_chunks, pipelined=pipelined)
    if name not in store.names():
        index.create(name, chunk_tokens=24, shards=SHARDS)
    index.add_documents(name, docs, **kw)
    return store, index


def snapshot(store: CorpusStore, name: str = "c"):
    """The corpus on disk without what differs between any two writes: the uid, the clock, the
    random suffix of vector file names. Every listed file's bytes; every file in the folder."""
    m = store.read(name)
    root = store.path(name)

    def norm(path: str) -> str:
        return re.sub(r"\.[0-9a-f]{6}\.safetensors$", ".safetensors", path)

    written = m.to_json()["batches"]  # as corpus.json has them
    batches = []
    for b in written:
        shards = [{**s, "vectors": {**s["vectors"], "file": norm(s["vectors"]["file"])}} for s in b["shards"]]
        batches.append({**b, "shards": shards})
    listed = {
        norm(s[k]["file"]): (root / s[k]["file"]).read_bytes()
        for b in written
        for s in b["shards"]
        for k in ("vectors", "texts")
    }
    listed |= {b["docs"]["file"]: (root / b["docs"]["file"]).read_bytes() for b in written}
    on_disk = sorted(norm(str(p.relative_to(root))) for p in root.rglob("*") if p.is_file())
    head = {k: v for k, v in m.__dict__.items() if k not in ("uid", "created", "updated", "batches")}
    return head, batches, listed, on_disk


def test_pipelined_writes_the_same_files_as_sequential(model, tmp_path, monkeypatch):
    docs = make_documents(14, seed=5)
    seq_store, seq = build(model, tmp_path / "seq", docs, pipelined=False)
    # A slow writer: the embed stage runs ahead until the writer's queue is full (backpressure).
    real_append = CorpusStore.append

    def slow_append(self, *a, **kw):
        time.sleep(0.05)
        return real_append(self, *a, **kw)

    monkeypatch.setattr(CorpusStore, "append", slow_append)
    seen = []
    pipe_store, pipe = build(
        model, tmp_path / "pipe", docs, pipelined=True, progress=lambda done, known: seen.append((done, known))
    )
    monkeypatch.undo()

    m = pipe_store.read("c")
    assert len(m.batches) >= 4 and m.chunks > 4 * 10  # several batches, several encoder calls each
    assert all(b.chunks >= 10 for b in m.batches[:-1])
    assert pipe.last_stats.pipelined and pipe.last_stats.commits == len(m.batches)
    assert pipe.last_stats.embed_waiting_for_writer > 0  # the writer did hold the embed stage back
    assert not seq.last_stats.pipelined and seq.last_stats.commits == len(m.batches)
    assert seen[-1] == (m.chunks, m.chunks) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    a, b = snapshot(seq_store), snapshot(pipe_store)
    assert a[0] == b[0] and a[1] == b[1]  # the manifest: counts, positions, batches, sha256 sums
    assert a[2].keys() == b[2].keys() and all(a[2][k] == b[2][k] for k in a[2])  # file bytes
    assert a[3] == b[3]  # no other files

    # One batch per call (commit_chunks=None) holds the same rows in the same positions.
    one_store, _ = build(model, tmp_path / "one", docs, commit_chunks=None)
    assert len(one_store.read("c").batches) == 1
    assert corpus_rows(one_store, "c")[0] == corpus_rows(pipe_store, "c")[0]
    np.testing.assert_allclose(corpus_rows(one_store, "c")[1], corpus_rows(pipe_store, "c")[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pipelined", [True, False])
def test_writer_failure_is_raised_and_resume_finishes_without_reembedding(model, tmp_path, monkeypatch, pipelined):
    docs = make_documents(14, seed=5)
    ref_store, _ = build(model, tmp_path / "ref", docs, pipelined=False)
    ref = ref_store.read("c")
    assert len(ref.batches) >= 4

    real_write = CorpusStore._write_segment
    calls = {"n": 0}

    def failing_write(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 2 * SHARDS + 2:  # the third batch, after its first shard was written
            time.sleep(0.3)  # meanwhile the next batches reach the writer's queue: none may commit
            raise OSError(28, "No space left on device")
        return real_write(self, *a, **kw)

    monkeypatch.setattr(CorpusStore, "_write_segment", failing_write)
    with pytest.raises(OSError, match="No space left"):
        build(model, tmp_path / "run", docs, pipelined=pipelined)
    monkeypatch.undo()

    store = CorpusStore(tmp_path / "run", clean=False)
    m = store.read("c")
    assert [b.chunks for b in m.batches] == [b.chunks for b in ref.batches[:2]]  # up to the last whole batch
    assert m.chunks == sum(b.chunks for b in ref.batches[:2])
    assert corpus_rows(store, "c")[0] == corpus_rows(ref_store, "c")[0][: m.chunks]
    assert any(p.name.startswith("batch_000003") for p in store.path("c").rglob("*"))  # the failed batch's debris

    before = model.chunks_embedded
    store2, index = build(model, tmp_path / "run", docs, pipelined=pipelined, resume=True)
    assert model.chunks_embedded - before == ref.chunks - m.chunks  # committed batches not embedded again
    assert snapshot(store2) == snapshot(ref_store)  # as if never interrupted, byte for byte
    assert index.add_documents("c", docs, resume=True).version == store2.read("c").version  # nothing left to do


def build_with_process_writer(model, root, docs, **kw):
    store = CorpusStore(root)
    index = LocalIndex(store, model, chunk_batch=4, commit_chunks=10, writer="process")
    if "c" not in store.names():
        index.create("c", chunk_tokens=24, shards=SHARDS)
    index.add_documents("c", docs, **kw)
    return store, index


def test_a_writer_process_writes_the_same_files(model, tmp_path):
    """The store writer in a child process (qrag.index.writer_process): the sequential run's files,
    byte for byte, and the same commits reported in this process."""
    docs = make_documents(14, seed=5)
    seq_store, _ = build(model, tmp_path / "seq", docs, pipelined=False)
    commits = []
    proc_store, index = build_with_process_writer(model, tmp_path / "proc", docs, on_commit=commits.append)
    m = proc_store.read("c")
    assert len(m.batches) >= 4 and index.last_stats.writer == "process" and index.last_stats.commits == len(m.batches)
    assert [c.version for c in commits] == sorted(c.version for c in commits) and commits[-1].version == m.version
    assert index.last_stats.write_seconds > 0
    assert snapshot(proc_store) == snapshot(seq_store)


def test_a_batch_packed_for_the_writer_process_unpacks_to_itself(model):
    from qrag.index.writer_process import pack_batch, unpack_batch

    docs = make_documents(3, seed=2)
    chunks, ids = model.chunk_documents(docs, 24)
    vectors = np.arange(len(chunks) * 4, dtype=np.float32).reshape(len(chunks), 4)
    got_docs, got_chunks, got_ids, got_vectors = unpack_batch(pack_batch(docs, chunks, ids, vectors))
    assert got_docs == docs and got_chunks == chunks and got_vectors is vectors
    assert len(got_ids) == len(ids) and all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(got_ids, ids))
    assert unpack_batch(pack_batch([], [], [], vectors[:0]))[1:3] == ([], [])


def test_a_writer_process_failure_is_raised_and_nothing_after_it_commits(model, tmp_path):
    """A batch the store refuses in the child (a document already in the corpus, at the third
    batch) is raised here; the batches after it are not written; resume of the rest works."""
    docs = make_documents(14, seed=5)
    ref_store, _ = build(model, tmp_path / "ref", docs, pipelined=False)
    ref = ref_store.read("c")
    store = CorpusStore(tmp_path / "run")
    LocalIndex(store, model).create("c", chunk_tokens=24, shards=SHARDS)
    groups = list(document_groups(docs, lambda block: model.chunk_documents(block, 24), 10))
    assert len(groups) >= 4
    groups[2].docs.append(groups[0].docs[0])  # committed with the first batch: the store refuses it
    from qrag.index.store import CorpusConflict

    with pytest.raises(CorpusConflict):
        index_groups(store, "c", model, groups, chunk_batch=4, writer="process")
    m = store.read("c")
    assert [b.chunks for b in m.batches] == [b.chunks for b in ref.batches[:2]]
    store2, _ = build_with_process_writer(model, tmp_path / "run", docs, resume=True)
    assert snapshot(store2) == snapshot(ref_store)


def test_a_writer_process_that_dies_is_an_error_not_a_hang(model, tmp_path):
    import psutil

    docs = make_documents(14, seed=5)

    def kill_the_writer(manifest):
        for child in psutil.Process().children():
            if "qrag.index.writer_process" in " ".join(child.cmdline()):
                child.kill()

    with pytest.raises(RuntimeError, match="index writer process exited with code"):
        build_with_process_writer(model, tmp_path / "run", docs, on_commit=kill_the_writer)
    store = CorpusStore(tmp_path / "run", clean=False)
    assert 1 <= len(store.read("c").batches) < 4  # whole batches only


def test_a_writer_process_stops_when_closed_even_if_a_forked_process_holds_its_pipe(tmp_path):
    """A process forked after the child started (as a fork-started pool grows its workers) holds
    the write end of the child's stdin: end of file never came, close() waited 30 s and killed
    the child. The explicit stop message ends it at once, with exit code 0."""
    import multiprocessing

    from qrag.index.writer_process import ChildWriter

    store = CorpusStore(tmp_path)
    writer = ChildWriter(store.root, "c", "fingerprint")
    holder = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
    holder.start()
    try:
        t0 = time.perf_counter()
        writer.close()
        assert writer.proc.returncode == 0 and time.perf_counter() - t0 < 10
    finally:
        holder.kill()
        holder.join()


class _Recorded:
    """A model on one 'device': records the groups it embeds; can fail at its n-th group."""

    def __init__(self, model, fail_at: int | None = None):
        self.model, self.fail_at, self.calls = model, fail_at, []
        self.fingerprint, self.device = model.fingerprint, "cpu"

    def embed_chunks(self, seqs):
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise RuntimeError("this device failed")
        self.calls.append(len(seqs))
        return self.model.embed_chunks(seqs)


def test_replicas_embed_groups_round_robin_and_the_files_are_one_devices(model, tmp_path):
    """``replicas``: groups go to the model and its replicas in turn (one feeder thread each) and
    are committed in group order: the files of the sequential run on one device."""
    docs = make_documents(14, seed=5)
    seq_store, _ = build(model, tmp_path / "seq", docs, pipelined=False)
    store = CorpusStore(tmp_path / "two")
    LocalIndex(store, model).create("c", chunk_tokens=24, shards=SHARDS)
    groups = list(document_groups(docs, lambda block: model.chunk_documents(block, 24), 10))
    first, second = _Recorded(model), _Recorded(model.replica("cpu"))
    _, stats = index_groups(store, "c", first, groups, chunk_batch=1000, replicas=[second])
    assert stats.devices == 2 and stats.commits == len(groups) >= 4
    assert first.calls == [len(g.ids) for g in groups[0::2]] and second.calls == [len(g.ids) for g in groups[1::2]]
    assert snapshot(store) == snapshot(seq_store)


def test_a_failing_replica_is_raised_and_only_the_groups_before_it_commit(model, tmp_path):
    docs = make_documents(14, seed=5)
    ref_store, _ = build(model, tmp_path / "ref", docs, pipelined=False)
    store = CorpusStore(tmp_path / "run")
    LocalIndex(store, model).create("c", chunk_tokens=24, shards=SHARDS)
    groups = list(document_groups(docs, lambda block: model.chunk_documents(block, 24), 10))
    with pytest.raises(RuntimeError, match="this device failed"):
        index_groups(
            store, "c", _Recorded(model), groups, chunk_batch=1000, replicas=[_Recorded(model, fail_at=1)]
        )  # group 3
    m = store.read("c")
    assert [b.chunks for b in m.batches] == [b.chunks for b in ref_store.read("c").batches[:3]]
    with pytest.raises(ValueError, match="same model"):
        other = _Recorded(model)
        other.fingerprint = "another"
        index_groups(store, "c", model, [], chunk_batch=4, replicas=[other])


def test_prep_failure_is_raised_after_the_whole_batches_before_it(model, tmp_path):
    store = CorpusStore(tmp_path)
    index = LocalIndex(store, model)
    index.create("c", chunk_tokens=24, shards=2)
    docs = make_documents(4)

    def groups():
        for d in docs[:3]:
            chunks, ids = prepare([d])
            yield Group([d], chunks, ids)
        raise RuntimeError("the tokenizer worker died")

    def prepare(block):
        from qrag.data.documents import chunk_documents

        chunks = chunk_documents(block, model.count_tokens, 24)
        return chunks, model.tokenize_chunks([c.text for c in chunks], 24)

    with pytest.raises(RuntimeError, match="worker died"):
        index_groups(store, "c", model, groups(), chunk_batch=4, pipelined=True)
    m = store.read("c")
    assert m.documents == 3 and store.doc_ids(m) == ["doc-0", "doc-1", "doc-2"] and len(m.batches) == 3


def test_groups_are_whole_documents_whatever_the_tokenising_blocks():
    docs = make_documents(9, seed=2)

    def prepare(block):  # 1 + index % 4 chunks per document
        from qrag.data.documents import DocumentChunk

        chunks = [DocumentChunk(d.id, f"{d.id}/{k}", 3) for d in block for k in range(1 + int(d.id.split("-")[1]) % 4)]
        return chunks, [np.array([k], np.int32) for k in range(len(chunks))]

    def shape(groups):
        return [([d.id for d in g.docs], [c.text for c in g.chunks]) for g in groups]

    ref = shape(document_groups(docs, prepare, commit_chunks=5, block_docs=100))
    assert len(ref) > 2 and all(len(chunks) >= 5 for _, chunks in ref[:-1])
    for block_docs in (1, 2, 4):
        assert shape(document_groups(docs, prepare, commit_chunks=5, block_docs=block_docs)) == ref
    assert len(list(document_groups(docs, prepare, commit_chunks=None))) == 1
    assert GroupBuilder(3).flush() is None


def test_segment_text_lines_are_the_json_they_always_were():
    import json

    from qrag.index.store import _encode_texts

    texts = ["plain", "“quoted” é 中", 'q"b\\s\n\t\x00\x1f\x7f\u2028', "", "</script>", "emoji 😀"]
    positions = np.arange(len(texts), dtype=np.int64) * 123456789012
    for doc in [*texts, np.str_("numpy-str")]:
        lines = [
            json.dumps({"position": int(p), "doc": doc, "text": t}, ensure_ascii=False)
            for p, t in zip(positions, texts)
        ]
        assert _encode_texts(positions, [doc] * len(texts), texts) == ("\n".join(lines) + "\n").encode("utf-8")
    assert _encode_texts(positions[:0], [], []) == b""


def test_host_settings_while_feeding_a_gpu_are_set_then_restored(tmp_path):
    """Feeding a GPU, torch's CPU pool only spins on cores the tokenisers need (13 CPU-seconds
    against 2.2 for the same embedding on an H100), and at Python's 5 ms GIL interval the feeding
    thread waits for the GIL after every op: index_groups runs with one thread and a short
    interval, then gives both back, also after a failure; on CPU nothing changes."""
    import sys

    import torch

    from qrag.model.encoder import FEEDING_SWITCH_S, host_settings_while_feeding

    threads, switch = torch.get_num_threads(), sys.getswitchinterval()
    assert switch != FEEDING_SWITCH_S
    seen = []

    class GpuModel:  # only what index_groups reads before the failing group
        device = torch.device("cuda")
        fingerprint = "x"

        def embed_chunks(self, seqs):
            seen.append((torch.get_num_threads(), sys.getswitchinterval()))
            raise RuntimeError("stop here")

    store = CorpusStore(tmp_path)
    from qrag.config import ModelConfig

    store.create("c", fingerprint="x", model=ModelConfig(), dim=4, chunk_tokens=8, shards=1)
    group = Group(docs=[], chunks=[], ids=[np.array([1, 2, 3])])
    with pytest.raises(RuntimeError, match="stop here"):
        index_groups(store, "c", GpuModel(), [group], chunk_batch=4, pipelined=False)
    assert seen == [(1, pytest.approx(FEEDING_SWITCH_S))]
    assert (torch.get_num_threads(), sys.getswitchinterval()) == (threads, switch)
    with host_settings_while_feeding(torch.device("cpu")):
        assert (torch.get_num_threads(), sys.getswitchinterval()) == (threads, switch)
    with host_settings_while_feeding(torch.device("cuda"), None, None):
        assert (torch.get_num_threads(), sys.getswitchinterval()) == (threads, switch)
    with host_settings_while_feeding(torch.device("cuda"), None):  # the interval alone
        assert torch.get_num_threads() == threads and sys.getswitchinterval() == pytest.approx(FEEDING_SWITCH_S)
    # Two indexing jobs overlapping (job_workers > 1): the settings come back when the last one ends.
    first, second = host_settings_while_feeding(torch.device("cuda")), host_settings_while_feeding(torch.device("cuda"))
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert torch.get_num_threads() == 1 and sys.getswitchinterval() == pytest.approx(FEEDING_SWITCH_S)
    second.__exit__(None, None, None)
    assert (torch.get_num_threads(), sys.getswitchinterval()) == (threads, switch)


def test_shard_files_written_side_by_side_are_the_serial_files(model, tmp_path, monkeypatch):
    """A large batch's shard segments are written by threads at once (qrag.index.store
    PARALLEL_SHARD_WRITES_FROM); the files are those of one shard after another, and a shard
    whose write fails leaves the corpus as it was (no commit), cleaned up by the next write."""
    import qrag.index.store as store_mod

    docs = make_documents(14, seed=5)
    monkeypatch.setattr(store_mod, "PARALLEL_SHARD_WRITES_FROM", 10**9)
    serial, _ = build(model, tmp_path / "serial", docs, pipelined=False)
    monkeypatch.setattr(store_mod, "PARALLEL_SHARD_WRITES_FROM", 1)
    threads_seen = set()
    real_write = CorpusStore._write_segment

    def recording(self, m, shard, *args):
        import threading

        threads_seen.add(threading.current_thread().name.split("_")[0])
        return real_write(self, m, shard, *args)

    monkeypatch.setattr(CorpusStore, "_write_segment", recording)
    parallel, _ = build(model, tmp_path / "parallel", docs, pipelined=False)
    assert snapshot(parallel) == snapshot(serial) and threads_seen == {"qrag-store-shard"}

    before = snapshot(parallel)

    def failing(self, m, shard, *args):
        if shard == 1:
            raise OSError("disk full (shard 1)")
        return real_write(self, m, shard, *args)

    monkeypatch.setattr(CorpusStore, "_write_segment", failing)
    more = make_documents(3, seed=9)
    more = [type(d)(f"more-{d.id}", d.text) for d in more]
    chunks, ids = model.chunk_documents(more, 24)
    with pytest.raises(OSError, match="shard 1"):
        parallel.append("c", more, chunks, ids, model.embed_chunks(ids), model.fingerprint)
    assert snapshot(CorpusStore(tmp_path / "parallel")) == before  # opening the store removes the strays


def test_packed_chunks_come_back_as_they_went():
    """What crosses from a tokenising worker: chunks and their id arrays, packed and unpacked."""
    import numpy as np

    from qrag.data.documents import DocumentChunk, pack_chunks, unpack_chunks

    chunks = [DocumentChunk("a", "one two", 2), DocumentChunk("a", "three", 1), DocumentChunk("b", "", 0)]
    ids = [np.array([101, 7, 8, 102]), np.array([101, 9, 102]), np.array([101, 102])]
    back_chunks, back_ids = unpack_chunks(pack_chunks(chunks, ids))
    assert back_chunks == chunks
    assert [x.tolist() for x in back_ids] == [x.tolist() for x in ids]
    assert unpack_chunks(pack_chunks([], [])) == ([], [])


class _Queued:
    """A model whose calls are queued (``embed_chunks_start``) and waited for later, as on a GPU:
    records ("start", n) and ("wait", n) in the order they happen."""

    def __init__(self, model):
        self.model, self.events = model, []
        self.fingerprint, self.device = model.fingerprint, "cpu"
        self.lock = threading.Lock()

    def embed_chunks_start(self, seqs):
        with self.lock:
            self.events.append(("start", len(seqs)))
        out = self.model.embed_chunks(seqs)

        def wait():
            with self.lock:
                self.events.append(("wait", len(seqs)))
            return out

        return wait


def test_slices_cut_the_blocks_as_they_would_cut_one_list():
    from qrag.index.pipeline import id_slices

    seqs = [np.array([k], np.int32) for k in range(11)]
    for blocks in ([seqs], [seqs[:3], [], seqs[3:4], seqs[4:11]], [[s] for s in seqs]):
        got = [[int(x[0]) for x in s] for s in id_slices(blocks, 4)]
        assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert list(id_slices([[], []], 4)) == []


def test_the_device_gets_the_next_groups_slice_before_the_last_one_is_waited_for(model, tmp_path):
    """Groups of one slice each: the next slice is queued while the one ahead of it is still being
    waited for, across group boundaries (group by group, the device waited for the host at each
    group's end), and never two ahead."""
    docs = make_documents(14, seed=5)
    seq_store, _ = build(model, tmp_path / "seq", docs, pipelined=False)
    store = CorpusStore(tmp_path / "run")
    LocalIndex(store, model).create("c", chunk_tokens=24, shards=SHARDS)
    groups = list(document_groups(docs, lambda block: model.chunk_documents(block, 24), 10))
    started = [threading.Event() for _ in groups]

    class Gated(_Queued):
        """A slice's wait ends only once the next slice is queued (as a GPU still busy with it)."""

        def embed_chunks_start(self, seqs):
            k = sum(e == "start" for e, _ in self.events)
            started[k].set()
            inner = super().embed_chunks_start(seqs)

            def wait():
                if k + 1 < len(started) and not started[k + 1].wait(10):
                    self.events.append(("late", k))
                out = inner()
                self.events.append(("done", k))
                return out

            return wait

    queued = Gated(model)
    index_groups(store, "c", queued, groups, chunk_batch=1000)
    sizes = [len(g.ids) for g in groups]
    assert len(sizes) >= 4 and [n for e, n in queued.events if e == "start"] == sizes
    assert not [k for e, k in queued.events if e == "late"]
    order = [e for e, _ in queued.events if e in ("start", "done")]
    for k in range(len(sizes) - 2):  # slice k+2 is queued only after slice k is done
        assert [i for i, e in enumerate(order) if e == "start"][k + 2] > [
            i for i, e in enumerate(order) if e == "done"
        ][k]
    assert snapshot(store) == snapshot(seq_store)


def test_a_streamed_group_is_embedded_as_its_blocks_come_and_writes_the_same_files(model, tmp_path):
    """Group.pending: the device starts on a group's first blocks while its last block is still
    being tokenised; the files are those of whole groups, byte for byte (the same slices)."""
    docs = make_documents(14, seed=5)
    seq_store, _ = build(model, tmp_path / "seq", docs, pipelined=False, chunk_batch=4)
    whole = list(document_groups(docs, lambda block: model.chunk_documents(block, 24), 10))
    last_block = threading.Event()
    counts = []

    def streamed(g):
        def blocks():
            for lo in range(0, len(g.ids), 3):  # blocks of 3 chunks, slices of 4: cut across blocks
                if lo + 3 >= len(g.ids) and g is whole[0]:
                    assert last_block.wait(10)
                yield g.chunks[lo : lo + 3], g.ids[lo : lo + 3]
            counts.append(len(g.ids))

        return Group(docs=list(g.docs), pending=blocks())

    class Releasing(_Queued):
        def embed_chunks_start(self, seqs):
            last_block.set()  # only a slice started before the first group's last block releases it
            return super().embed_chunks_start(seqs)

    store = CorpusStore(tmp_path / "run")
    LocalIndex(store, model).create("c", chunk_tokens=24, shards=SHARDS)
    _, stats = index_groups(store, "c", Releasing(model), [streamed(g) for g in whole], chunk_batch=4)
    assert counts == [len(g.ids) for g in whole]
    assert stats.commits == len(whole) and stats.encoder_tokens == sum(len(x) for g in whole for x in g.ids)
    assert snapshot(store) == snapshot(seq_store)
    # The ramp and the tail: first block in hand, first slice queued, last slice back, all within the run.
    assert 0 <= stats.first_block_at <= stats.first_slice_at <= stats.last_slice_done_at <= stats.seconds
    assert stats.started_at > 0

    # Sequential: the same files from streamed groups.
    store2 = CorpusStore(tmp_path / "seq2")
    LocalIndex(store2, model).create("c", chunk_tokens=24, shards=SHARDS)
    last_block.set()
    index_groups(store2, "c", model, [streamed(g) for g in whole], chunk_batch=4, pipelined=False)
    assert snapshot(store2) == snapshot(seq_store)


def test_a_streamed_groups_failing_block_is_raised_after_the_groups_before_it(model, tmp_path):
    docs = make_documents(14, seed=5)
    whole = list(document_groups(docs, lambda block: model.chunk_documents(block, 24), 10))

    def streamed(k, g):
        def blocks():
            yield g.chunks[:2], g.ids[:2]
            if k == 2:
                raise RuntimeError("a tokenising worker died")
            yield g.chunks[2:], g.ids[2:]

        return Group(docs=list(g.docs), pending=blocks())

    store = CorpusStore(tmp_path / "run")
    LocalIndex(store, model).create("c", chunk_tokens=24, shards=SHARDS)
    with pytest.raises(RuntimeError, match="worker died"):
        index_groups(store, "c", _Queued(model), [streamed(k, g) for k, g in enumerate(whole)], chunk_batch=4)
    assert [b.chunks for b in store.read("c").batches] == [len(g.ids) for g in whole[:2]]
