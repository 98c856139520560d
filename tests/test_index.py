"""The chunk index (no Ray): chunking documents, persistence, repair, and answers identical to
the offline search over the same corpus read as one long context."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from qrag.config import SearchConfig
from qrag.data.documents import Document, chunk_documents, parse_documents
from qrag.data.sample import DataError, Sample
from qrag.retrieval.embedder import load_embedding_model, resolve_source
from qrag.index.local import LocalIndex
from qrag.index.shards import CorpusShards, ShardOptions, ShardUnhealthy, positions_at
from qrag.index.store import CorpusConflict, CorpusNotFound, CorpusStore, StoreError
from qrag.model.positions import relative_positions
from qrag.retrieval.search import Retriever
from qrag.data.tokens import tokenize_samples

WORDS = "the river castle forest painter singer city novel film war king queen ship harbour lamp garden".split()


def make_documents(n_docs: int, seed: int = 0, sentences: int = 9) -> list[Document]:
    rng = random.Random(seed)
    docs = []
    for d in range(n_docs):
        sents = [
            f"Sentence {d}-{k} tells that the {rng.choice(WORDS)} met the {rng.choice(WORDS)} "
            f"near {rng.choice(WORDS)} {rng.randint(0, 999)}."
            for k in range(sentences)
        ]
        docs.append(Document(f"doc-{d}", " ".join(sents)))
    return docs


def corpus_rows(store: CorpusStore, name: str):
    """Every stored chunk of a corpus by position: (doc id, text, token ids) rows, the vectors, and
    the document ids (the bulk indexer's and the pipeline's tests compare corpora with it)."""
    m = store.read(name)
    rows, vectors = {}, {}
    for batch in m.batches:
        for s in range(m.shards):
            seg, problem = store.read_segment(m, s, batch)
            assert problem is None, problem
            for i, p in enumerate(seg.positions):
                rows[int(p)] = (seg.doc_ids[i], seg.texts[i], tuple(int(t) for t in seg.tokens[i]))
                vectors[int(p)] = seg.vectors[i]
    order = sorted(rows)
    assert order == list(range(m.chunks))
    return [rows[p] for p in order], np.stack([vectors[p] for p in order]), store.doc_ids(m)


@pytest.fixture(scope="module", params=["relative", "none"])
def model(request, tiny_encoder):
    return load_embedding_model(resolve_source(None, tiny_encoder), "cpu", positions=request.param)


def offline(model, chunks: list[str], question: str, cfg: SearchConfig):
    """qrag.retrieval.search.Retriever over the corpus as one sample (document order = corpus order)."""
    sample = Sample("corpus", question, chunks, [])
    tok = tokenize_samples(
        [sample], model.tokenizer, model.layout, chunk_tokens=24, question_tokens=model.question_tokens
    )
    return Retriever(model.qnet, model.layout, torch.device("cpu")).retrieve(tok, cfg)[0]


def test_positions_at_equals_positions_over_the_whole_context():
    torch.manual_seed(0)
    n = 37
    for k in (0, 1, 3, 6):
        selected = torch.zeros(2, n, dtype=torch.bool)
        for r in range(2):
            selected[r, torch.randperm(n)[:k]] = True
        full = relative_positions(selected, torch.tensor([n, n]), 10.0, 9.0)
        sel_sorted = (
            torch.stack([torch.nonzero(row).flatten() for row in selected])
            if k
            else torch.zeros(2, 0, dtype=torch.long)
        )
        for shard, n_shards in ((0, 1), (1, 4), (3, 4)):
            gpos = torch.arange(shard, n, n_shards)
            part = positions_at("relative", gpos, sel_sorted, n, 10.0, 9.0)
            assert torch.equal(part, full[:, gpos])  # bit for bit, not approximately


def test_chunking_keeps_documents_apart_and_cuts_long_sentences(model):
    docs = [Document("a", "One short sentence. " * 3), Document("b", "word " * 100 + "end.")]
    chunks = chunk_documents(docs, model.count_tokens, budget=16)
    assert [c.doc_id for c in chunks][:1] == ["a"] and chunks[-1].doc_id == "b"
    assert all(c.tokens <= 16 for c in chunks)
    assert " ".join(c.text for c in chunks if c.doc_id == "b").split() == docs[1].text.split()


@pytest.mark.parametrize(
    "records, field",
    [
        ([{"id": "x"}], "documents[0].text"),
        ([{"id": "", "text": "t"}], "documents[0].id"),
        ([{"id": "a", "text": "t"}, {"id": "a", "text": "u"}], "documents[1].id"),
        ([{"id": "a", "text": "bad \ud800 text"}], "documents[0].text"),
        ([{"id": "a", "text": "   "}], "documents[0].text"),
        ([{"id": "a", "text": "t", "extra": 1}], "documents[0].extra"),
        ({"id": "a"}, "documents"),
    ],
)
def test_bad_documents_name_the_field(records, field):
    with pytest.raises(DataError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_documents(records)


@pytest.fixture(scope="module")
def indexed(model, tmp_path_factory):
    """The same 12 documents indexed into 1 and into 4 shards, in two append batches each."""
    docs = make_documents(12)
    index = LocalIndex(CorpusStore(tmp_path_factory.mktemp("indexed")), model)
    for shards in (1, 4):
        index.create(f"c{shards}", chunk_tokens=24, shards=shards)
        index.add_documents(f"c{shards}", docs[:7])
        index.add_documents(f"c{shards}", docs[7:])  # positions continue across appends
    m = index.store.read("c4")
    rows = sorted(r for b in m.batches for s in range(m.shards) for r in index.store.read_texts(m, s, b))
    assert [p for p, _, _ in rows] == list(range(m.chunks))
    return index, [t for _, _, t in rows]


@pytest.mark.parametrize(
    "cfg",
    [SearchConfig(max_steps=3), SearchConfig(max_steps=3, beam_width=3), SearchConfig(max_steps=4, stop_threshold=0.0)],
    ids=["greedy", "beam", "threshold"],
)
def test_sharded_answers_equal_offline_search_for_1_and_4_shards(model, indexed, cfg):
    index, corpus = indexed
    stopped = 0
    for question in [
        "who met the painter near the harbour",
        "where is the castle of the queen",
        "the ship and the lamp",
    ]:
        ref = offline(model, corpus, question, cfg)
        for shards in (1, 4):
            got, records, timings = index.retrieve(f"c{shards}", question, cfg)
            assert got.selected == ref.selected, (shards, question)
            assert got.stopped_early == ref.stopped_early
            assert [s.q for s in got.steps] == pytest.approx([s.q for s in ref.steps], abs=1e-5)
            assert [a for s in got.steps for a, _ in s.alternatives] == [
                a for s in ref.steps for a, _ in s.alternatives
            ]
            if model.model_cfg.positions != "none":
                assert [s.position for s in got.steps] == pytest.approx([s.position for s in ref.steps])
            assert all(records[g].text == corpus[g] for g in got.selected)
            assert timings.total > 0
        if cfg.stop_threshold is not None:  # also a threshold that really stops the search early
            q = [s.q for s in offline(model, corpus, question, SearchConfig(max_steps=4)).steps]
            j = next((j for j in range(1, len(q)) if q[j] < min(q[:j])), None)
            threshold = (q[j] + min(q[:j])) / 2 if j is not None else q[0] + 1e-3  # else: stop before the first step
            j = j or 0
            mid = SearchConfig(max_steps=4, stop_threshold=threshold)
            ref = offline(model, corpus, question, mid)
            assert ref.stopped_early and len(ref.selected) == j
            stopped += 1
            for shards in (1, 4):
                got = index.retrieve(f"c{shards}", question, mid)[0]
                assert got.selected == ref.selected and got.stopped_early
    assert cfg.stop_threshold is None or stopped > 0


def test_lockstep_batch_equals_one_by_one(model, tmp_path):
    index = LocalIndex(CorpusStore(tmp_path), model)
    index.create("c", chunk_tokens=24, shards=3)
    index.add_documents("c", make_documents(6))
    questions = ["the king and the queen", "a film about war", "the lamp in the garden"]
    for cfg in (SearchConfig(max_steps=3), SearchConfig(max_steps=3, beam_width=2)):
        many = index.retrieve_many("c", questions, cfg)
        for q, got in zip(questions, many):
            one = index.retrieve("c", q, cfg)[0]
            assert got.selected == one.selected
            assert [s.q for s in got.steps] == pytest.approx([s.q for s in one.steps], abs=1e-5)


def test_searches_parse_the_manifest_only_when_it_changed(model, tmp_path, monkeypatch):
    """Once a corpus's shards are loaded, a search stats corpus.json and parses it only after a
    write (parsing it twice a query was most of the library path's 'tokenize' stage on a
    10M-token corpus); the write's new chunks are searched; a deleted corpus is not found."""
    store = CorpusStore(tmp_path)
    index = LocalIndex(store, model)
    index.create("c", chunk_tokens=24, shards=2)
    index.add_documents("c", make_documents(3))
    cfg = SearchConfig(max_steps=2)
    index.retrieve("c", "the king and the queen", cfg)  # loads the shards
    parsed = []
    read = CorpusStore.read
    monkeypatch.setattr(store, "read", lambda name: parsed.append(name) or read(store, name))
    for _ in range(3):
        index.retrieve("c", "the king and the queen", cfg)
    index.retrieve_many("c", ["a film about war"], cfg)
    assert parsed == []
    before = store.read("c").chunks
    parsed.clear()
    index.add_documents("c", [Document("late", "The harbour lamp was lit by the singer at last.")])
    parsed.clear()
    got, records, _ = index.retrieve("c", "the harbour lamp", SearchConfig(max_steps=before + 1))
    assert parsed, "the write replaced corpus.json: a search reads it again"
    assert sorted(got.selected) == list(range(before + 1)) and records[before].doc_id == "late"
    store.delete("c")
    with pytest.raises(CorpusNotFound):
        index.retrieve("c", "the king", cfg)


