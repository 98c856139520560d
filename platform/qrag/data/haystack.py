"""Background text ("haystacks") for generated long contexts, measured and chunked once.

A :class:`Haystack` is a corpus cut into *segments* (sentences; sentences longer than the chunk
budget are cut at word boundaries) with their token counts, and into *chunks*: runs of
consecutive segments packed under the budget. Both are computed once per corpus, tokenizer and
budget and kept in memory, so that a 10M-token context is a list of chunk indices plus the few
inserted facts: generating it never re-tokenises or copies the corpus.

Optionally (when built from a tokenizer rather than a bare counter) the segments' token ids
are kept too, so long-context evaluation can build token arrays without tokenising 10M tokens
per question; that shortcut is only used when concatenating segment ids reproduces the
tokenizer's ids of the joined chunk text (checked on a sample of chunks).
"""

from __future__ import annotations

import hashlib
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qrag.data.chunking import TokenCounter, pack_sentences, split_sentences
from qrag.data.paths import resolve_files
from qrag.data.sample import DataError
from qrag.data.splits import in_split

Encoder = Callable[[list[str]], list[list[int]]]
BATCH = 8192  # texts per tokenizer call: bounds the tokenizer's Python-list output


@dataclass(eq=False)
class Measure:
    """How text is measured: token counts, and optionally token ids (same tokenizer).

    ``key`` identifies the tokenizer in caches; two measures with the same key must agree.
    """

    count: TokenCounter
    encode: Encoder | None = None
    key: object = None

    def __post_init__(self) -> None:
        if self.key is None:
            self.key = id(self.count)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> Measure:
        def encode(texts: list[str]) -> list[list[int]]:
            if not texts:
                return []
            return tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]

        def count(texts: list[str]) -> list[int]:
            return [len(x) for x in encode(texts)]

        return cls(count, encode, key=tokenizer_key(tokenizer))

    def measure(self, texts: list[str]) -> tuple[np.ndarray, list[np.ndarray] | None]:
        """Token counts (int64) and, with an encoder, the ids of each text (int32)."""
        counts = np.zeros(len(texts), dtype=np.int64)
        ids: list[np.ndarray] | None = [] if self.encode is not None else None
        for lo in range(0, len(texts), BATCH):
            part = texts[lo : lo + BATCH]
            if self.encode is not None:
                enc = self.encode(part)
                counts[lo : lo + len(part)] = [len(x) for x in enc]
                ids.extend(np.asarray(x, dtype=np.int32) for x in enc)
            else:
                counts[lo : lo + len(part)] = self.count(part)
        return counts, ids


