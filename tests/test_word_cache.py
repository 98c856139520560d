"""WordPiece through a cache of words (qrag.data.word_cache): the Rust tokenizer's ids on every
text, used only where that is the tokenizer's exact behaviour."""

from __future__ import annotations

import copy
import gzip

import pytest

from qrag.data import word_cache
from qrag.data.chunking import split_sentences
from qrag.data.word_cache import WordCache
from qrag.model.encoder import load_tokenizer
from qrag.retrieval.embedder import Tokenization
from test_index import make_documents

EDGES = [
    "",
    " ",
    "Hello, World!",
    "It's 12:30 -- ok?",
    "snake_case_name and CamelCase",
    "tabs\tand\nnewlines\r here",
    "vertical\x0btab and form\x0cfeed and bell\x07 and del\x7f and nul\x00.",
    "x" * 101 + " short",
    "a" * 100,
    "[SEP] in text",
    "a [MASK] b",
    "[mask] lower",
    "{curly} <angle> |pipe| ~tilde^ `tick` \\back/ @at #hash $ % &",
    "naïve café",
    "東京 Tokyo",
    "Mixed ASCII and — dash",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "1234567890 3.14159 1,000,000",
    "ALL CAPS SHOUTING",
    "!!!???...",
    "e-mail: someone@example.com; url: http://x.org/a?b=c",
]


@pytest.fixture(scope="module")
def backend(tiny_encoder):
    be = copy.deepcopy(load_tokenizer(tiny_encoder).backend_tokenizer)
    be.no_truncation()
    be.no_padding()
    return be


def reference(backend, texts):
    return [e.ids for e in backend.encode_batch_fast(list(texts), add_special_tokens=False)]


def test_the_cache_gives_the_tokenizers_ids_on_edge_cases_and_prose(backend, shared_data):
    cache = WordCache.for_backend(backend)
    assert cache is not None and cache.lowercase  # MiniLM: BertNormalizer (lowercase) + BertPreTokenizer + WordPiece
    book = sorted((shared_data / "gutenberg_novels").rglob("*.txt.gz"))[0]
    prose = split_sentences(gzip.open(book, "rt", encoding="utf-8").read())[:4000]
    generated = [s for d in make_documents(20, seed=9) for s in split_sentences(d.text)]
    for texts in (EDGES, prose, generated):
        assert cache.encode(texts) == reference(backend, texts)
    assert cache.encode(EDGES) == reference(backend, EDGES)  # warm: from the cache, still the same


def test_a_full_cache_starts_again_and_stays_exact(backend, monkeypatch):
    monkeypatch.setattr(word_cache, "MAX_WORDS", 5)
    cache = WordCache.for_backend(backend)
    texts = [s for d in make_documents(6, seed=10) for s in split_sentences(d.text)]
    assert cache.encode(texts) == reference(backend, texts)
    assert len(cache.words) <= 5


def test_other_tokenizers_are_not_cached():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert WordCache.for_backend(bpe) is None
    wp = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wp.normalizer = normalizers.NFKC()  # not BERT's normaliser: its ASCII behaviour is not assumed
    assert WordCache.for_backend(wp) is None


def test_chunks_and_ids_are_the_same_with_and_without_the_cache(tiny_encoder):
    from qrag.retrieval.embedder import load_embedding_model, resolve_source

    layout = load_embedding_model(resolve_source(None, tiny_encoder), "cpu").layout
    docs = make_documents(8, seed=11)
    cached = Tokenization(load_tokenizer(tiny_encoder), layout)
    plain = Tokenization(load_tokenizer(tiny_encoder), layout)
    plain.__dict__["_word_cache"] = None
    assert cached._word_cache is not None
    chunks_a, ids_a = cached.chunk_documents(docs, 24)
    chunks_b, ids_b = plain.chunk_documents(docs, 24)
    assert chunks_a == chunks_b
    assert [x.tolist() for x in ids_a] == [x.tolist() for x in ids_b]
