"""BERT-style WordPiece ids of ASCII text through a cache of words: the same ids as the Rust
tokenizer, several times faster on prose.

Bulk indexing on a GPU is bound by tokenising on the host's cores (docs/benchmarks.md,
"Indexing"): the Rust tokenizer's ``encode_batch_fast`` spends most of its time building an Encoding
(a string per token) for every sentence. Prose repeats its words, so each word's pieces are looked
up once (``backend.model.tokenize``: the tokenizer's own WordPiece) and reused; a sentence is then
a regex split and dict lookups (the same ids on every sentence of the shipped novels).

Only where it is exactly the tokenizer's behaviour: a BertNormalizer (clean_text on) + a
BertPreTokenizer + a WordPiece model, and on ASCII text without an added token's text in it. For
ASCII, BERT's normalising is: drop control characters (all but tab, newline and carriage return),
those three become spaces, lowercase if the normalizer lowercases (accents and CJK need no
handling); its pre-tokenising is: runs of letters and digits are words, every other printable
character is a word of its own. Anything else goes to the Rust tokenizer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from itertools import chain
from typing import Any

_CONTROL = {c: None for c in [*range(0, 9), 11, 12, *range(14, 32), 127]}  # ASCII controls BERT's clean_text drops
# cached words before the cache starts again (an id-heavy corpus can have millions: this bounds a long-lived
# server's memory)
MAX_WORDS = 200_000


class _Words(dict):
    """word -> its WordPiece ids, filled on first sight."""

    def __init__(self, model: Any):
        super().__init__()
        self.model = model

    def __missing__(self, word: str) -> list[int]:
        if len(self) >= MAX_WORDS:
            self.clear()
        ids = [t.id for t in self.model.tokenize(word)]
        self[word] = ids
        return ids


class WordCache:
    """``encode(texts)``: every text's ids (no special tokens), as ``backend.encode_batch_fast``."""

    def __init__(self, backend: Any, lowercase: bool, added: Sequence[str]):
        self.backend = backend
        self.lowercase = lowercase
        self.words = _Words(backend.model)
        self.split = re.compile(r"[a-z0-9]+|[^a-z0-9\s]" if lowercase else r"[A-Za-z0-9]+|[^A-Za-z0-9\s]")
        # An added token is matched in the raw text: those texts go to the backend. One search for any
        # of them (a generator of `in` tests per text was a visible share of a worker's time).
        lowered = [a.lower() for a in added if a]
        self.added_search = re.compile("|".join(map(re.escape, lowered))).search if lowered else None

    @classmethod
    def for_backend(cls, backend: Any) -> WordCache | None:
        """A cache for this Rust tokenizer (no truncation, no padding), or None where the cached
        path would not be its exact behaviour."""
        try:
            spec = json.loads(backend.to_str())
        except Exception:  # noqa: BLE001 - a backend that cannot describe itself is not used
            return None
        norm, pre, model = spec.get("normalizer") or {}, spec.get("pre_tokenizer") or {}, spec.get("model") or {}
        if (
            norm.get("type") != "BertNormalizer"
            or not norm.get("clean_text", False)
            or pre.get("type") != "BertPreTokenizer"
        ):
            return None
        if model.get("type") != "WordPiece":
            return None
        added = [t.get("content", "") for t in spec.get("added_tokens") or []]
        return cls(backend, bool(norm.get("lowercase", False)), added)

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        out: list[list[int] | None] = []
        rest: list[int] = []
        words = self.words.__getitem__
        for i, text in enumerate(texts):
            low = text.lower() if text.isascii() else None
            # Added tokens ([CLS], [MASK], ...) are matched in the raw text: such a text goes to the backend.
            if low is None or (self.added_search is not None and self.added_search(low)):
                out.append(None)
                rest.append(i)
                continue
            clean = (low if self.lowercase else text).translate(_CONTROL)
            out.append(list(chain.from_iterable(map(words, self.split.findall(clean)))))
        if rest:
            for i, enc in zip(rest, self.backend.encode_batch_fast([texts[i] for i in rest], add_special_tokens=False)):
                out[i] = enc.ids
        return out  # type: ignore[return-value]
