"""Bulk indexing through Ray Data (qrag.distributed.bulk_index) on one local Ray (loopback, 2 CPUs):
the corpus equals LocalIndex.add_documents' on the same documents, an interrupted run resumes
without re-embedding what was committed; the input readers (qrag.data.records): bad input names
the file and the record, large files read in parts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qrag.config import SearchConfig
from qrag.data.sample import DataError
from qrag.data.records import expand_inputs, plan_parts, read_records
from qrag.distributed.bulk_index import BulkIndexConfig, bulk_index
from qrag.retrieval.embedder import load_embedding_model, resolve_source
from qrag.index.local import LocalIndex
from qrag.index.store import CorpusStore
from test_index import corpus_rows, make_documents

CHUNK_TOKENS = 24
QUESTIONS = ["the painter and the singer", "where did the king meet the queen", "the ship in the harbour"]


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=2,
        configure_logging=False,
        log_to_driver=False,
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model(tiny_encoder):
    return load_embedding_model(resolve_source(None, tiny_encoder), "cpu")


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """The documents indexed in-process by LocalIndex: what the pipeline must reproduce."""
    docs = make_documents(12, seed=3)
    store = CorpusStore(tmp_path_factory.mktemp("reference"))
    index = LocalIndex(store, model)
    index.create("ref", chunk_tokens=CHUNK_TOKENS, shards=2)
    index.add_documents("ref", docs)
    return docs, index


def config(tiny_encoder, storage, inputs, **kw) -> BulkIndexConfig:
    # Tiny blocks and commit groups so that a dozen documents make several blocks and commits.
    return BulkIndexConfig(
        corpus="c",
        inputs=inputs,
        encoder=tiny_encoder,
        storage=str(storage),
        chunk_tokens=CHUNK_TOKENS,
        shards=2,
        docs_per_block=2,
        encode_batch=16,
        commit_chunks=20,
        block_bytes=4096,
        **kw,
    )


def assert_same_corpus(store: CorpusStore, name: str, reference, model) -> None:
    docs, ref_index = reference
    rows, vectors, doc_ids = corpus_rows(store, name)
    ref_rows, ref_vectors, ref_ids = corpus_rows(ref_index.store, "ref")
    assert doc_ids == ref_ids == [d.id for d in docs]
    assert rows == ref_rows
    np.testing.assert_allclose(vectors, ref_vectors, rtol=1e-5, atol=1e-6)
    index = LocalIndex(store, model)
    cfg = SearchConfig(max_steps=2)
    for q in QUESTIONS:
        assert index.retrieve(name, q, cfg)[0].selected == ref_index.retrieve("ref", q, cfg)[0].selected


def test_jsonl_interrupted_after_a_commit_resumes_without_reembedding(
    ray_local, tiny_encoder, model, reference, tmp_path
):
    docs, _ = reference
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"id": d.id, "text": d.text, "title": "ignored"}) + "\n" for d in docs))
    storage = tmp_path / "indexes"

    class Crash(Exception):
        pass

    def crash(manifest):
        raise Crash

    with pytest.raises(Crash):
        bulk_index(config(tiny_encoder, storage, [str(source)]), on_commit=crash)
    first = CorpusStore(storage).read("c")  # the first group is committed, the rest is lost
    assert 0 < first.documents < len(docs) and len(first.batches) == 1

    stats = bulk_index(config(tiny_encoder, storage, [str(source)]))
    total = CorpusStore(storage).read("c").chunks
    assert stats["already_committed"] == first.documents and stats["documents"] == len(docs) - first.documents
    assert stats["chunks_embedded"] == stats["chunks"] == total - first.chunks  # nothing committed was embedded again
    assert stats["commits"] > 1 and stats["corpus_documents"] == len(docs)
    assert {"seconds", "tokens_per_s", "prep_seconds", "embed_seconds", "write_seconds"} <= set(stats)
    assert_same_corpus(CorpusStore(storage), "c", reference, model)

    again = bulk_index(config(tiny_encoder, storage, [str(source)]))  # all committed: a no-op
    assert again["documents"] == again["chunks_embedded"] == 0 and again["corpus_documents"] == len(docs)


def test_text_files_one_document_each(ray_local, tiny_encoder, model, reference, tmp_path):
    docs, _ = reference
    folder = tmp_path / "texts"
    folder.mkdir()
    for i, d in enumerate(docs):  # file names sort in document order; the id is the name without .txt
        (folder / f"{i:02d}.txt").write_text(d.text)
    store_dir = tmp_path / "indexes"
    stats = bulk_index(config(tiny_encoder, store_dir, [str(folder)], format="text"))
    assert stats["files"] == len(docs) and stats["corpus_documents"] == len(docs)
    store = CorpusStore(store_dir)
    rows, vectors, ids = corpus_rows(store, "c")
    ref_rows, ref_vectors, _ = corpus_rows(reference[1].store, "ref")
    assert ids == [f"{i:02d}" for i in range(len(docs))]
    assert [r[1:] for r in rows] == [r[1:] for r in ref_rows]  # same chunks, tokens and vectors; other ids
    np.testing.assert_allclose(vectors, ref_vectors, rtol=1e-5, atol=1e-6)


def test_bad_input_names_the_file_and_the_record(ray_local, tiny_encoder, tmp_path):
    with pytest.raises(DataError, match="no such file or directory"):
        expand_inputs([str(tmp_path / "missing.jsonl")])
    with pytest.raises(DataError, match="no file matches"):
        expand_inputs([str(tmp_path / "*.jsonl")])
    no_id = tmp_path / "no_id.jsonl"
    no_id.write_text(json.dumps({"text": "Some text."}) + "\n{not json\n")
    with pytest.raises(DataError, match=rf"{no_id}: line 1\.id: must be a non-empty string"):
        list(read_records(str(no_id), "jsonl"))
    no_id.write_text(json.dumps({"id": 1, "text": "Some text."}) + "\n{not json\n")
    with pytest.raises(DataError, match=rf"{no_id}: line 2: not JSON"):
        list(read_records(str(no_id), "jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"id": "a", "text": "Fine text."}) + "\n\n" + json.dumps({"id": "b", "body": "no text"}) + "\n"
    )
    with pytest.raises(DataError, match=rf"{bad}: line 3\.text: must be a string"):
        bulk_index(config(tiny_encoder, tmp_path / "indexes", [str(bad)]))
    assert not (tmp_path / "indexes" / "c" / "corpus.json").exists()
    with pytest.raises(DataError, match=r"no such file or directory"):
        bulk_index(config(tiny_encoder, tmp_path / "indexes", [str(tmp_path / "nope.jsonl")]))


def test_inputs_through_fsspec_and_parquet(tmp_path):
    """Any fsspec URL (here memory://) is listed and read alike; parquet rows by id/text columns."""
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs = fsspec.filesystem("memory")
    fs.pipe("/bulk/a.jsonl", b'{"id": "x", "text": "One sentence."}\n')
    fs.pipe("/bulk/b.txt", "Book text.".encode())
    found = expand_inputs(["memory://bulk"])
    assert found == [("memory:///bulk/a.jsonl", "jsonl"), ("memory:///bulk/b.txt", "text")]
    assert [(r, d.id, d.text) for r, d in read_records(*found[1])] == [("file", "b", "Book text.")]
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": ["p1", "p2"], "text": ["First.", ""], "url": ["u", "v"]}), path)
    assert expand_inputs([str(tmp_path / "*.parquet")]) == [(str(path), "parquet")]
    with pytest.raises(DataError, match=rf"{path}: row 1\.text: empty document \(id=p2\)"):
        list(read_records(str(path), "parquet"))
    pq.write_table(pa.table({"id": ["p1"]}), path)
    with pytest.raises(DataError, match="no column 'text'"):
        list(read_records(str(path), "parquet"))


def test_qrag_index_refuses_a_missing_input_before_ray_starts(tmp_path, capsys):
    from qrag.cli import main

    assert (
        main(["index", "--corpus", "c", "--input", str(tmp_path / "missing.jsonl"), "--storage", str(tmp_path / "s")])
        == 2
    )
    assert f"qrag index: error: {tmp_path / 'missing.jsonl'}: no such file or directory" in capsys.readouterr().err


def _jsonl_docs(n: int) -> list[dict]:
    rng = np.random.default_rng(5)
    words = ["alpha", "beta", "gamma", "delta", "épée", "naïve", "東京", "x"]
    return [{"id": f"d{i}", "text": " ".join(rng.choice(words, size=int(rng.integers(1, 30)))) + "."} for i in range(n)]


@pytest.mark.parametrize("part_bytes", [1, 7, 64, 100, 333, 10**9])
def test_jsonl_parts_hold_every_line_once_in_order(tmp_path, part_bytes):
    """A large JSONL file is read as byte ranges, one task each; every line belongs to the range
    it starts in, whatever the cut (mid-line, on a newline, inside a multi-byte character), and
    blank and CRLF lines read as in the whole file."""
    recs = _jsonl_docs(40)
    path = tmp_path / "big.jsonl"
    body = "".join(
        json.dumps(r, ensure_ascii=False) + ("\r\n" if i % 3 == 0 else "\n") + ("\n" if i % 7 == 0 else "")
        for i, r in enumerate(recs)
    )
    path.write_bytes(body.encode())
    parts = plan_parts([(str(path), "jsonl")], part_bytes)
    assert len(parts) == (1 if part_bytes >= len(body.encode()) else -(-len(body.encode()) // part_bytes))
    got = [(d.id, d.text) for _, fmt, a, b in parts for _, d in read_records(str(path), fmt, a, b)]
    assert got == [(r["id"], r["text"]) for r in recs]
    gz = tmp_path / "big.jsonl.gz"
    import gzip

    gz.write_bytes(gzip.compress(body.encode()))
    assert plan_parts([(str(gz), "jsonl")], 7) == [(str(gz), "jsonl", 0, -1)]  # a compressed file cannot be cut


def test_a_bad_line_in_a_later_part_is_named_by_its_byte_offset(tmp_path):
    good = json.dumps({"id": "a", "text": "Fine text."}) + "\n"
    path = tmp_path / "big.jsonl"
    path.write_text(good * 10 + "{not json\n" + good.replace('"a"', '"b"'))
    offset = len(good) * 10
    parts = plan_parts([(str(path), "jsonl")], 2 * len(good))
    with pytest.raises(DataError, match=rf"{path}: line at byte {offset}: not JSON"):
        for _, fmt, a, b in parts:
            list(read_records(str(path), fmt, a, b))
    with pytest.raises(DataError, match=rf"{path}: line 11: not JSON"):  # read whole, by line number
        list(read_records(str(path), "jsonl"))


def test_parquet_parts_are_runs_of_row_groups(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    recs = _jsonl_docs(50)
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": [r["id"] for r in recs], "text": [r["text"] for r in recs]}), path, row_group_size=8)
    parts = plan_parts([(str(path), "parquet")], 300)
    assert len(parts) > 2
    got = [(label, d.id) for _, fmt, a, b in parts for label, d in read_records(str(path), fmt, a, b)]
    assert got == [(f"row {i}", r["id"]) for i, r in enumerate(recs)]  # row numbers run on across parts


def test_a_jsonl_file_read_in_parts_gives_the_same_corpus(ray_local, tiny_encoder, model, reference, tmp_path):
    """One file, several read tasks: the corpus is the one the whole file gives (same order)."""
    docs, _ = reference
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"id": d.id, "text": d.text}) + "\n" for d in docs))
    stats = bulk_index(
        config(tiny_encoder, tmp_path / "indexes", [str(source)], file_part_bytes=source.stat().st_size // 5)
    )
    assert stats["files"] == 1 and stats["parts"] >= 5 and stats["corpus_documents"] == len(docs)
    assert_same_corpus(CorpusStore(tmp_path / "indexes"), "c", reference, model)
