"""Sentence-aligned chunking under a token budget."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

# Counts tokens of many texts in one call (a fast tokenizer batches this).
TokenCounter = Callable[[list[str]], list[int]]

# A sentence ends at . ! or ?, possibly followed by one closing quote or bracket (which stays with
# the sentence), then whitespace and the start of the next sentence. Matched from the punctuation
# (group 1: the sentence's last characters): the regex engine jumps from one . ! ? to the next,
# where a split at whitespace runs behind lookbehinds tried every position (several times slower
# for the same sentences, tests/test_chunking_split.py).
_SENTENCE_END = re.compile(r"([.!?][\"')\]]?)\s+(?=[\"'(\[]?[A-Z0-9])")


def tokenizer_counter(tokenizer) -> TokenCounter:
    def count(texts: list[str]) -> list[int]:
        if not texts:
            return []
        ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        return [len(x) for x in ids]

    return count


def split_sentences(text: str) -> list[str]:
    """Split running text into sentences (keeps each sentence's text verbatim, trimmed)."""
    parts = []
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split())
        start = 0
        for end in _SENTENCE_END.finditer(para):
            sentence = para[start : end.end(1)].strip()
            if sentence:
                parts.append(sentence)
            start = end.end()
        sentence = para[start:].strip()
        if sentence:
            parts.append(sentence)
    return parts


def cap_paragraphs(paragraphs: Sequence[tuple[str, Sequence[str]]], budget: int, count: TokenCounter) -> list[str]:
    """One chunk per (title, sentences) paragraph: ``"title: s1 s2 ..."`` keeping whole sentences
    while they fit in ``budget`` tokens. A first sentence longer than the budget is kept whole
    (the encoder truncates it); later sentences that do not fit are dropped."""
    prefixes = [f"{title}:" if title else "" for title, _ in paragraphs]
    flat = [s.strip() for _, sents in paragraphs for s in sents]
    counts = count(prefixes + flat)
    prefix_counts, sent_counts = counts[: len(prefixes)], counts[len(prefixes) :]
    chunks, k = [], 0
    for (title, sents), prefix, used in zip(paragraphs, prefixes, prefix_counts):
        kept = []
        for sent in sents:
            n = sent_counts[k]
            k += 1
            sent = sent.strip()
            if not sent:
                continue
            if kept and used + n > budget:
                continue
            kept.append(sent)
            used += n
        chunks.append(" ".join([prefix, *kept]).strip() if prefix else " ".join(kept))
    return chunks


def pack_sentences(sentences: Sequence[str], counts: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """Group consecutive sentences into chunks of at most ``budget`` tokens.

    Returns ``(start, end)`` sentence ranges. A sentence longer than the budget stands alone.
    """
    ranges, start, used = [], 0, 0
    for i, n in enumerate(counts):
        if i > start and used + n > budget:
            ranges.append((start, i))
            start, used = i, 0
        used += n
    if start < len(counts):
        ranges.append((start, len(counts)))
    return ranges
