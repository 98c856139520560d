"""Generated long contexts: special sentences (bAbI facts, needles) hidden in background text.

The special sentences keep their order and each stands in its own chunk; they are inserted at
random chunk boundaries of a :class:`~qrag.data.haystack.Window` of background chunks. The
result keeps, beside the :class:`Sample`, where each chunk came from (``refs``), so that
evaluation can reuse the token ids and embeddings of background chunks it has already seen.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .haystack import Haystack, Window
from .sample import Sample

SPECIAL = -1  # refs value of an inserted fact or needle
FILL = -2  # refs value of a window's loose-segment chunk


@dataclass
class Generated:
    """One generated sample and the provenance of its chunks."""

    sample: Sample
    haystack: Haystack
    refs: np.ndarray  # per chunk: haystack chunk index (>= 0), SPECIAL or FILL


def seed_for(*parts: object) -> int:
    """A stable 64-bit seed from any values (never Python's salted ``hash``)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


def rng_for(*parts: object) -> np.random.Generator:
    return np.random.default_rng(seed_for(*parts))


def assemble(hay: Haystack, window: Window, specials: Sequence[str], rng: np.random.Generator) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Chunks in document order, their refs, and the chunk position of each special sentence.

    The specials are placed, in the given order, at uniformly drawn boundaries between the
    background chunks (several may share a boundary; they then follow each other).
    """
    n_back = len(window.chunks) + len(window.fill)
    n_spec = len(specials)
    slots = np.sort(rng.integers(0, n_back + 1, size=n_spec))
    special_pos = slots + np.arange(n_spec)
    total = n_back + n_spec
    refs = np.empty(total, dtype=np.int64)
    is_special = np.zeros(total, dtype=bool)
    is_special[special_pos] = True
    refs[~is_special] = np.concatenate([window.chunks, np.full(len(window.fill), FILL, dtype=np.int64)])
    refs[special_pos] = SPECIAL
    chunks: list[str] = []
    spec_iter = iter(specials)
    fill_iter = iter([hay.fill_text(group) for group in window.fill])
    for r in refs.tolist():
        if r >= 0:
            chunks.append(hay.chunk_text(r))
        elif r == SPECIAL:
            chunks.append(next(spec_iter))
        else:
            chunks.append(next(fill_iter))
    return chunks, refs, special_pos


def interleave(per_task: Sequence[Sequence[Generated]]) -> list[Generated]:
    """Round-robin over tasks, so that any prefix of a mixed split covers every task."""
    out: list[Generated] = []
    longest = max((len(x) for x in per_task), default=0)
    for i in range(longest):
        out.extend(items[i] for items in per_task if i < len(items))
    return out
