"""Hard background for training contexts: book chunks that share words with the story.

A long haystack holds, by sheer size, background chunks that look like the facts (the same names,
places and objects). A 2K-token training context of random book text rarely holds one, so an
encoder trained only on those never learns to pass them over, and retrieval degrades with length
(measured on BabiLong QA3: docs/benchmarks.md, "Quality: BabiLong and RULER NIAH"). Dense
retrievers are trained with lexical hard negatives for the same reason (DPR's BM25 negatives):
``data.hard_negatives = k`` puts ``k`` such chunks of the training books into every training
context, drawn at random from the chunks that score highest by the idf-weighted count of the words
they share with the question and the story.
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Iterable

import numpy as np

from qrag.data.haystack import Haystack, Window

_WORD = re.compile(r"[a-z]+")
# Words in more than this share of the chunks carry almost no idf weight; leaving them out keeps
# each score a sum over short posting lists.
MAX_DOCUMENT_FREQUENCY = 0.05
# Candidates per requested chunk: the k chunks are drawn from the top ``POOL_PER_CHUNK * k``, so
# the same question gets different negatives in its different training samples.
POOL_PER_CHUNK = 4


def words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


class LexicalIndex:
    """Word -> chunks of one haystack, with idf weights (built once per haystack)."""

    def __init__(self, hay: Haystack, max_df: float = MAX_DOCUMENT_FREQUENCY):
        self.n_chunks = hay.n_chunks
        postings: dict[str, list[int]] = {}
        for k in range(hay.n_chunks):
            for w in words(hay.chunk_text(k)):
                postings.setdefault(w, []).append(k)
        limit = max(1, int(max_df * self.n_chunks))
        self.postings = {w: np.asarray(ks, dtype=np.int64) for w, ks in postings.items() if len(ks) <= limit}
        self.idf = {w: math.log(self.n_chunks / len(ks)) for w, ks in self.postings.items()}

    def scores(self, query: Iterable[str]) -> np.ndarray:
        out = np.zeros(self.n_chunks, dtype=np.float64)
        # Sorted: a set's order changes with PYTHONHASHSEED, and with it the sums' last bits and the
        # ranking of ties, so a resumed run in a new process would draw other negatives.
        for w in sorted(set(query)):
            ks = self.postings.get(w)
            if ks is not None:
                out[ks] += self.idf[w]
        return out

    def top(self, query: Iterable[str], n: int) -> np.ndarray:
        """The (at most) ``n`` best chunks that share at least one word, best first."""
        s = self.scores(query)
        hits = np.flatnonzero(s > 0)
        if len(hits) > n:
            hits = hits[np.argpartition(-s[hits], n - 1)[:n]]
        return hits[np.argsort(-s[hits], kind="stable")]


_INDEXES: weakref.WeakKeyDictionary[Haystack, LexicalIndex] = weakref.WeakKeyDictionary()


def lexical_index(hay: Haystack) -> LexicalIndex:
    index = _INDEXES.get(hay)
    if index is None:
        index = _INDEXES[hay] = LexicalIndex(hay)
    return index


def candidates(hay: Haystack, texts: Iterable[str], k: int, rng: np.random.Generator) -> np.ndarray:
    """The best ``POOL_PER_CHUNK * k`` lexical matches of ``texts``, in random order (none for k <= 0)."""
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    query: set[str] = set()
    for t in texts:
        query |= words(t)
    return rng.permutation(lexical_index(hay).top(query, POOL_PER_CHUNK * k))


def take(hay: Haystack, pool: np.ndarray, k: int, token_budget: int, exclude: np.ndarray | None = None) -> np.ndarray:
    """Up to ``k`` chunks of ``pool``, in its order, not in ``exclude``, fitting ``token_budget`` together."""
    chosen, used = [], 0
    skip = set() if exclude is None else set(exclude.tolist())
    for c in pool.tolist():
        if len(chosen) == k:
            break
        n = int(hay.chunk_counts[c])
        if c in skip or used + n > token_budget:
            continue
        chosen.append(c)
        used += n
    return np.asarray(chosen, dtype=np.int64)


def add_hard(hay: Haystack, window: Window, hard: np.ndarray, pool: np.ndarray, rng: np.random.Generator) -> Window:
    """``window`` plus the ``hard`` chunks (taken from ``pool`` by :func:`take`, their tokens left
    free by the caller), put at random places among its chunks. A hard chunk that the window
    already holds is swapped for another of the pool, so no chunk appears twice and the length
    stays on target."""
    if len(hard) == 0:
        return window
    dupes = np.isin(hard, window.chunks)
    if dupes.any():
        more = take(
            hay, pool, int(dupes.sum()), int(hay.chunk_counts[hard[dupes]].sum()), np.concatenate([window.chunks, hard])
        )
        hard = np.concatenate([hard[~dupes], more])
    where = np.sort(rng.integers(0, len(window.chunks) + 1, size=len(hard)))
    return Window(np.insert(window.chunks, where, hard), window.fill, window.tokens + int(hay.chunk_counts[hard].sum()))