def test_faiss_and_torch_scoring_agree(tiny_encoder, tmp_path):
    model = load_embedding_model(resolve_source(None, tiny_encoder), "cpu")
    store = CorpusStore(tmp_path)
    a = LocalIndex(store, model, options=ShardOptions(faiss="always"))
    b = LocalIndex(store, model, options=ShardOptions(faiss="never"))
    a.create("c", chunk_tokens=24, shards=2)
    a.add_documents("c", make_documents(6))
    assert a.shards("c").shards[0].uses_faiss and not b.shards("c").shards[0].uses_faiss
    cfg = SearchConfig(max_steps=3, beam_width=2)
    for q in ("the king and the queen", "a film about war"):
        ra, rb = a.retrieve("c", q, cfg)[0], b.retrieve("c", q, cfg)[0]
        assert ra.selected == rb.selected
        assert [s.q for s in ra.steps] == pytest.approx([s.q for s in rb.steps], abs=1e-5)
    # Above approx_above the FAISS index is HNSW; on a small corpus it still finds the best chunk.
    c = LocalIndex(store, model, options=ShardOptions(faiss="always", approx_above=4))
    assert (
        c.retrieve("c", "the king and the queen", SearchConfig(max_steps=1))[0].selected
        == b.retrieve("c", "the king and the queen", SearchConfig(max_steps=1))[0].selected
    )
    assert type(c.shards("c").shards[0].faiss.index).__name__ == "IndexHNSWFlat"


