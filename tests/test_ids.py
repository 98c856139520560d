"""Document ids and stored strings (issue 32, high 2): one rule for the characters of an id, applied
at the edge (422 naming ``documents[i].id``); ids compared in NFC; JSONL files that no reader can
split inside a record; and corpora written before the rule (a raw U+2028 in a file) that still
serve, or that answer 503 naming the file and line when a record cannot be read, never 500."""

from __future__ import annotations

import hashlib
import json
import unicodedata

import numpy as np
import pytest

from qrag.config import ModelConfig
from qrag.data.documents import Document, DocumentChunk, parse_documents
from qrag.data.sample import DataError
from qrag.index.store import CorpusConflict, CorpusStore, FileRef
from qrag.serving.service import local_service

from test_service_api import docs_json, loop, make_client, model, serve_cfg  # noqa: F401 (loop, model: fixtures)

# Every character str.splitlines() ends a line at, and other control characters.
LINE_ENDS = ["\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
BAD_ID_CHARS = [*LINE_ENDS, "\x00", "\x1f", "\x7f", "\x9f"]


@pytest.fixture
def client(model, tmp_path, loop):
    return make_client(local_service(serve_cfg(tmp_path), model), loop)


def test_every_line_end_is_in_the_list():
    assert all(len(f"a{c}b".splitlines()) == 2 for c in LINE_ENDS)
    assert {c for c in map(chr, range(0x3000)) if len(f"a{c}b".splitlines()) == 2} == set(LINE_ENDS)


@pytest.mark.parametrize("char", BAD_ID_CHARS, ids=[f"U+{ord(c):04X}" for c in BAD_ID_CHARS])
def test_an_id_with_a_line_end_or_control_character_is_refused(char):
    with pytest.raises(DataError, match=r"documents\[1\]\.id: control character"):
        parse_documents([{"id": "fine", "text": "t"}, {"id": f"bad{char}id", "text": "t"}])


def test_the_edge_refuses_bad_ids_with_422_naming_the_record(client):
    for char in ("\u2028", "\x85", "\x1e", "\x0b"):
        docs = [*docs_json(2), {"id": f"x{char}y", "text": "A text."}]
        r = client("POST", "/v1/corpora", json={"name": "fresh", "documents": docs})
        assert r.status_code == 422 and r.json()["error"]["field"] == "documents[2].id", r.text
        assert client("GET", "/v1/corpora/fresh").status_code == 404
    assert client("POST", "/v1/corpora", json={"name": "books", "documents": docs_json(2)}).status_code == 201
    r = client("POST", "/v1/corpora/books/documents", json={"documents": [{"id": "a\u2028b", "text": "A text."}]})
    assert r.status_code == 422 and r.json()["error"]["field"] == "documents[0].id"
    assert client("POST", "/v1/retrieve", json={"corpus": "books", "question": "the painter"}).status_code == 200


def test_nfc_and_nfd_spellings_of_an_id_are_one_document(client):
    nfc, nfd = "caf\u00e9", "cafe\u0301"
    assert unicodedata.normalize("NFC", nfd) == nfc and nfd != nfc
    with pytest.raises(DataError, match=r"documents\[1\]\.id: duplicate"):
        parse_documents([{"id": nfc, "text": "t"}, {"id": nfd, "text": "u"}])
    assert parse_documents([{"id": nfd, "text": "t"}])[0].id == nfc
    r = client(
        "POST", "/v1/corpora", json={"name": "books", "documents": [{"id": nfd, "text": "The painter met the king."}]}
    )
    assert r.status_code == 201, r.text
    r = client("POST", "/v1/corpora/books/documents", json={"documents": [{"id": nfc, "text": "Another text."}]})
    assert r.status_code == 409 and r.json()["error"]["field"] == "documents", r.text
    store = client.service.store
    assert store.doc_ids(store.read("books")) == [nfc]


def test_a_corpus_holding_an_unnormalised_id_from_before_still_finds_the_duplicate(tmp_path):
    store = CorpusStore(tmp_path)
    store.create("c", fingerprint="fp", model=ModelConfig(), dim=4, chunk_tokens=8, shards=1)
    nfd = "cafe\u0301"
    store.append(
        "c",
        [Document(nfd, "t")],
        [DocumentChunk(nfd, "t", 1)],
        [np.asarray([1], np.int32)],
        np.ones((1, 4), np.float32),
        "fp",
    )
    with pytest.raises(CorpusConflict, match="already in corpus"):
        store.check_new(store.read("c"), [Document("caf\u00e9", "u")], "fp")


def test_stored_strings_keep_every_character_and_no_reader_splits_a_record(tmp_path):
    store = CorpusStore(tmp_path)
    store.create("c", fingerprint="fp", model=ModelConfig(), dim=4, chunk_tokens=8, shards=1)
    odd = "".join(LINE_ENDS) + '\x00\t"\\ é 中 😀'
    doc_id, texts = f"id{odd}", [f"one{odd}", "two \u2028 lines", "three\x85"]
    chunks = [DocumentChunk(doc_id, t, 3) for t in texts]
    store.append(
        "c", [Document(doc_id, "x")], chunks, [np.asarray([1, 2, 3], np.int32)] * 3, np.ones((3, 4), np.float32), "fp"
    )
    m = store.read("c")
    assert store.doc_ids(m) == [doc_id] and [(d, t) for _, d, t in store.read_texts(m, 0, m.batches[0])] == [
        (doc_id, t) for t in texts
    ]
    segment, problem = store.read_segment(m, 0, m.batches[0])
    assert problem is None and segment.doc_ids == [doc_id] * 3 and segment.texts == texts
    for ref in (m.batches[0].docs, m.batches[0].shards[0].texts):
        data = (store.path("c") / ref.file).read_bytes()
        lines = data.decode("utf-8").splitlines()  # the reader that broke: one record per line for it too
        assert len(lines) == data.count(b"\n") and all(isinstance(json.loads(line), dict) for line in lines)


def _rewrite(store: CorpusStore, name: str, ref: FileRef, data: bytes) -> None:
    """A file as another writer left it, with the manifest's checksum to match."""
    (store.path(name) / ref.file).write_bytes(data)
    manifest = json.loads((store.path(name) / "corpus.json").read_text())
    for e in [b["docs"] for b in manifest["batches"]] + [s["texts"] for b in manifest["batches"] for s in b["shards"]]:
        if e["file"] == ref.file:
            e["sha256"] = hashlib.sha256(data).hexdigest()
    (store.path(name) / "corpus.json").write_text(json.dumps(manifest))


def _old_format(store: CorpusStore, name: str, placeholder: str, raw: str) -> None:
    """Every file of ``name`` as the code before the rule wrote it: ``raw`` written as is (JSON
    with ensure_ascii=False leaves U+2028 unescaped) where the placeholder id was."""
    m = store.read(name)
    for ref in [b.docs for b in m.batches] + [s.texts for b in m.batches for s in b.shards]:
        data = (store.path(name) / ref.file).read_bytes()
        _rewrite(store, name, ref, data.replace(placeholder.encode(), raw.encode()))


def test_a_corpus_written_before_the_rule_with_a_raw_u2028_id_still_serves(client):
    placeholder, old_id = "OLD-ID-PLACEHOLDER", "old\u2028id"
    docs = [{"id": placeholder, "text": "The painter met the king near the castle. The ship sailed."}, *docs_json(2)]
    assert client("POST", "/v1/corpora", json={"name": "books", "documents": docs}).status_code == 201
    store = client.service.store
    _old_format(store, "books", placeholder, old_id)
    m = store.read("books")
    raw = (store.path("books") / m.batches[0].docs.file).read_bytes()
    assert "\u2028".encode() in raw  # what the old writer left: str.splitlines() cut this record in two
    r = client("POST", "/v1/retrieve", json={"corpus": "books", "question": "the painter and the king", "max_steps": 3})
    assert r.status_code == 200, r.text
    assert old_id in {s["doc_id"] for s in r.json()["steps"]} | {
        a["doc_id"] for s in r.json()["steps"] for a in s["alternatives"]
    }
    r = client("POST", "/v1/corpora/books/documents", json={"documents": docs_json(4)[2:]})
    assert r.status_code == 200, r.text
    assert old_id in store.doc_ids(store.read("books"))


def test_an_unreadable_record_is_a_503_naming_the_corpus_file_and_line(client):
    assert client("POST", "/v1/corpora", json={"name": "books", "documents": docs_json(3)}).status_code == 201
    store = client.service.store
    m = store.read("books")
    docs_entry, texts_entry = m.batches[0].docs, m.batches[0].shards[1].texts
    lines = (store.path("books") / docs_entry.file).read_bytes().split(b"\n")
    _rewrite(store, "books", docs_entry, b"\n".join([lines[0], b'{"id": "half', *lines[1:]]))
    r = client("POST", "/v1/corpora/books/documents", json={"documents": docs_json(4)[3:]})
    assert r.status_code == 503 and r.json()["error"]["field"] == "corpus", r.text
    assert all(w in r.json()["error"]["message"] for w in ("'books'", docs_entry.file, "line 2"))
    lines = (store.path("books") / texts_entry.file).read_bytes().split(b"\n")
    _rewrite(store, "books", texts_entry, b"\n".join([lines[0], b'{"position": 1, "doc": 7, "text": "x"}', *lines[2:]]))
    r = client("POST", "/v1/retrieve", json={"corpus": "books", "question": "the painter"})
    assert r.status_code == 503 and r.json()["error"]["field"] == "corpus", r.text
    assert all(w in r.json()["error"]["message"] for w in ("'books'", texts_entry.file, "line 2"))
