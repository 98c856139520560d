"""corpus.json keeps its layout: a corpus written by the code before the manifest became dataclasses
(tests/data/corpus_v1: two batches, two shards, a job, a re-index with one staged segment) reads,
serves and writes back the same JSON."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from qrag.index.store import (
    Batch,
    CorpusStore,
    FileRef,
    Manifest,
    Reindex,
    SegmentFiles,
    StagedVectors,
    StoreError,
    listed_files,
    segment_positions,
)

WRITTEN_BY_OLD_CODE = Path(__file__).parent / "data" / "corpus_v1"


@pytest.fixture()
def store(tmp_path: Path) -> CorpusStore:
    shutil.copytree(WRITTEN_BY_OLD_CODE, tmp_path, dirs_exist_ok=True)
    return CorpusStore(tmp_path)


def test_the_round_trip_is_byte_for_byte(store):
    raw = (store.path("c") / "corpus.json").read_bytes()
    m = store.read("c")
    assert json.dumps(m.to_json(), indent=1).encode("utf-8") == raw
    assert Manifest.from_json(json.loads(raw)) == m


def test_an_old_manifest_reads_as_dataclasses(store):
    m = store.read("c")
    first, second = m.batches
    assert isinstance(first, Batch) and all(isinstance(s, SegmentFiles) for s in first.shards)
    assert (first.id, first.first, first.chunks, first.documents, first.job) == (1, 0, 4, 2, "0123456789abcdef")
    assert (second.id, second.first, second.chunks, second.job) == (2, 4, 6, None)
    assert isinstance(first.docs, FileRef) and first.docs.file == "docs/batch_000001.jsonl"
    assert first.shards[0].next is None and isinstance(first.shards[1].next, StagedVectors)
    assert first.shards[1].next.fingerprint == "fp-new" and first.shards[1].next.vectors.file.startswith(
        "shard_001/batch_000001."
    )
    assert isinstance(m.reindex, Reindex) and (m.reindex.fingerprint, m.reindex.dim, m.reindex.through) == (
        "fp-new",
        4,
        2,
    )
    assert m.last_batch_id == 2 and m.batch(2) is second and m.batch(3) is None
    # Every listed file is there (nothing removed as stray on open), and every segment is whole.
    on_disk = {f"{p.parent.name}/{p.name}" for p in store.path("c").glob("*/*") if p.is_file()}
    assert on_disk == listed_files(m) and len(on_disk) == 11
    assert all(store.read_segment(m, s, b)[1] is None for b in m.batches for s in range(m.shards))
    assert store.doc_ids(m) == ["a-0", "a-1", "b-0", "b-1", "b-2"]
    assert store.job_batch(m, "0123456789abcdef") is first
    assert [(b.id, s) for b, s in store.reindex_todo(m)] == [(1, 0), (2, 0), (2, 1)]


def _without(data: dict, *keys: str) -> dict:
    return {k: v for k, v in data.items() if k not in keys}


def test_writes_keep_the_layout_key_for_key(store):
    """A staged segment adds its "next" where the old code put it; the swap leaves the layout a
    fresh corpus has (no "next", "reindex": null) and drops the old vectors."""
    path = store.path("c") / "corpus.json"
    before = json.loads(path.read_bytes())
    m = store.read("c")
    for b, s in store.reindex_todo(m):
        n = len(segment_positions(m, s, b))
        m = store.stage_vectors(
            "c", m.uid, "fp-new", s, b.id, np.full((n, 4), 2.0, np.float32), [np.asarray([1, 2], np.int32)] * n
        )
        if (b.id, s) == (1, 0):
            staged = json.loads(path.read_bytes())
            assert _without(staged, "updated", "batches") == _without(before, "updated", "batches")
            assert list(staged["batches"][0]["shards"][0]) == ["chunks", "fingerprint", "vectors", "texts", "next"]
            assert _without(staged["batches"][0]["shards"][0], "next") == before["batches"][0]["shards"][0]
            assert staged["batches"][1:] == before["batches"][1:]
    m, todo = store.finish_reindex("c", m.uid, "fp-new")
    after = json.loads(path.read_bytes())
    assert (
        not todo
        and after["fingerprint"] == "fp-new"
        and after["reindex"] is None
        and after["version"] == before["version"] + 1
    )
    assert list(after) == list(before)
    for old_batch, new_batch in zip(before["batches"], after["batches"]):
        assert list(new_batch) == list(old_batch)
        assert _without(new_batch, "shards") == _without(old_batch, "shards")
        for old_seg, new_seg in zip(old_batch["shards"], new_batch["shards"]):
            assert list(new_seg) == ["chunks", "fingerprint", "vectors", "texts"] and new_seg["fingerprint"] == "fp-new"
            assert new_seg["texts"] == old_seg["texts"] and new_seg["vectors"] != old_seg["vectors"]
    assert all(store.read_segment(m, s, b)[1] is None for b in m.batches for s in range(m.shards))
    assert {f"{p.parent.name}/{p.name}" for p in store.path("c").glob("*/*") if p.is_file()} == listed_files(m)


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d["batches"][0].pop("docs"),
        lambda d: d["batches"][0]["shards"][1].update(chunks="2"),
        lambda d: d["batches"][0]["shards"][1]["next"].pop("vectors"),
        lambda d: d["batches"][1].update(job=7),
        lambda d: d["reindex"].pop("through"),
        lambda d: d.update(batches={}),
    ],
)
def test_a_manifest_of_another_layout_is_unreadable_not_half_read(store, damage):
    path = store.path("c") / "corpus.json"
    data = json.loads(path.read_bytes())
    damage(data)
    path.write_text(json.dumps(data))
    with pytest.raises(StoreError, match="corpus.json is unreadable"):
        store.read("c")