def test_reload_without_reembedding_and_repair_of_a_corrupt_shard(model, tmp_path):
    store = CorpusStore(tmp_path)
    index = LocalIndex(store, model)
    index.create("c", chunk_tokens=24, shards=2, dtype="float16")
    index.add_documents("c", make_documents(5))
    cfg = SearchConfig(max_steps=2)
    before = index.retrieve("c", "the painter and the singer", cfg)[0]
    embedded = model.chunks_embedded
    fresh = LocalIndex(CorpusStore(tmp_path), model)  # a restart: loads from disk
    again = fresh.retrieve("c", "the painter and the singer", cfg)[0]
    assert again.selected == before.selected and model.chunks_embedded == embedded
    assert fresh.shards("c").loaded_rows == store.read("c").chunks

    m = store.read("c")
    entry = m.batches[0].shards[1]
    path = tmp_path / "c" / entry.vectors.file
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0xFF  # flip bits inside the vectors
    path.write_bytes(bytes(raw))
    with pytest.raises(ShardUnhealthy, match="checksum mismatch") as err:
        LocalIndex(CorpusStore(tmp_path), model).retrieve("c", "x", cfg)
    problem = err.value.problems[0]
    assert problem.repairable and problem.shard == 1
    # Repair: re-embed the segment from its stored texts.
    rows = store.read_texts(m, 1, m.batches[0])
    ids = model.tokenize_chunks([t for _, _, t in rows], m.chunk_tokens)
    store.replace_vectors("c", 1, m.batches[0].id, model.embed_chunks(ids), ids, model.fingerprint)
    repaired = LocalIndex(CorpusStore(tmp_path), model).retrieve("c", "the painter and the singer", cfg)[0]
    assert repaired.selected == before.selected

    # Lost texts cannot be rebuilt: the shard is unhealthy, never served.
    m = store.read("c")
    (tmp_path / "c" / m.batches[0].shards[0].texts.file).unlink()
    with pytest.raises(ShardUnhealthy, match="texts are lost") as err:
        LocalIndex(CorpusStore(tmp_path), model).retrieve("c", "x", cfg)
    assert not err.value.problems[0].repairable


