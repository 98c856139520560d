"""Sentence splitting (qrag.data.chunking.split_sentences) matched from the punctuation gives the
sentences the earlier split at whitespace runs behind lookbehinds gave: a corpus's chunks do not
change with the faster matching."""

from __future__ import annotations

import gzip
import random
import re

from qrag.data.chunking import split_sentences

_LOOKBEHIND_END = re.compile(r"(?:(?<=[.!?][\"')\]])|(?<=[.!?]))\s+(?=[\"'(\[]?[A-Z0-9])")


def reference(text: str) -> list[str]:
    """The earlier implementation, kept as the test's oracle."""
    parts = []
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split())
        if para:
            parts.extend(s.strip() for s in _LOOKBEHIND_END.split(para) if s.strip())
    return parts


TRICKY = [
    "",
    "   ",
    "One.",
    "Mr. Smith went home. He slept!",
    "Wait... Then it came.",
    '"Go!" he said. "Now." She went.',
    "It (was) done.) Next one.",
    'Go!") Then.',
    "Is it?! Yes. 3 cats. (Then) more. [A] note. 'Quoted' too.",
    "a.b. c. D e.  \t\n  F g.\n\n\nNew paragraph. Here.",
    'Ends with a closer." ',
    "A.\u00a0B and C.\u2003D.",
    "x.\x1cY z.",
    "Numbers 1.5 and 2. 3 more! ?Odd. .Start. !Bang",
    "No end at all",
    "Trailing space. ",
    ".",
    "!!!",
    ". A",
]


def test_the_sentences_are_the_earlier_splits_sentences_on_tricky_text():
    for text in TRICKY:
        assert split_sentences(text) == reference(text), text


def test_the_sentences_are_the_earlier_splits_sentences_on_random_text():
    rng = random.Random(7)
    alphabet = list("abcXYZ019 .!?\"')([]\n\t\u00a0,;:-") + [". ", "! ", "? ", '." ', "\n\n", "  "]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        assert split_sentences(text) == reference(text), repr(text)


def test_the_sentences_are_the_earlier_splits_sentences_on_a_novel(shared_data):
    book = sorted((shared_data / "gutenberg_novels" / "small_collection_british_fiction").glob("*.txt.gz"))[0]
    text = gzip.open(book, "rt", encoding="utf-8").read()[:2_000_000]
    got = split_sentences(text)
    assert len(got) > 2000 and got == reference(text)
