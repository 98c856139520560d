"""Indexing in lanes (qrag.index.lanes: a process per device, commits in order by the caller): the
corpus one process makes; a failure keeps the whole groups before it and resume finishes the rest;
batches written elsewhere commit only in order."""

from __future__ import annotations

import functools
import math
import os
import random
import sys
import time
import json
from pathlib import Path

import numpy as np
import pytest

from qrag.data.documents import Document
from qrag.data.sample import DataError
from qrag.config import ModelConfig
from qrag.index import lanes
from qrag.index.lanes import LaneConfig, LaneError, char_groups, index_in_lanes
from qrag.index.local import LocalIndex
from qrag.index.store import Batch, CorpusConflict, CorpusStore, FileRef, SegmentFiles, StoreError
from qrag.index.tokenise_workers import blocks_of
from qrag.retrieval.embedder import load_embedding_model, resolve_source
from test_index import corpus_rows, make_documents
from test_index_pipeline import snapshot

SHARDS = 3
CHUNK_TOKENS = 24


@pytest.fixture(scope="module")
def model(tiny_encoder):
    return load_embedding_model(resolve_source(None, tiny_encoder), "cpu", positions="relative")


def one_process_corpus(model, root, docs):
    store = CorpusStore(root)
    index = LocalIndex(store, model, chunk_batch=4, commit_chunks=10, pipelined=False)
    index.create("c", chunk_tokens=CHUNK_TOKENS, shards=SHARDS)
    index.add_documents("c", docs)
    return store


def lane_config(model, tiny_encoder, root, **kw) -> LaneConfig:
    make_model = functools.partial(load_embedding_model, resolve_source(None, tiny_encoder), positions="relative")
    return LaneConfig(
        store_root=str(root),
        name="c",
        make_model=make_model,
        tokenizer_dir=tiny_encoder,
        layout=model.layout,
        chunk_tokens=CHUNK_TOKENS,
        workers=1,
        chunk_batch=4,
        block_chars=600,
        **kw,
    )


def new_corpus(model, root) -> CorpusStore:
    store = CorpusStore(root)
    LocalIndex(store, model).create("c", chunk_tokens=CHUNK_TOKENS, shards=SHARDS)
    return store


def assert_same_corpus(a: CorpusStore, b: CorpusStore) -> None:
    rows_a, vec_a, ids_a = corpus_rows(a, "c")
    rows_b, vec_b, ids_b = corpus_rows(b, "c")
    assert rows_a == rows_b
    assert ids_a == ids_b
    np.testing.assert_allclose(vec_a, vec_b, atol=1e-5)  # batched differently: float sums in another order


def test_two_lanes_make_the_corpus_one_process_makes(model, tiny_encoder, tmp_path, monkeypatch):
    """With commits of several groups (COMMIT_SHARE 1: each commit as large as the run so far; a short
    run at the default commits group by group), the groups left waiting are committed at the run's end."""
    monkeypatch.setattr(lanes, "COMMIT_SHARE", 1)
    docs = make_documents(24, seed=3)
    reference = one_process_corpus(model, tmp_path / "one", docs)
    store = new_corpus(model, tmp_path / "lanes")
    commits = []
    m, stats = index_in_lanes(
        store,
        "c",
        docs,
        lane_config(model, tiny_encoder, tmp_path / "lanes"),
        ["cpu", "cpu"],
        commit_chars=1500,
        on_commit=lambda man: commits.append(man.chunks),
    )
    assert_same_corpus(reference, store)
    assert len(store.read("c").batches) > stats.commits == len(commits) >= 3
    assert commits == sorted(commits) and commits[-1] == store.read("c").chunks  # in group order, to the end
    assert [row["lane"] for row in stats.per_lane] == [0, 1]
    assert all(row["commits"] >= 2 for row in stats.per_lane)  # both lanes embedded and wrote groups
    assert stats.chunks == m.chunks == reference.read("c").chunks
    assert stats.encoder_tokens > stats.tokens > 0
    _, _, listed, on_disk = snapshot(store)
    assert sorted(listed) == [p for p in on_disk if p != "corpus.json"]  # no stray files
    # Where the time went: each lane's start in parts, and the wall time the caller waited.
    assert sorted(row["lane"] for row in stats.lane_startup) == [0, 1]
    for row in stats.lane_startup:
        assert (
            0
            <= row["model_seconds"] + row["warm_up_seconds"] + row["workers_after_model_seconds"]
            <= row["seconds"] + 3e-3
        )  # rounded to ms
        assert row["warm_shapes"] == 0  # CPU: no graphs to capture
        assert row["seconds"] <= stats.startup_seconds + 1e-3
    assert stats.total_seconds >= stats.seconds > 0
    for row in stats.per_lane:  # when each lane began, from the moment groups went out (one clock across processes)
        assert 0 <= row["started_after_ready"] <= stats.seconds
        assert 0 <= row["first_slice_at"] <= row["last_slice_done_at"] <= row["seconds"]