def tokenizer_key(tokenizer) -> tuple:
    """Equal for tokenizers that tokenise alike (two checkpoints of one encoder share their
    measured corpora): a hash of a fast tokenizer's full definition, else the object's id."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return ("tokenizer", hashlib.sha1(backend.to_str().encode("utf-8")).hexdigest())
    return ("tokenizer", id(tokenizer))


@dataclass
class Window:
    """Background of one context: haystack chunk indices in order, plus last chunk(s) of loose
    segments (``fill``, possibly none) that bring the length to the target."""

    chunks: np.ndarray  # int64 chunk indices (may wrap around the haystack)
    fill: list[list[int]] = field(default_factory=list)  # segment indices of each extra chunk
    tokens: int = 0  # tokens of chunks + fill


class Haystack:
    """A measured, chunked corpus; see the module docstring."""

    def __init__(
        self,
        name: str,
        segments: list[str],
        seg_counts: np.ndarray,
        bounds: np.ndarray,
        seg_ids: list[np.ndarray] | None,
        budget: int,
    ):
        if len(bounds) < 2:
            raise DataError(f"haystack {name!r}: no text")
        self.name = name
        self.budget = budget
        self.segments = segments
        self.seg_counts = seg_counts
        self.bounds = bounds  # chunk k = segments[bounds[k]:bounds[k + 1]]
        seg_cum = np.concatenate([[0], np.cumsum(seg_counts)])
        self.chunk_counts = seg_cum[bounds[1:]] - seg_cum[bounds[:-1]]
        self.cum = np.concatenate([[0], np.cumsum(self.chunk_counts)])  # tokens before chunk k
        if self.cum[-1] <= 0:
            raise DataError(f"haystack {name!r}: no tokens")
        self._seg_ids = seg_ids
        self.additive = False
        self.standalone = bool(np.all(np.diff(bounds) == 1))
        self._chunk_ids: dict[int, np.ndarray] = {}

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        name: str,
        documents: Iterable[str],
        budget: int,
        measure: Measure,
        standalone: bool = False,
        split: Callable[[str], list[str]] = split_sentences,
    ) -> Haystack:
        """Segment, measure and chunk ``documents`` (read one at a time). With ``standalone``
        every segment is its own chunk (a haystack of needles)."""
        return cls.from_parts(
            name, (Part.measure(split(doc), budget, measure, standalone) for doc in documents), budget, measure
        )

    @classmethod
    def from_parts(cls, name: str, parts: Iterable[Part], budget: int, measure: Measure) -> Haystack:
        """Concatenate measured documents (chunks never span two documents)."""
        segments: list[str] = []
        counts: list[np.ndarray] = []
        ids: list[np.ndarray] | None = [] if measure.encode is not None else None
        bounds: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        for part in parts:
            if not part.segments:
                continue
            bounds.append(part.bounds[1:] + len(segments))
            segments.extend(part.segments)
            counts.append(part.counts)
            if ids is not None:
                ids.extend(part.ids)
        if not segments:
            raise DataError(f"haystack {name!r}: the text has no sentences")
        hay = cls(name, segments, np.concatenate(counts), np.concatenate(bounds), ids, budget)
        hay.additive = ids is not None and hay._check_additive(measure)
        return hay

    def _check_additive(self, measure: Measure, samples: int = 32) -> bool:
        multi = np.flatnonzero(np.diff(self.bounds) > 1)
        if len(multi) == 0:
            return True
        pick = multi[np.linspace(0, len(multi) - 1, min(samples, len(multi))).astype(np.int64)]
        full = measure.encode([self.chunk_text(int(k)) for k in pick])
        return all(np.array_equal(np.asarray(f, np.int32), self._concat_ids(int(k))) for f, k in zip(full, pick))

    # -- access ----------------------------------------------------------------------------

    @property
    def n_chunks(self) -> int:
        return len(self.bounds) - 1

    @property
    def tokens(self) -> int:
        return int(self.cum[-1])

    def distinct_tokens(self, refs: np.ndarray) -> int:
        """Tokens of the distinct haystack chunks among ``refs`` (chunk indices; negative refs,
        inserted sentences and loose fill, are not counted). A context longer than its corpus wraps
        around and repeats chunks: this is how much different background it really holds."""
        refs = np.asarray(refs)
        return int(self.chunk_counts[np.unique(refs[refs >= 0])].sum())

    def chunk_text(self, k: int) -> str:
        return " ".join(self.segments[self.bounds[k] : self.bounds[k + 1]])

    def fill_text(self, segs: Sequence[int]) -> str:
        return " ".join(self.segments[i] for i in segs)

    def fill_ids(self, segs: Sequence[int]) -> np.ndarray:
        """Token ids of :meth:`fill_text` from the segments' ids (only when ``additive``)."""
        parts = [self._seg_ids[i] for i in segs]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _concat_ids(self, k: int) -> np.ndarray:
        parts = self._seg_ids[self.bounds[k] : self.bounds[k + 1]]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def chunk_ids(self, k: int) -> np.ndarray | None:
        """Token ids of chunk ``k`` (no special tokens), or None when they cannot be assembled."""
        if not self.additive:
            return None
        ids = self._chunk_ids.get(k)
        if ids is None:
            ids = self._chunk_ids[k] = self._concat_ids(k)
        return ids

    # -- windows ---------------------------------------------------------------------------

    def window(self, rng: np.random.Generator, tokens: int, max_scan: int = 4096) -> Window:
        """Consecutive chunks from a random start (wrapping around) totalling at most ``tokens``,
        then loose segments that fit the remaining gap packed into one last chunk."""
        if tokens <= 0:
            return Window(np.zeros(0, dtype=np.int64))
        n = self.n_chunks
        pos = int(rng.integers(n))
        parts, remaining = [], int(tokens)
        while True:
            rest = int(self.cum[n] - self.cum[pos])
            if rest <= remaining:  # take everything to the end, wrap around
                parts.append(np.arange(pos, n))
                remaining -= rest
                pos = 0
                continue
            end = int(np.searchsorted(self.cum, self.cum[pos] + remaining, side="right")) - 1
            parts.append(np.arange(pos, end))
            remaining -= int(self.cum[end] - self.cum[pos])
            pos = end
            break
        fill: list[int] = []
        seg = int(self.bounds[pos])
        n_seg = len(self.segments)
        for step in range(min(max_scan, n_seg)):
            if remaining <= 0:
                break
            i = (seg + step) % n_seg
            c = int(self.seg_counts[i])
            if 0 < c <= remaining:
                fill.append(i)
                remaining -= c
        # In a haystack of standalone sentences (needles) each loose segment is its own chunk too.
        groups = [[i] for i in fill] if self.standalone else ([fill] if fill else [])
        return Window(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64), groups, int(tokens) - remaining)