def test_store_errors_and_crash_debris(model, tmp_path):
    store = CorpusStore(tmp_path)
    index = LocalIndex(store, model)
    with pytest.raises(StoreError, match="invalid corpus name"):
        store.create("../x", fingerprint="f", model=model.model_cfg, dim=32, chunk_tokens=24, shards=1)
    index.create("c", chunk_tokens=24, shards=3)
    with pytest.raises(CorpusConflict, match="already exists"):
        index.create("c", chunk_tokens=24, shards=3)
    index.add_documents("c", make_documents(2))
    with pytest.raises(CorpusConflict, match="doc-0"):
        index.add_documents("c", make_documents(3))
    with pytest.raises(CorpusNotFound):
        store.read("nope")
    # A crashed append leaves files the manifest does not list; they are ignored, then removed.
    (tmp_path / "c" / "shard_000" / "batch_000009.abc.safetensors").write_bytes(b"junk")
    cs = CorpusShards(store, "c", [0, 1, 2], torch.device("cpu"))
    cs.sync()
    index.add_documents("c", [Document("new", "A new document. It has two sentences.")])
    assert not (tmp_path / "c" / "shard_000" / "batch_000009.abc.safetensors").exists()
    m = store.read("c")
    assert m.documents == 3 and m.version == 2 and sorted(store.doc_ids(m)) == ["doc-0", "doc-1", "new"]
    assert sum(b.chunks for b in m.batches) == m.chunks
    json.loads((tmp_path / "c" / "corpus.json").read_text())
    store.delete("c")
    assert store.names() == []


def test_merge_hits_keeps_positions_when_an_empty_holder_answers_first():
    """A holder with no shard slots answers zero columns without positions; merging it with a
    rotated shard's hits must keep their positions (it used to drop them, or fail)."""
    import numpy as np

    from qrag.retrieval.hits import ShardHits, merge_hits

    full = ShardHits(
        np.array([[0.9, 0.5], [0.2, 0.7]], np.float32),
        np.array([[3, 5], [4, 6]], np.int64),
        np.array([[1.5, 2.5], [11.0, 12.0]], np.float32),
    )
    merged = merge_hits([ShardHits.empty(2, False), full], k=2)
    assert merged.pos is not None
    assert merged.ids.tolist() == [[3, 5], [6, 4]]
    assert merged.pos.tolist() == [[1.5, 2.5], [12.0, 11.0]]