def test_a_lanes_tokenising_workers_are_forked_with_its_imports():
    """A lane's workers fork (the start method that copies the lane's imports: each worker importing
    torch and transformers itself made a lane's start 22-34 s on the GPU machines)."""
    from qrag.index.lanes import _worker_context

    ctx = _worker_context()
    assert ctx is not None and ctx.get_start_method() == "fork"


@pytest.mark.slow
def test_a_lane_failure_keeps_whole_groups_and_resume_finishes(model, tiny_encoder, tmp_path):
    docs = make_documents(24, seed=4)
    bad = list(docs)
    bad[15] = Document(docs[15].id, "   ")  # no text to index: the lane tokenising it fails
    store = new_corpus(model, tmp_path / "lanes")
    cfg = lane_config(model, tiny_encoder, tmp_path / "lanes")
    with pytest.raises(DataError, match="doc-15"):  # the input's error, as the one-process path raises it
        index_in_lanes(store, "c", bad, cfg, ["cpu", "cpu"], commit_chars=1500)
    held = store.doc_ids(store.read("c"))
    assert held == [d.id for d in docs[: len(held)]] and len(held) <= 15  # whole groups before the failure, in order
    with pytest.raises(CorpusConflict, match="already in corpus"):  # without resume the committed documents are refused
        index_in_lanes(store, "c", docs, cfg, ["cpu"], commit_chars=1500)
    _, stats = index_in_lanes(store, "c", docs, cfg, ["cpu", "cpu"], commit_chars=1500, resume=True)
    assert stats.documents == len(docs) - len(held)  # nothing committed is embedded again
    assert_same_corpus(one_process_corpus(model, tmp_path / "one", docs), store)
    _, _, listed, on_disk = snapshot(store)
    assert sorted(listed) == [p for p in on_disk if p != "corpus.json"]  # the failed run's files are gone


def index_with_a_duplicate_at_the_end(model, tiny_encoder, root, docs, commit_chars: int) -> CorpusStore:
    """Index ``docs`` and then ``docs[2]`` again in lanes: the run fails on the duplicate."""
    store = new_corpus(model, root)
    with pytest.raises(CorpusConflict, match="doc-2"):
        index_in_lanes(
            store,
            "c",
            [*docs, docs[2]],
            lane_config(model, tiny_encoder, root),
            ["cpu", "cpu"],
            commit_chars=commit_chars,
        )
    return store