@dataclass
class Part:
    """One measured document: segments of at most ``budget`` tokens and its chunk bounds."""

    segments: list[str]
    counts: np.ndarray  # int64 tokens per segment
    ids: list[np.ndarray] | None  # int32 ids per segment (with an encoder)
    bounds: np.ndarray  # int64, chunk k = segments[bounds[k]:bounds[k + 1]]

    @property
    def tokens(self) -> int:
        return int(self.counts.sum())

    @classmethod
    def measure(cls, sentences: list[str], budget: int, measure: Measure, standalone: bool = False) -> Part:
        if standalone:  # needles stay whole, even one a little over the budget (the encoder truncates it)
            counts, ids = measure.measure(sentences)
            return cls(list(sentences), counts, ids, np.arange(len(sentences) + 1, dtype=np.int64))
        segments, counts, ids = _segment(sentences, budget, measure)
        ranges = pack_sentences(segments, counts.tolist(), budget)
        return cls(segments, counts, ids, np.asarray([0] + [end for _, end in ranges], dtype=np.int64))


def _segment(
    sentences: list[str], budget: int, measure: Measure
) -> tuple[list[str], np.ndarray, list[np.ndarray] | None]:
    """Sentences -> segments of at most ``budget`` tokens: a longer sentence is halved between
    words (and re-measured) until every piece fits. A single word longer than the budget is
    dropped (e.g. a long run of dashes in old typesetting): the text is only background."""
    counts, ids = measure.measure(sentences)
    items: list[tuple[str, int, np.ndarray | None]] = [
        (text, int(c), None if ids is None else ids[i]) for i, (text, c) in enumerate(zip(sentences, counts))
    ]
    while True:
        long = [i for i, (_, c, _) in enumerate(items) if c > budget]
        if not long:
            break
        halves: dict[int, list[str]] = {}
        for i in long:
            words = items[i][0].split()
            if len(words) > 1:
                mid = len(words) // 2
                halves[i] = [" ".join(words[:mid]), " ".join(words[mid:])]
            else:
                halves[i] = []
        flat = [h for i in long for h in halves[i]]
        h_counts, h_ids = measure.measure(flat)
        out, k = [], 0
        for i, item in enumerate(items):
            if i not in halves:
                out.append(item)
                continue
            for text in halves[i]:
                out.append((text, int(h_counts[k]), None if h_ids is None else h_ids[k]))
                k += 1
        items = out
    segments = [t for t, _, _ in items]
    return (
        segments,
        np.asarray([c for _, c, _ in items], dtype=np.int64),
        (None if ids is None else [x for _, _, x in items]),
    )


