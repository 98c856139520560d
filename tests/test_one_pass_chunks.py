"""Chunks tokenised once (their sentences' ids joined) give the ids that tokenising each chunk's
text gives, where the tokenizer allows it; where it does not, the two-pass path is kept."""

import gzip

import numpy as np
import pytest

from qrag.data.documents import Document, chunk_documents
from qrag.data.tokens import TokenLayout
from qrag.model.encoder import bundled_minilm_dir, load_tokenizer
from qrag.retrieval.embedder import Tokenization


def two_pass(tok: Tokenization, docs, budget):
    chunks = chunk_documents(docs, tok.count_tokens, budget)
    return chunks, tok.tokenize_chunks([c.text for c in chunks], budget)


def novel_docs(shared_data, n_chars=400_000):
    books = sorted((shared_data / "gutenberg_novels").rglob("*.txt.gz"))[:2]
    docs = []
    for path in books:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            docs.append(Document(path.name, fh.read(n_chars)))
    # Long sentences (cut at words), a word longer than the budget, accents, quotes, numbers.
    docs.append(
        Document(
            "edge",
            "Élodie's café — naïve! "
            + " ".join(["word"] * 300)
            + ". "
            + "x" * 400
            + ' "Quoted," she said (3.5 km at 12:30). Done.',
        )
    )
    return docs


@pytest.mark.parametrize("budget", [16, 64])
def test_one_pass_ids_equal_tokenising_each_chunk(shared_data, budget):
    tokenizer = load_tokenizer(str(bundled_minilm_dir()))
    tok = Tokenization(tokenizer, TokenLayout.from_tokenizer(tokenizer, 512))
    assert tok.joins_at_spaces  # WordPiece: the one-pass path is taken
    docs = novel_docs(shared_data)
    chunks, ids = tok.chunk_documents(docs, budget)
    want_chunks, want_ids = two_pass(tok, docs, budget)
    assert chunks == want_chunks
    assert len(ids) == len(want_ids) > 1000
    bad = [i for i, (a, b) in enumerate(zip(ids, want_ids)) if not np.array_equal(a, b)]
    assert not bad, (len(bad), chunks[bad[0]].text[:200])


def byte_level_tokenizer(tmp_path):
    """A small byte-level BPE (RoBERTa/GPT-2 style: a word's tokens depend on the space before it)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        ["Mary went to the kitchen. It's late; isn't it? Then he said go."] * 50, vocab_size=300, min_frequency=1
    )
    path = tmp_path / "bpe.json"
    bpe.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def test_a_tokenizer_that_merges_across_spaces_keeps_the_two_pass_path(tmp_path):
    tokenizer = byte_level_tokenizer(tmp_path)
    tok = Tokenization(tokenizer, TokenLayout.from_tokenizer(tokenizer, 512))
    assert not tok.joins_at_spaces
    docs = [Document("d", "Mary went to the kitchen. It's late; isn't it? Then he said go. " * 20)]
    chunks, ids = tok.chunk_documents(docs, 24)
    want_chunks, want_ids = two_pass(tok, docs, 24)
    assert chunks == want_chunks and all(np.array_equal(a, b) for a, b in zip(ids, want_ids))


def test_encode_texts_through_the_rust_backend_gives_the_transformers_ids(shared_data):
    """encode_texts calls the Rust tokenizer's encode_batch_fast (2x faster for an index). MiniLM's
    tokenizer.json carries truncation and padding at 128: the copy it uses must carry neither,
    and the tokenizer the rest of the code uses must keep its own settings."""
    tokenizer = load_tokenizer(str(bundled_minilm_dir()))
    tok = Tokenization(tokenizer, TokenLayout.from_tokenizer(tokenizer, 512))
    assert tok._fast_backend is not None
    texts = [d.text[:3000] for d in novel_docs(shared_data, 20_000)] + [
        "",
        "Élodie's café, 東京!",
        " ".join(["word"] * 400),
    ]
    want = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    got = tok.encode_texts(texts)
    assert got == want and len(got[-1]) == 400 > 128
    assert tok._fast_backend.truncation is None and tok._fast_backend.padding is None
    assert tok.encode_texts([]) == []