def test_a_duplicate_input_document_commits_the_groups_before_it(model, tiny_encoder, tmp_path, monkeypatch):
    """Every whole group before the duplicate is committed, also those still waiting to be committed
    with others (COMMIT_SHARE 1); the documents of the group it would have closed are not."""
    monkeypatch.setattr(lanes, "COMMIT_SHARE", 1)
    docs = make_documents(12, seed=5)
    store = index_with_a_duplicate_at_the_end(model, tiny_encoder, tmp_path / "lanes", docs, commit_chars=700)
    whole = list(char_groups(docs, 700, first_groups=2, first_chars=700 // lanes.FIRST_GROUP_SHRINK))
    if sum(len(d.text) for d in whole[-1]) < 700:
        whole.pop()  # the group the duplicate would have closed
    held = store.doc_ids(store.read("c"))
    assert held == [d.id for g in whole for d in g] and len(held) >= len(docs) // 2


def test_groups_and_blocks_are_whole_documents_by_characters():
    docs = [Document(f"d{i}", "x" * n) for i, n in enumerate([5, 5, 12, 1, 1, 1, 30])]
    assert [[d.id for d in g] for g in char_groups(docs, 10)] == [["d0", "d1"], ["d2"], ["d3", "d4", "d5", "d6"]]
    # A lane's first group smaller (its device starts once that much is tokenised), then full groups.
    assert [[d.id for d in g] for g in char_groups(docs, 10, first_groups=2, first_chars=3)] == [
        ["d0"],
        ["d1"],
        ["d2"],
        ["d3", "d4", "d5", "d6"],
    ]
    assert [[d.id for d in b] for b in blocks_of(docs, 10)] == [["d0", "d1"], ["d2"], ["d3", "d4", "d5", "d6"]]
    assert list(char_groups([], 10)) == []
    with pytest.raises(ValueError):
        list(char_groups(docs, 0))


def test_batches_written_elsewhere_commit_only_in_order(model, tmp_path):
    store = new_corpus(model, tmp_path)
    docs = make_documents(2, seed=6)
    chunks, ids = model.chunk_documents(docs, CHUNK_TOKENS)
    vectors = model.embed_chunks(ids)
    half = [c for c in chunks if c.doc_id == docs[0].id]
    with store.hold("c") as m:
        first = store.write_batch_files(
            m, 1, 0, docs[:1], half, ids[: len(half)], vectors[: len(half)], fingerprint=model.fingerprint
        )
        second = store.write_batch_files(
            m,
            2,
            len(half),
            docs[1:],
            chunks[len(half) :],
            ids[len(half) :],
            vectors[len(half) :],
            fingerprint=model.fingerprint,
        )
        with pytest.raises(StoreError, match="does not follow"):
            store.commit_written(m, second)
        store.commit_written(m, first)
        store.commit_written(m, second)
    reference = one_process_corpus(model, tmp_path / "one", docs)
    assert_same_corpus(reference, store)


def fake_batch(batch_id: int, first: int, chunks: int) -> Batch:
    """A written batch's manifest entry (its files are not needed to commit it)."""
    ref = FileRef(f"shard_000/batch_{batch_id:06d}.jsonl", "0" * 64)
    return Batch(batch_id, first, chunks, 1, chunks * 8, ref, (SegmentFiles(chunks, "fp", ref, ref),))


def test_a_long_load_rewrites_the_manifest_a_logarithmic_number_of_times(tmp_path, monkeypatch):
    """A commit rewrites the whole manifest: one per group made a load's manifest writes grow with
    the square of its groups (at a billion tokens, thousands of rewrites of a manifest of thousands
    of batches). The caller commits the first groups one by one, then several at a time, each commit
    at most 1/COMMIT_SHARE of what the run committed before it (what a crash can lose): the
    manifest is written O(log n) times, every batch's entry O(1) times, and the run ends committed."""
    share, n = lanes.COMMIT_SHARE, 600
    store = CorpusStore(tmp_path)
    store.create("c", fingerprint="fp", model=ModelConfig(), dim=4, chunk_tokens=8, shards=1)
    writes: list[tuple[int, int]] = []  # (batches before, after) per manifest write
    real_write = store._write_manifest

    def counted(m):
        before = writes[-1][1] if writes else 0
        real_write(m)
        writes.append((before, len(m.batches)))

    monkeypatch.setattr(store, "_write_manifest", counted)
    order = list(range(n))  # groups come back written out of order, as from several lanes
    rng = random.Random(0)
    for i in range(0, n, 5):
        order[i : i + 5] = rng.sample(order[i : i + 5], len(order[i : i + 5]))
    seen = []
    with store.hold("c") as m:
        run = lanes._Run(store, m, ["cpu", "cpu"], lambda man: seen.append(man.chunks))
        for k in order:
            run.wrote(k, fake_batch(k + 1, 3 * k, 3), 30)
        assert len(store.read("c").batches) < n  # the last groups wait for enough of them
        run.flush()
    assert [b.id for b in store.read("c").batches] == list(range(1, n + 1)) and store.read("c").chunks == 3 * n
    assert run.stats.commits == len(writes) == len(seen) and seen == sorted(seen) and seen[-1] == 3 * n
    assert (run.stats.chunks, run.stats.encoder_tokens) == (3 * n, 30 * n)
    assert writes[: share + 1] == [(i, i + 1) for i in range(share + 1)]  # the first groups commit one by one
    for before, after in writes:  # what a crash loses: one group, or 1/share of those committed
        assert after - before <= max(1, math.ceil(before / share)), (before, after)
    assert len(writes) <= (share + 1) * (1 + math.log(n)) < n / 3  # one per group: n
    assert sum(after for _, after in writes) <= 2 * (share + 1) * n  # batch entries written; one per group: ~n^2/2


def test_the_serving_bench_indexes_in_lanes(tiny_encoder, shared_data, tmp_path):
    """`bench/serve_scale.py --lanes` (bench/index_lanes.sh on the 2-GPU machine): its lanes build
    their model from a function of the script, in spawned processes."""
    from test_serve_http_bench import run

    books = sorted((shared_data / "gutenberg_novels" / "small_collection_british_fiction").glob("*.txt.gz"))[:1]
    out = tmp_path / "lanes.json"
    run(
        "serve_scale.py",
        "--tokens",
        "6000",
        "--encoder",
        tiny_encoder,
        "--corpus",
        str(books[0]),
        "--shards",
        "2",
        "--lanes",
        "--lane-workers",
        "1",
        "--index-only",
        "--device",
        "cpu",
        "--bare-repeats",
        "1",
        "--bare-tokens",
        "2000",
        "--commit-chunks",
        "40",
        "--doc-tokens",
        "500",
        "--out",
        str(out),
    )
    result = json.loads(out.read_text())
    stages = result["indexing"]["stages"]
    assert stages["lanes"] == 1 and stages["workers_per_lane"] == 1 and stages["commits"] >= 2
    assert result["corpus"]["encoder_tokens"] > 3000 and result["indexing"]["tokens_per_s"] > 0
    assert [row["lane"] for row in stages["per_lane"]] == [0]
    # The bare forward's rate comes from the first committed chunks, not the whole corpus (at 1B tokens
    # reading every chunk back and padding it on the device would outlast the indexing).
    bare = result["indexing"]["bare_forward_tokens"]
    assert 2000 <= bare < result["corpus"]["encoder_tokens"] - 1000


def test_a_lane_that_dies_is_an_error_naming_it_not_a_hang(model, tiny_encoder, tmp_path, monkeypatch):
    mark = f"lane-test-{os.getpid()}-{time.time_ns()}"
    monkeypatch.setenv("QRAG_TEST_MARK", mark)  # inherited by the lane and its forked workers
    store = new_corpus(model, tmp_path / "lanes")
    cfg = lane_config(model, tiny_encoder, tmp_path / "lanes")
    cfg.make_model = functools.partial(exit_in_lane, 3)
    with pytest.raises(LaneError, match=r"lane 0 \(cpu\) exited with code 3"):
        index_in_lanes(store, "c", make_documents(4, seed=7), cfg, ["cpu"], commit_chars=1500)
    assert store.read("c").chunks == 0
    # The dead lane's tokenising workers die with it instead of waiting on its queue forever.
    deadline = time.time() + 10
    while (left := processes_marked(mark)) and time.time() < deadline:
        time.sleep(0.2)
    assert not left, f"tokenising workers outlived their lane: {left}"


def processes_marked(mark: str) -> list[int]:
    """Live processes (not zombies) whose environment holds QRAG_TEST_MARK=mark, other than this
    process and its own children (multiprocessing's resource tracker, which ends with it)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
            state, ppid = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if f"QRAG_TEST_MARK={mark}".encode() in env.split(b"\0") and state not in "ZX" and int(ppid) != os.getpid():
            found.append(int(entry))
    return found


def exit_in_lane(code: int, device: str):
    import os

    os._exit(code)


def test_qrag_index_lanes_makes_the_corpus_and_a_rerun_adds_nothing(model, tiny_encoder, tmp_path, capsys):
    """`qrag index --lanes cpu`: no Ray; the corpus of the one-process path; documents the corpus
    holds are skipped (as the Ray path skips them)."""
    from qrag.cli import main

    docs = make_documents(10, seed=8)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in docs))
    argv = [
        "index",
        "--lanes",
        "cpu",
        "--lane-workers",
        "1",
        "--corpus",
        "c",
        "--input",
        str(path),
        "--storage",
        str(tmp_path / "s"),
        "--encoder",
        tiny_encoder,
        "--chunk-tokens",
        str(CHUNK_TOKENS),
        "--shards",
        str(SHARDS),
        "--commit-chunks",
        "8",
        "--no-progress",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["corpus"]["documents"] == 10 and out["lanes"]["commits"] >= 2
    assert (out["path"], out["devices"]) == ("lanes", ["cpu"])
    store = CorpusStore(tmp_path / "s")
    reference = CorpusStore(tmp_path / "one")
    index = LocalIndex(reference, load_embedding_model(resolve_source(None, tiny_encoder), "cpu"))
    index.create("c", chunk_tokens=CHUNK_TOKENS, shards=SHARDS)
    index.add_documents("c", docs)
    assert_same_corpus(reference, store)
    assert main(argv) == 0  # every document is in the corpus: nothing to do
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["lanes"]["documents"] == 0
    assert main([*argv[:2], "cuda:7", *argv[3:]]) == 2
    assert "cuda:7 is not on this machine" in capsys.readouterr().err


def test_qrag_index_lanes_defaults_three_lanes_a_gpu_and_lane_sized_groups(tmp_path, tiny_encoder, monkeypatch, capsys):
    """Without --lanes-per-device, --commit-chunks and --encode-batch: three lanes per GPU, groups of
    LANE_COMMIT_CHUNKS chunks (the Ray path's 65,536 made a 10M-token corpus 3 groups), the lanes'
    measured slices and worker niceness (not the Ray path's encoder calls)."""
    import torch

    import qrag.index.lanes as lanes
    from qrag.cli import main
    from qrag.index.bulk import lane_devices
    from qrag.index.lanes import LANE_CHUNK_BATCH, LANE_COMMIT_CHUNKS, LANE_WORKER_NICE

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert lane_devices("cuda:0", None) == ["cuda:0"] * 3
    assert lane_devices("gpus", None) == ["cuda:0"] * 3 + ["cuda:1"] * 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    seen = {}

    def fake_index_in_lanes(store, name, docs, cfg, devices, *, commit_chars, resume, on_commit):
        seen.update(
            devices=devices,
            commit_chars=commit_chars,
            batch=cfg.chunk_batch,
            nice=cfg.worker_nice,
            model_batch=cfg.make_model.keywords["chunk_batch"],
            encode_tokens=cfg.make_model.keywords["encode_tokens"],
        )
        return store.read(name), lanes.LaneStats()

    monkeypatch.setattr(lanes, "index_in_lanes", fake_index_in_lanes)
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"id": "a", "text": "One sentence."}) + "\n")
    argv = [
        "index",
        "--lanes",
        "cpu",
        "--corpus",
        "c",
        "--input",
        str(path),
        "--storage",
        str(tmp_path / "s"),
        "--encoder",
        tiny_encoder,
        "--chunk-tokens",
        "16",
        "--no-progress",
    ]
    assert main(argv) == 0
    assert seen == {
        "devices": ["cpu"],
        "commit_chars": LANE_COMMIT_CHUNKS * 16 * 4,
        "batch": LANE_CHUNK_BATCH,
        "nice": LANE_WORKER_NICE,
        "model_batch": LANE_CHUNK_BATCH,
        "encode_tokens": 131072,
    }
    assert (LANE_COMMIT_CHUNKS, LANE_CHUNK_BATCH, LANE_WORKER_NICE) == (4096, 8192, 5)
    assert main([*argv, "--commit-chunks", "100", "--encode-batch", "64", "--encode-tokens", "4096"]) == 0
    assert (seen["commit_chars"], seen["batch"], seen["model_batch"], seen["encode_tokens"]) == (
        100 * 16 * 4,
        64,
        64,
        4096,
    )
    capsys.readouterr()


def test_lane_devices_from_the_command_line():
    from qrag.index.bulk import lane_devices

    assert lane_devices("cpu", None) == ["cpu"]  # one lane on the CPU unless asked
    assert lane_devices("cpu, cpu", 2) == ["cpu"] * 4
    for spec, per_device, message in [
        ("", None, "no device given"),
        ("tpu:0", None, "is no device"),
        ("cpu", 0, "at least 1"),
    ]:
        with pytest.raises(DataError, match=message):
            lane_devices(spec, per_device)


def test_the_caller_exits_at_once_after_a_lane_failed_with_large_groups_on_their_way(tiny_encoder, tmp_path):
    """Groups larger than a pipe's buffer still on their way to a lane that failed: the caller raises
    and its process exits (it waited at exit for a pipe nobody read: a benchmark hung for minutes)."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    script = textwrap.dedent(f"""
        import functools
        from qrag.data.documents import Document
        from qrag.data.sample import DataError
        from qrag.index.lanes import LaneConfig, index_in_lanes
        from qrag.index.local import LocalIndex
        from qrag.index.store import CorpusStore
        from qrag.retrieval.embedder import load_embedding_model, resolve_source

        source = resolve_source(None, {tiny_encoder!r})
        model = load_embedding_model(source, "cpu", positions="relative")
        store = CorpusStore({str(tmp_path / "c")!r})
        LocalIndex(store, model).create("c", chunk_tokens=24, shards=1)
        cfg = LaneConfig(store_root=str(store.root), name="c",
                         make_model=functools.partial(load_embedding_model, source, positions="relative"),
                         tokenizer_dir={tiny_encoder!r}, layout=model.layout, chunk_tokens=24, workers=1,
                         chunk_batch=64)
        big = "The river met the castle near the forest. " * 6000  # ~250 KB a document, a group each
        docs = [Document("doc-0", "   "), *(Document(f"doc-{{k}}", big) for k in range(1, 40))]
        try:
            index_in_lanes(store, "c", docs, cfg, ["cpu"], commit_chars=200_000)
        except DataError as exc:
            print("raised:", exc, flush=True)
    """)
    env = {**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "platform")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "raised:" in done.stdout and "doc-0" in done.stdout


def test_the_serving_bench_indexes_in_lanes_on_gpus_unless_told():
    """`bench/serve_scale.py` indexes as `qrag index --lanes` does on GPUs (its figures are the
    product's path), with the lanes' defaults; one process on the CPU or with --no-lanes."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import serve_scale
    from qrag.index.lanes import LANE_COMMIT_CHUNKS, LANE_WORKER_NICE

    def resolved(argv, devices):
        args = serve_scale.args_parser().parse_args(argv)
        serve_scale.indexing_defaults(args, [torch.device(d) for d in devices])
        return args.lanes, args.commit_chunks, args.worker_nice

    assert resolved([], ["cuda:0"]) == (True, LANE_COMMIT_CHUNKS, LANE_WORKER_NICE)
    assert resolved([], ["cuda:0", "cuda:1"]) == (True, LANE_COMMIT_CHUNKS, LANE_WORKER_NICE)
    assert resolved([], ["cpu"]) == (False, 16384, 0)
    assert resolved(["--no-lanes"], ["cuda:0"]) == (False, 16384, 0)
    assert resolved(["--lanes", "--commit-chunks", "40", "--worker-nice", "0"], ["cpu"]) == (True, 40, 0)


def test_qrag_index_help_names_the_defaults_each_path_takes():
    """--encode-batch, --encode-tokens and --commit-chunks unset take the path's defaults
    (qrag.index.bulk.PATH_DEFAULTS, the lanes' from qrag.index.lanes): the help, which imports
    neither, names them."""
    import argparse

    from qrag.cli.index import index_args, index_config
    from qrag.index.bulk import PATH_DEFAULTS
    from qrag.index.lanes import LANE_CHUNK_BATCH, LANE_COMMIT_CHUNKS, LANE_ENCODE_TOKENS

    assert PATH_DEFAULTS["lanes"] == {
        "encode_batch": LANE_CHUNK_BATCH,
        "encode_tokens": LANE_ENCODE_TOKENS,
        "commit_chunks": LANE_COMMIT_CHUNKS,
    }
    p = argparse.ArgumentParser()
    index_args(p)
    helps = {a.dest: a.help for a in p._actions}
    for dest in ("encode_batch", "encode_tokens", "commit_chunks"):
        assert f"default {PATH_DEFAULTS['lanes'][dest]} in lanes" in helps[dest]
        assert f"{PATH_DEFAULTS['ray'][dest]} on Ray Data" in helps[dest]
    assert f"1/{lanes.COMMIT_SHARE} of the groups the run committed" in helps["commit_chunks"]  # what a crash loses
    cfg = index_config(p.parse_args(["--corpus", "c", "--input", "x.jsonl"]))
    for path, defaults in PATH_DEFAULTS.items():
        settled = cfg.with_defaults(path)
        assert {key: getattr(settled, key) for key in defaults} == defaults
    cfg = index_config(
        p.parse_args(["--corpus", "c", "--input", "x.jsonl", "--encode-batch", "7", "--commit-chunks", "9"])
    )
    settled = cfg.with_defaults("ray")
    assert (settled.encode_batch, settled.commit_chunks, settled.encode_tokens) == (
        7,
        9,
        PATH_DEFAULTS["ray"]["encode_tokens"],
    )


def test_a_groups_count_is_reported_once_its_tokenising_is_done_not_when_it_is_embedded():
    """Counted when the lane's feeder took the group's last block, a lane's writes waited for the
    other lanes' GPU work; now the count goes out from the job that finishes last."""
    from concurrent.futures import Future

    from qrag.data.documents import DocumentChunk, pack_chunks
    from qrag.index.lanes import report_count_when_done

    def block(n: int) -> tuple:
        return pack_chunks([DocumentChunk("d", "t", 1)] * n, [np.arange(3)] * n)

    jobs = [Future() for _ in range(3)]
    reports: list[int] = []
    report_count_when_done(jobs, reports.append)
    jobs[2].set_result(block(5))
    jobs[0].set_result(block(2))
    assert reports == []  # a job still running
    jobs[1].set_result(block(4))
    assert reports == [11]  # once, nobody having read a block
    failed = [Future(), Future()]
    report_count_when_done(failed, reports.append)
    failed[0].set_exception(DataError("doc-1: no text"))
    failed[1].set_result(block(1))
    cancelled = [Future()]
    report_count_when_done(cancelled, reports.append)
    cancelled[0].cancel()
    assert reports == [11]  # never for a group that failed or was cancelled: its feeder raises that
    report_count_when_done([], reports.append)
    assert reports == [11, 0]


def test_groups_go_to_the_lanes_with_room_not_strictly_round_robin():
    import queue
    import threading

    from qrag.index.lanes import put_where_room

    boxes = [queue.Queue(maxsize=1) for _ in range(3)]
    stop = threading.Event()
    assert [put_where_room(boxes, k, k, stop) for k in range(3)] == [0, 1, 2]  # round robin while all keep pace
    boxes[2].get()
    assert put_where_room(boxes, 3, 0, stop) == 2  # lanes 0 and 1 are behind: the next group goes where there is room
    threading.Timer(0.05, boxes[1].get).start()
    assert put_where_room(boxes, 4, 0, stop) == 1  # all full: waits for the first to make room
    threading.Timer(0.05, stop.set).start()
    assert put_where_room(boxes, 5, 0, stop) is None  # stopped while waiting


def test_each_lanes_first_group_is_smaller_so_its_device_starts_sooner():
    """A group is one slice on the device, queued once all of it is tokenised: with full-sized first
    groups an H100 stood idle for the first ~0.5 s of a run (index_one_gpu_round13_h100/)."""
    import queue
    import threading

    from qrag.index.lanes import FIRST_GROUP_SHRINK, _send

    docs = [Document(f"d{i}", "x" * 100) for i in range(44)]
    boxes = [queue.Queue(maxsize=100) for _ in range(2)]
    failure: list[BaseException] = []
    _send(docs, set(), False, "c", 800, boxes, threading.Event(), failure)
    assert not failure
    sent = sorted(item for box in boxes for item in iter(box.get_nowait, None))
    sizes = [len(group) for _, group in sent]
    assert sizes[:2] == [800 // FIRST_GROUP_SHRINK // 100] * 2 and set(sizes[2:]) == {
        8
    }  # one small group per lane, then full ones
    assert [d.id for _, group in sent for d in group] == [d.id for d in docs]  # every document once, in order


def test_the_serving_bench_reports_commits_while_it_indexes(capsys):
    """A run stopped by its call's time limit still says how far and how fast it got."""
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import serve_scale

    progress = serve_scale.CommitProgress(every_s=0.0)
    progress(SimpleNamespace(chunks=1_000_000, tokens=64_000_000))
    assert "1000000 chunks (~64M tokens) committed" in capsys.readouterr().err
    quiet = serve_scale.CommitProgress(every_s=3600.0)
    quiet(SimpleNamespace(chunks=5, tokens=320))
    assert capsys.readouterr().err == ""