# ---------------------------------------------------------------------------------------------
# Corpus files and their train/dev split

NOVELS_DIR = "gutenberg_novels"
# The folder split suggested by gutenberg_novels/SOURCE.md: one collection for training noise,
# the other for evaluation noise. No book appears in both.
NOVEL_SPLIT = {"train": "small_collection_british_fiction", "dev": "100_english_novels_pre1881"}
# Validation background (choosing settings and checkpoints at long lengths): the last books of the
# train collection, never in the training background. Training reads the first books only as far
# as it needs (2M tokens for a 2K context: 4 of the 18 left), so carving these out changes nothing
# it sees.
VAL_BOOKS = 5
TEXT_SUFFIXES = (".txt", ".txt.gz")
SPLITS = ("train", "val", "dev", "all")


def _text_files(folder: Path) -> list[Path]:
    return sorted(
        p for p in folder.rglob("*") if p.is_file() and p.name.endswith(TEXT_SUFFIXES) and p.name != "overview.txt"
    )


def _folder_files(folder: Path) -> list[Path]:
    files = _text_files(folder)
    if not files:
        raise DataError(f"{folder}: no .txt or .txt.gz files")
    return files


def _named_split(folders: dict[str, Path], split: str, carve_val: bool) -> list[Path]:
    """``split`` of a two-folder layout (train + dev). val is a ``val/`` folder where there is one,
    else (``carve_val``, with more than :data:`VAL_BOOKS` books) the last :data:`VAL_BOOKS` books of the
    train folder, which train then leaves out."""
    if split == "all":
        return sorted(f for folder in folders.values() for f in _text_files(folder))
    if split == "dev" or (split == "val" and "val" in folders):
        return _folder_files(folders[split])
    train = _folder_files(folders["train"])
    if "val" in folders or not carve_val or len(train) <= VAL_BOOKS:  # nothing to carve: train keeps every book
        if split == "val":
            return _val_fallback(folders["train"].parent, train)
        return train
    return train[-VAL_BOOKS:] if split == "val" else train[:-VAL_BOOKS]


def _val_fallback(path: str | Path, train: list[Path]) -> list[Path]:
    print(
        f"qrag: warning: {path}: no validation background books (a val/ folder); validation contexts use the "
        f"training books",
        file=sys.stderr,
    )
    return train


def split_files(path: str | Path, split: str) -> list[Path]:
    """Background files of ``split`` (train | val | dev | all) under ``path``, a folder, file or glob.

    * a folder with ``train/`` and ``dev/`` (or ``test/``) subfolders, and optionally ``val/``: those;
    * a folder with the two collections of ``gutenberg_novels``: the split of :data:`NOVEL_SPLIT`,
      val being the last :data:`VAL_BOOKS` books of the train collection (and not in train);
    * anything else: by file, ``sha1(file name)`` against 0.5 (see qrag.data.splits); when that
      leaves a split empty (e.g. a single file), both splits use every file (with a warning).

    Where a layout has no validation books, val is the train split's (with a warning).
    """
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r} (choose from {', '.join(SPLITS)})")
    p = Path(path)
    if p.is_dir():
        named = {"train": p / "train", "dev": p / "dev" if (p / "dev").is_dir() else p / "test"}
        if (p / "val").is_dir():
            named["val"] = p / "val"
        for layout, carve in ((named, False), ({k: p / v for k, v in NOVEL_SPLIT.items()}, True)):
            if all(layout[k].is_dir() for k in ("train", "dev")):
                return _named_split(layout, split, carve)
        files = _folder_files(p)
    else:
        files = resolve_files(p)
    if split == "all":
        return files
    if split == "val":
        return _val_fallback(path, [f for f in files if in_split(f.name, "train", 0.5)] or files)
    chosen = [f for f in files if in_split(f.name, split, 0.5)]
    if not chosen:
        print(
            f"qrag: warning: {path}: too few files to separate train and dev background text; "
            f"both splits use all {len(files)} file(s)",
            file=sys.stderr,
        )
        return files
    return chosen


