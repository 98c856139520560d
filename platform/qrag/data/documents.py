"""User corpora: documents ``{id, text}`` -> sentence-aligned chunks under a token budget.

Chunks keep their document id and follow corpus order (documents in the order given, chunks in
document order), which is the order an index assigns global chunk positions in. A sentence
longer than the budget is cut at word boundaries, so no text is lost to encoder truncation.
"""

from __future__ import annotations

import re
import unicodedata
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import Any

import numpy as np

from qrag.data.chunking import TokenCounter, pack_sentences, split_sentences
from qrag.data.sample import DataError

DOC_ID_MAX_CHARS = 256

# The one rule for stored strings: Unicode text without NUL or lone surrogates (check_text). An id is
# a one-line name, so it also holds no control character (C0, DEL, C1: \x85 among them) and no line or
# paragraph separator: nothing that any reader (str.splitlines() included) takes for a line end.
_ID_FORBIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


@dataclass(frozen=True)
class Document:
    id: str
    text: str


@dataclass(frozen=True)
class DocumentChunk:
    doc_id: str
    text: str
    tokens: int  # token count of the text (no special tokens)


def pack_chunks(chunks: Sequence[DocumentChunk], ids: Sequence[np.ndarray]) -> tuple:
    """Chunks and their token ids as a few flat objects (document ids, texts, token counts, one
    flat id array, lengths): what crosses a process boundary. Pickling a commit group's chunks
    and token arrays one by one cost several times as long as these few objects."""
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    flat = np.concatenate([np.asarray(x).reshape(-1) for x in ids]) if len(ids) else np.zeros(0, np.int32)
    counts = np.fromiter((c.tokens for c in chunks), dtype=np.int64, count=len(chunks))
    return [c.doc_id for c in chunks], [c.text for c in chunks], counts, flat, lengths


def unpack_chunks(packed: tuple) -> tuple[list[DocumentChunk], list[np.ndarray]]:
    """:func:`pack_chunks`'s input again (the token arrays are views of one flat array)."""
    doc_ids, texts, counts, flat, lengths = packed
    chunks = [DocumentChunk(d, t, n) for d, t, n in zip(doc_ids, texts, counts.tolist())]
    bounds = [0, *np.cumsum(lengths).tolist()]
    # Slices, not np.split: its per-piece swapaxes costs time per chunk in the process that feeds
    # the GPU.
    ids = [flat[a:b] for a, b in zip(bounds, bounds[1:])]
    return chunks, ids


def parse_documents(records: Any, where: str = "documents") -> list[Document]:
    """Validate ``[{"id": ..., "text": ...}, ...]``; errors name the record and the field."""
    if not isinstance(records, list):
        raise DataError(f"{where}: expected a list of {{id, text}} objects")
    docs, seen = [], set()
    for i, rec in enumerate(records):
        at = f"{where}[{i}]"
        doc = parse_document(rec, at)
        if doc.id in seen:
            raise DataError(f"{at}.id: duplicate document id {doc.id!r}")
        seen.add(doc.id)
        docs.append(doc)
    return docs


def parse_document(rec: Any, at: str, extra_fields: bool = False) -> Document:
    """One ``{"id", "text"}`` record (``at`` names it in errors); with ``extra_fields`` other keys
    (a JSONL dump's title, url, ...) are ignored instead of refused."""
    if not isinstance(rec, dict):
        raise DataError(f"{at}: a document must be an object with 'id' and 'text'")
    unknown = sorted(set(rec) - {"id", "text"})
    if unknown and not extra_fields:
        raise DataError(f"{at}.{unknown[0]}: unknown field (a document has 'id' and 'text')")
    doc_id, text = check_id(rec.get("id"), f"{at}.id"), rec.get("text")
    if not isinstance(text, str):
        raise DataError(f"{at}.text: must be a string")
    check_text(text, f"{at}.text")
    if not text.strip():
        raise DataError(f"{at}.text: empty document (id={doc_id})")
    return Document(doc_id, text)


def check_id(value: Any, where: str) -> str:
    """A document id by the rule above, in NFC: two spellings of one name are one document."""
    if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value).strip() == "":
        raise DataError(f"{where}: must be a non-empty string")
    doc_id = str(value)
    bad = _ID_FORBIDDEN.search(doc_id)
    if bad:
        raise DataError(
            f"{where}: control character, line separator or lone surrogate (U+{ord(bad.group()):04X}) at character "
            f"{bad.start()}; an id is one line of text"
        )
    doc_id = normalize_id(doc_id)
    if len(doc_id) > DOC_ID_MAX_CHARS:
        raise DataError(f"{where}: longer than {DOC_ID_MAX_CHARS} characters")
    return doc_id


def normalize_id(doc_id: str) -> str:
    """The form ids are compared and stored in (NFC); ids stored before the rule may be in another."""
    return doc_id if unicodedata.is_normalized("NFC", doc_id) else unicodedata.normalize("NFC", doc_id)


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, where: str) -> None:
    """JSON may carry lone surrogates (``"\\ud800"``): text that is not valid Unicode is refused."""
    bad = _SURROGATE.search(text)
    if bad:
        raise DataError(f"{where}: not valid UTF-8 text (lone surrogate at character {bad.start()})")
    if "\x00" in text:
        raise DataError(f"{where}: contains a NUL character")