def wait_saved(index: LocalIndex) -> None:
    for shard in index.shards("c").shards.values():
        assert shard.faiss is None or shard.faiss.wait_saved(30)


def test_hnsw_index_is_saved_beside_the_segments_and_loaded_at_start(tiny_encoder, tmp_path):
    """An approximate (HNSW) index is built once: saved after its build, loaded by the next
    process that opens the corpus (no rebuild), extended by later appends; a corrupt file or
    re-created corpus is ignored (built again), never served."""
    import json as jsonlib

    model = load_embedding_model(resolve_source(None, tiny_encoder), "cpu")
    opts = dict(faiss="always", approx_above=4)
    store = CorpusStore(tmp_path)
    first = LocalIndex(store, model, options=ShardOptions(**opts))
    first.create("c", chunk_tokens=24, shards=2)
    first.add_documents("c", make_documents(6))
    cfg = SearchConfig(max_steps=3)
    questions = ["the king and the queen", "a film about war"]
    want = [first.retrieve("c", q, cfg)[0].selected for q in questions]
    wait_saved(first)  # saved by each shard's saver thread, off the request path
    folder = tmp_path / "c" / "faiss"
    assert sorted(p.name for p in folder.iterdir()) == [
        "shard_000.index",
        "shard_000.json",
        "shard_001.index",
        "shard_001.json",
    ]

    again = LocalIndex(CorpusStore(tmp_path), model, options=ShardOptions(**opts))
    shard = again.shards("c").shards[0]
    assert shard.faiss_loaded_rows == shard.n > 4 and shard.faiss.index is not None  # loaded at start, before any query
    assert [again.retrieve("c", q, cfg)[0].selected for q in questions] == want

    # An append: the loaded index gets the new rows on top and is saved again, covering both batches.
    again.add_documents("c", [Document("extra", "The queen sailed a ship to the castle by the river. " * 3)])
    after = again.retrieve("c", "the queen sailed a ship", cfg)[0].selected
    wait_saved(again)
    covered = jsonlib.loads((folder / "shard_000.json").read_text())["batches"]
    assert len(covered) == 2
    third = LocalIndex(CorpusStore(tmp_path), model, options=ShardOptions(**opts))
    assert third.shards("c").shards[0].faiss_loaded_rows == third.shards("c").shards[0].n
    assert third.retrieve("c", "the queen sailed a ship", cfg)[0].selected == after

    # A corrupt index file is ignored: built again from the vectors, same answers.
    (folder / "shard_001.index").write_bytes(b"not an index")
    fourth = LocalIndex(CorpusStore(tmp_path), model, options=ShardOptions(**opts))
    assert fourth.shards("c").shards[1].faiss_loaded_rows == 0
    assert fourth.retrieve("c", "the queen sailed a ship", cfg)[0].selected == after

    # Flat indexes are not saved (a copy of the vectors), and a re-created corpus ignores old files.
    flat = LocalIndex(CorpusStore(tmp_path / "flat"), model, options=ShardOptions(faiss="always"))
    flat.create("c", chunk_tokens=24, shards=1)
    flat.add_documents("c", make_documents(3))
    flat.retrieve("c", questions[0], cfg)
    assert not (tmp_path / "flat" / "c" / "faiss").exists()
    CorpusStore(tmp_path).delete("c")
    fresh = LocalIndex(CorpusStore(tmp_path), model, options=ShardOptions(**opts))
    fresh.create("c", chunk_tokens=24, shards=2)
    fresh.add_documents("c", make_documents(6))
    assert fresh.shards("c").shards[0].faiss_loaded_rows == 0


