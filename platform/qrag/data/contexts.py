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

from qrag.data.haystack import Haystack, Window
from qrag.data.sample import DataError, Sample

_SUFFIX = {"k": 1024, "m": 1024**2}


def parse_length(text: str) -> int:
    """A context length: ``4k`` -> 4096, ``1m`` -> 1048576, ``10M`` -> 10485760, ``5000`` -> 5000."""
    t = str(text).strip().lower()
    try:
        if t and t[-1] in _SUFFIX:
            return int(round(float(t[:-1]) * _SUFFIX[t[-1]]))
        return int(t)
    except ValueError:
        raise DataError(f"bad context length {text!r} (e.g. 4096, 4k, 1m, 10m)") from None


def length_label(n: int) -> str:
    """The label of a context length in tables, plots and logs (``qrag sweep-lengths`` and
    ``qrag report`` alike): binary multiples as ``1K``, ``32K``, ``1M``, ``10M``; any other size as
    its number (``1000``, ``1536``), so that a label never stands for two lengths and
    ``parse_length(length_label(n)) == n``."""
    n = int(n)
    for suffix, size in (("M", 1024**2), ("K", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size}{suffix}"
    return str(n)


SPECIAL = -1  # refs value of an inserted fact or needle
FILL = -2  # refs value of a window's loose-segment chunk


@dataclass
class Generated:
    """One generated sample and the provenance of its chunks."""

    sample: Sample
    haystack: Haystack
    refs: np.ndarray  # per chunk: haystack chunk index (>= 0), SPECIAL or FILL
    # Token ids (no special tokens) of the chunks with refs < 0, in chunk order, when the
    # generator measured them with a tokenizer (see fresh_ids); None: tokenise their text.
    fresh_ids: list[np.ndarray] | None = None


def seed_for(*parts: object) -> int:
    """A stable 64-bit seed from any values (never Python's salted ``hash``)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


def rng_for(*parts: object) -> np.random.Generator:
    return np.random.default_rng(seed_for(*parts))


def assemble(
    hay: Haystack, window: Window, specials: Sequence[str], rng: np.random.Generator
) -> tuple[list[str], np.ndarray, np.ndarray]:
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


def fresh_ids(
    hay: Haystack, window: Window, refs: np.ndarray, special_ids: Sequence[np.ndarray] | None
) -> list[np.ndarray] | None:
    """Token ids of the chunks that are not whole haystack chunks (refs < 0), in chunk order,
    from ids measured already: the special sentences' own (``special_ids``, as the generator
    measured them to fit the length) and the fill chunks' segment ids. So a generated context
    is tokenised once: evaluation (qrag.evaluation.longcontext.ChunkTokens) does not tokenise them again.
    None when the ids are unknown (a count-only measure, or segment ids that do not compose)."""
    if special_ids is None or (window.fill and not hay.additive):
        return None
    specials = iter(special_ids)
    fills = iter([hay.fill_ids(group) for group in window.fill])
    return [next(specials) if r == SPECIAL else next(fills) for r in refs.tolist() if r < 0]


def interleave(per_task: Sequence[Sequence[Generated]]) -> list[Generated]:
    """Round-robin over tasks, so that any prefix of a mixed split covers every task."""
    out: list[Generated] = []
    longest = max((len(x) for x in per_task), default=0)
    for i in range(longest):
        out.extend(items[i] for items in per_task if i < len(items))
    return out