def book_files(path: str | Path | None = None, split: str = "all") -> list[Path]:
    """The background books (``.txt``/``.txt.gz``) of ``split`` under ``path`` (a folder, file or
    glob; default ``$QRAG_DATA_DIR/gutenberg_novels``), as BabiLong reads them; ``all`` = every
    book, in path order. The benchmarks that index books (bench/serve_scale.py, bench/two_gpu.py)
    read their corpus with this and :func:`read_document` too."""
    if path is None:
        from qrag.data.paths import data_root

        path = data_root() / NOVELS_DIR
    return split_files(path, split)


def read_document(path: Path) -> str:
    """One file's text (``.gz`` too; strict UTF-8, a leading BOM dropped)."""
    from qrag.data.paths import open_text

    try:
        with open_text(path) as fh:
            return fh.read().lstrip("\ufeff")
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise DataError(f"{path}: cannot read: {exc}") from None


def read_documents(files: Sequence[Path]) -> Iterable[str]:
    """Each file's text, one at a time (:func:`read_document`)."""
    for f in files:
        yield read_document(f)


# ---------------------------------------------------------------------------------------------
# In-memory caches: each file is measured once per tokenizer and budget; haystacks built from
# measured files share their segments (no copy of the text).

_PARTS: OrderedDict[tuple, Part] = OrderedDict()
_CACHE: OrderedDict[tuple, Haystack] = OrderedDict()
_KEEP: dict[tuple, Measure] = {}  # keeps a counter alive while its id() is part of a cache key
CACHE_SIZE = 8
# Background corpora are read only as far as needed: at least this many tokens (and twice the
# context), so a 4K training context does not wait for a 6M-token corpus to be tokenised.
MIN_BACKGROUND_TOKENS = 2_000_000


def _remember(measure: Measure) -> None:
    for key in [k for k in _KEEP if k[0] != measure.key]:
        # A new tokenizer: forget what the old one measured (one model at a time in a process).
        _KEEP.pop(key, None)
    _KEEP[(measure.key,)] = measure
    for cache in (_PARTS, _CACHE):
        for key in [k for k in cache if k[-2] != measure.key]:
            cache.pop(key)


def measured_file(path: Path, budget: int, measure: Measure) -> Part:
    key = (str(path), budget, measure.key, measure.encode is not None)
    if key not in _PARTS:
        _remember(measure)
        doc = next(iter(read_documents([path])))
        _PARTS[key] = Part.measure(split_sentences(doc), budget, measure)
    return _PARTS[key]


def files_haystack(label: str, files: Sequence[Path], budget: int, measure: Measure, min_tokens: int = 0) -> Haystack:
    """The files, in order, as far as needed to hold ``min_tokens`` tokens (all when 0)."""
    parts, used, total = [], [], 0
    for f in files:
        part = measured_file(f, budget, measure)
        parts.append(part)
        used.append(str(f))
        total += part.tokens
        if min_tokens and total >= min_tokens:
            break
    digest = hashlib.sha1("\n".join(used).encode()).hexdigest()[:10]
    return cached_haystack(
        ("files", tuple(used), budget),
        measure,
        lambda: Haystack.from_parts(f"{label}-{len(used)}files-{digest}", parts, budget, measure),
    )


def cached_haystack(key: tuple, measure: Measure, build: Callable[[], Haystack]) -> Haystack:
    """The haystack for ``key`` measured with ``measure`` (built on first use)."""
    full = (*key, measure.key, measure.encode is not None)
    if full in _CACHE:
        _CACHE.move_to_end(full)
        return _CACHE[full]
    _remember(measure)
    hay = _CACHE[full] = build()
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)
    return hay


def clear_cache() -> None:
    _PARTS.clear()
    _CACHE.clear()
    _KEEP.clear()