def _cut_long(
    sentences: dict[int, str], counts: dict[int, int], budget: int, count: TokenCounter
) -> dict[int, list[tuple[str, int]]]:
    """Cut sentences over the budget into word windows that fit it: each round splits every
    piece still too long into about budget-sized word runs, and counts all new pieces in one
    tokenizer call (far fewer strings than counting word by word). A single word over the
    budget stays whole (the encoder truncates it)."""
    segs = {k: [(text.split(), counts[k])] for k, text in sentences.items()}
    while True:
        todo = [(k, i) for k, ss in segs.items() for i, (ws, n) in enumerate(ss) if n > budget and len(ws) > 1]
        if not todo:
            break
        splits = []
        for k, i in todo:
            ws, n = segs[k][i]
            per = max(1, min(len(ws) - 1, int(len(ws) * budget * 0.9 / n)))
            splits.append((k, i, [ws[j : j + per] for j in range(0, len(ws), per)]))
        piece_counts = iter(count([" ".join(p) for _, _, parts in splits for p in parts]))
        counted = [(k, i, [(p, next(piece_counts)) for p in parts]) for k, i, parts in splits]
        for k, i, parts in reversed(counted):  # from the end, so earlier indices stay valid
            segs[k][i : i + 1] = parts
    return {k: [(" ".join(ws), n) for ws, n in ss] for k, ss in segs.items()}


# Texts -> their token ids (no special tokens), many in one call.
TokenEncoder = Callable[[list[str]], list[list[int]]]


def chunk_documents(docs: Sequence[Document], count: TokenCounter, budget: int) -> list[DocumentChunk]:
    """Every document's chunks, in corpus order; one tokenizer call for all sentences."""
    return _chunk(docs, budget, count, None)[0]


def chunk_and_encode(
    docs: Sequence[Document], encode: TokenEncoder, budget: int
) -> tuple[list[DocumentChunk], list[np.ndarray]]:
    """:func:`chunk_documents` and each chunk's token ids (int32), every sentence tokenised once: a
    chunk's ids are its sentences' ids one after another. That equals tokenising the chunk's text
    only for a tokenizer that never merges tokens across a space (WordPiece does; byte-level BPE does
    not): :meth:`qrag.retrieval.embedder.Tokenization.chunk_documents` checks before it takes this path."""
    known: dict[str, list[int]] = {}

    def encode_once(texts: list[str]) -> list[list[int]]:
        """Each text encoded once per call: the pieces of a sentence over the budget are encoded to
        be counted, and their ids are needed after (encoding them again was most of the cutting's
        cost, which was a fifth of a tokenising worker's time on the novels)."""
        todo = list(dict.fromkeys(t for t in texts if t not in known))
        if todo:
            known.update(zip(todo, encode(todo)))
        return [known[t] for t in texts]

    chunks, ids = _chunk(docs, budget, lambda texts: [len(x) for x in encode_once(texts)], encode_once)
    return chunks, ids  # type: ignore[return-value]


def _chunk(
    docs: Sequence[Document], budget: int, count: TokenCounter, encode: TokenEncoder | None
) -> tuple[list[DocumentChunk], list[np.ndarray] | None]:
    if budget < 1:
        raise DataError(f"chunk budget must be at least 1 token, got {budget}")
    per_doc = [split_sentences(d.text) for d in docs]
    flat = [s for sents in per_doc for s in sents]
    flat_ids = encode(flat) if encode is not None else None
    counts = [len(x) for x in flat_ids] if flat_ids is not None else count(flat)
    long = {k: s for k, (s, n) in enumerate(zip(flat, counts)) if n > budget}
    cut = _cut_long(long, {k: counts[k] for k in long}, budget, count) if long else {}
    # Units: the sentences, each one over the budget replaced by its cut pieces (their own ids);
    # the runs between cut sentences are copied whole.
    texts, sizes, unit_ids, units_per_doc = flat, counts, flat_ids, [len(sents) for sents in per_doc]
    if cut:
        cut_ids = iter(encode([t for k in sorted(cut) for t, _ in cut[k]]) if encode is not None else [])
        texts, sizes, unit_ids = [], [], [] if encode is not None else None
        doc_starts = list(accumulate(units_per_doc[:-1], initial=0))
        prev = 0
        for k in sorted(cut):
            pieces = cut[k]
            texts += flat[prev:k]
            texts += [t for t, _ in pieces]
            sizes += counts[prev:k]
            sizes += [m for _, m in pieces]
            if unit_ids is not None:
                unit_ids += flat_ids[prev:k]
                unit_ids += [next(cut_ids) for _ in pieces]
            units_per_doc[bisect_right(doc_starts, k) - 1] += len(pieces) - 1
            prev = k + 1
        texts += flat[prev:]
        sizes += counts[prev:]
        if unit_ids is not None:
            unit_ids += flat_ids[prev:]
    # Every unit's ids in one array: a chunk's ids are a slice of it, no Python loop over tokens
    # (building each chunk's id list token by token was a fifth of a tokenising worker's time).
    bounds = list(accumulate(sizes, initial=0))  # unit j's tokens: bounds[j] to bounds[j + 1]
    if unit_ids is not None:
        tokens = np.fromiter(chain.from_iterable(unit_ids), dtype=np.int32, count=bounds[-1])
    out: list[DocumentChunk] = []
    out_ids: list[np.ndarray] = []
    u = 0
    for doc, n_units in zip(docs, units_per_doc):
        if not n_units:
            raise DataError(f"document {doc.id!r}: no text to index")
        for start, end in pack_sentences(texts[u : u + n_units], sizes[u : u + n_units], budget):
            a, b = u + start, u + end
            out.append(DocumentChunk(doc.id, " ".join(texts[a:b]), bounds[b] - bounds[a]))
            if unit_ids is not None:
                out_ids.append(tokens[bounds[a] : bounds[b]])
        u += n_units
    return out, (out_ids if unit_ids is not None else None)