def test_an_unwritable_faiss_folder_does_not_fail_queries(tiny_encoder, tmp_path):
    model = load_embedding_model(resolve_source(None, tiny_encoder), "cpu")
    index = LocalIndex(CorpusStore(tmp_path), model, options=ShardOptions(faiss="always", approx_above=4))
    index.create("c", chunk_tokens=24, shards=1)
    index.add_documents("c", make_documents(4))
    (tmp_path / "c" / "faiss").write_text("a file where the folder would go")  # mkdir fails: nothing saved
    exact = LocalIndex(CorpusStore(tmp_path), model, options=ShardOptions(faiss="never"))
    q = "the king and the queen"
    assert (
        index.retrieve("c", q, SearchConfig(max_steps=1))[0].selected
        == exact.retrieve("c", q, SearchConfig(max_steps=1))[0].selected
    )


def test_shards_spread_over_several_devices_answer_as_one_device(model, indexed, monkeypatch):
    """``LocalIndex(device=[...])``: shard s lives on device[s % n] and each device's shards are
    scored in one pass; the answers are those of one device. CI has one kind of device, so the
    second 'device' is told apart by name only: ShardIndex records what it was given."""
    index, corpus = indexed
    import qrag.index.shards as shards_mod

    given: dict[int, object] = {}
    real = shards_mod.ShardIndex.__init__

    def record(self, corpus_name, shard, n_shards, model_cfg, dim, device, options=None):
        given[shard] = device
        real(self, corpus_name, shard, n_shards, model_cfg, dim, device, options)

    monkeypatch.setattr(shards_mod.ShardIndex, "__init__", record)
    spread = LocalIndex(index.store, model, device=["cpu", torch.device("cpu")], replicas=[model.replica("cpu")])
    assert spread.device == torch.device("cpu") and len(spread.devices) == 2
    cfg = SearchConfig(max_steps=3)
    for question in ["who met the painter near the harbour", "the ship and the lamp"]:
        assert spread.retrieve("c4", question, cfg)[0].selected == index.retrieve("c4", question, cfg)[0].selected
    assert sorted(given) == [0, 1, 2, 3] and all(given[s] == spread.devices[s % 2] for s in given)
    with pytest.raises(ValueError, match="at least one device"):
        LocalIndex(index.store, model, device=[])


def test_the_candidate_stage_index_is_loaded_by_the_next_process_that_opens_the_corpus(tiny_encoder, tmp_path):
    """Shards beyond ann_above: the candidate index is built at the first query, saved, and loaded at
    start by the next LocalIndex over the store (no query needed), with the same answers."""
    pytest.importorskip("faiss")
    from qrag.index.ann import AnnSettings

    model = load_embedding_model(resolve_source(None, tiny_encoder), "cpu")
    opts = dict(faiss="never", ann_above=4, ann_settings=AnnSettings(kind="ivf_flat", nlist=2, candidates=64))
    first = LocalIndex(CorpusStore(tmp_path), model, options=ShardOptions(**opts))
    first.create("c", chunk_tokens=24, shards=2)
    first.add_documents("c", make_documents(6))
    cfg = SearchConfig(max_steps=3)
    want = first.retrieve("c", "the king and the queen", cfg)[0].selected
    assert first.shards("c").shards[0].uses_ann
    assert all(s.ann.wait_saved(30) for s in first.shards("c").shards.values())  # the saver threads
    assert sorted(p.name for p in (tmp_path / "c" / "faiss").iterdir()) == [
        "ann_000.index",
        "ann_000.json",
        "ann_001.index",
        "ann_001.json",
    ]
    again = LocalIndex(CorpusStore(tmp_path), model, options=ShardOptions(**opts))
    shard = again.shards("c").shards[0]
    assert shard.ann is not None and shard.ann.loaded_rows == shard.n > 4  # loaded at start
    assert again.retrieve("c", "the king and the queen", cfg)[0].selected == want
