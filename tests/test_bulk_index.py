"""Bulk indexing through Ray Data (qrag.distributed.bulk_index) on one local Ray (loopback, 2 CPUs):
the corpus equals LocalIndex.add_documents' on the same documents, an interrupted run resumes
without re-embedding what was committed, and bad input names the file and the record."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qrag.config import SearchConfig
from qrag.data.sample import DataError
from qrag.distributed.bulk_index import BulkIndexConfig, bulk_index, expand_inputs, read_records
from qrag.retrieval.embedder import load_embedding_model, resolve_source
from qrag.index.local import LocalIndex
from qrag.index.store import CorpusStore
from test_index import corpus_rows, make_documents

CHUNK_TOKENS = 24
QUESTIONS = ["the painter and the singer", "where did the king meet the queen", "the ship in the harbour"]


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=2, configure_logging=False, log_to_driver=False)
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
    return BulkIndexConfig(corpus="c", inputs=inputs, encoder=tiny_encoder, storage=str(storage), chunk_tokens=CHUNK_TOKENS, shards=2,
                           docs_per_block=2, encode_batch=16, commit_chunks=20, block_bytes=4096, **kw)


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


def test_jsonl_interrupted_after_a_commit_resumes_without_reembedding(ray_local, tiny_encoder, model, reference, tmp_path):
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
    bad.write_text(json.dumps({"id": "a", "text": "Fine text."}) + "\n\n" + json.dumps({"id": "b", "body": "no text"}) + "\n")
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

    assert main(["index", "--corpus", "c", "--input", str(tmp_path / "missing.jsonl"), "--storage", str(tmp_path / "s")]) == 2
    assert f"qrag index: error: {tmp_path / 'missing.jsonl'}: no such file or directory" in capsys.readouterr().err
