"""Generated long contexts at evaluation time: token arrays and chunk embeddings, reused.

A 1M-token BabiLong context is ~20K chunks of book text plus a few facts; the book chunks are
the same objects for every question drawn from the same haystack. Two things follow:

* token arrays of haystack chunks come from the haystack's measured ids (no re-tokenising of
  10M tokens per question), and the same array object stands for the same chunk everywhere;
* :class:`CachingRetriever` embeds each distinct haystack chunk once per model and reuses the
  vector for every later question and length (a chunk's embedding depends on its tokens only).
  Facts, needles and fill chunks are always embedded fresh.

Both are exact shortcuts: results equal tokenising and embedding every chunk of every context
(up to batch-order float noise), as ``tests/test_lengths.py`` checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from qrag.config import DataConfig
from qrag.data.contexts import Generated
from qrag.data.haystack import Haystack, Measure
from qrag.data.sample import DataError
from qrag.retrieval.search import Retriever
from qrag.data.tokens import TokenizedSample, TokenLayout, tokenize_samples


def task_dataset(task: str) -> str:
    """``qa1``..``qa20`` -> babilong; RULER names (``niah_single_1``) and aliases (``S1``) -> niah."""
    from qrag.data.niah import ALIASES, TASKS

    if task.lower().startswith("qa") and task[2:].isdigit():
        return "babilong"
    if task in TASKS or task.lower() in ALIASES:
        return "niah"
    raise DataError(f"unknown long-context task {task!r} (qa1..qa5, or a RULER NIAH task such as niah_single_1 / S1)")


def canonical_task(task: str) -> str:
    """``QA3`` -> ``qa3``; ``S1`` -> ``niah_single_1`` (tables and plots use one name per task)."""
    if task_dataset(task) == "babilong":
        return task.lower()
    from qrag.data.niah import task_spec

    return task_spec(task)[0]


def generate(
    task: str,
    split: str,
    length: int,
    n: int,
    measure: Measure,
    data: DataConfig,
    skip: Callable[[str], bool] | None = None,
) -> Iterator[Generated]:
    """``n`` samples of one task at one length, one at a time, less those whose sample id ``skip``
    accepts (NIAH never builds them; BabiLong builds them, then leaves them out)."""
    if task_dataset(task) == "babilong":
        from qrag.data.babilong import generate_babilong

        built = generate_babilong(
            task,
            split,
            length,
            n,
            measure,
            seed=data.seed,
            budget=data.chunk_tokens,
            facts_path=data.facts_path,
            background=data.path if data.dataset == "babilong" else None,
            val_fraction=data.val_fraction,
        )
        return built if skip is None else (g for g in built if not skip(g.sample.id))
    from qrag.data.niah import generate_niah

    return generate_niah(
        task,
        split,
        length,
        n,
        measure,
        seed=data.seed,
        budget=data.chunk_tokens,
        essays=data.path if data.dataset == "niah" else None,
        skip=skip,
    )


class ChunkTokens:
    """Token arrays for generated samples; one shared array per haystack chunk."""

    def __init__(self, tokenizer, layout: TokenLayout, chunk_tokens: int, question_tokens: int):
        self.tokenizer = tokenizer
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.question_tokens = question_tokens
        self._arrays: dict[tuple[int, int], np.ndarray] = {}  # (id(haystack), chunk) -> [CLS] ids [SEP]
        self._haystacks: dict[int, Haystack] = {}  # keeps haystacks alive while their id() is a key
        self.shared: dict[int, np.ndarray] = {}  # id(array) -> array, for every shared chunk array

    def _chunk(self, hay: Haystack, k: int) -> np.ndarray:
        key = (id(hay), k)
        arr = self._arrays.get(key)
        if arr is None:
            arr = self.layout.wrap(hay.chunk_ids(k)[: self.chunk_tokens])
            self._arrays[key] = arr
            self.shared[id(arr)] = arr
        return arr

    def __call__(self, items: Sequence[Generated]) -> list[TokenizedSample]:
        fast = [g for g in items if g.haystack.additive]
        slow = [g for g in items if not g.haystack.additive]
        out: dict[int, TokenizedSample] = {}
        if slow:  # the tokenizer does not compose: tokenise every chunk's text
            for g, t in zip(
                slow,
                tokenize_samples(
                    [g.sample for g in slow],
                    self.tokenizer,
                    self.layout,
                    chunk_tokens=self.chunk_tokens,
                    question_tokens=self.question_tokens,
                ),
            ):
                out[id(g)] = t
        if fast:
            # Facts, needles and fill chunks: the ids the generator measured (each sentence is
            # tokenised once per context), else their text tokenised here.
            fresh_text = [g.sample.chunks[i] for g in fast if g.fresh_ids is None for i in np.flatnonzero(g.refs < 0)]
            told = iter(
                self.tokenizer(fresh_text, add_special_tokens=False, truncation=True, max_length=self.chunk_tokens)[
                    "input_ids"
                ]
                if fresh_text
                else []
            )
            fresh: list = []
            for g in fast:
                if g.fresh_ids is not None:
                    fresh.extend(ids[: self.chunk_tokens] for ids in g.fresh_ids)
                else:
                    fresh.extend(next(told) for _ in range(int((g.refs < 0).sum())))
            questions = self.tokenizer(
                [g.sample.question for g in fast],
                add_special_tokens=False,
                truncation=True,
                max_length=self.question_tokens,
            )["input_ids"]
            k = 0
            for g, q in zip(fast, questions):
                self._haystacks[id(g.haystack)] = g.haystack
                chunks = []
                for r in g.refs.tolist():
                    if r >= 0:
                        chunks.append(self._chunk(g.haystack, r))
                    else:
                        chunks.append(self.layout.wrap(fresh[k]))
                        k += 1
                out[id(g)] = TokenizedSample(
                    g.sample.id, self.layout.wrap(q), chunks, np.asarray(g.sample.support, dtype=np.int64)
                )
        return [out[id(g)] for g in items]

    def clear(self) -> None:
        self._arrays.clear()
        self._haystacks.clear()
        self.shared.clear()


class CachingRetriever(Retriever):
    """A :class:`Retriever` that embeds each shared haystack chunk once (per model).

    ``shared`` maps ``id(array) -> array`` for token arrays that stand for the same chunk
    wherever they appear (see :class:`ChunkTokens`); any other array is embedded every time.
    At most ``max_cached`` vectors are kept (the cache is emptied when full).
    """

    def __init__(
        self,
        qnet,
        layout: TokenLayout,
        device: torch.device,
        encode_tokens: int = 32768,
        shared: dict[int, np.ndarray] | None = None,
        max_cached: int = 2_000_000,
    ):
        super().__init__(qnet, layout, device, encode_tokens)
        self.shared = shared if shared is not None else {}
        self.max_cached = max_cached
        self._row: dict[int, int] = {}
        self._held: list[np.ndarray] = []
        self._store: torch.Tensor | None = None
        self.hits = 0
        self.misses = 0

    @property
    def cached(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        self._row.clear()
        self._held.clear()
        self._store = None

    @torch.no_grad()
    def embed_chunks(self, seqs: Sequence[np.ndarray], chunk_batch: int = 4096) -> torch.Tensor:
        n = len(seqs)
        rows = np.fromiter((self._lookup(s) for s in seqs), dtype=np.int64, count=n)
        miss = np.flatnonzero(rows < 0)
        self.hits += n - len(miss)
        # Embed each distinct missing array once (a wrapped haystack repeats chunks).
        first: dict[int, int] = {}
        for i in miss.tolist():
            first.setdefault(id(seqs[i]), len(first))
        unique = [None] * len(first)
        for i in miss.tolist():
            unique[first[id(seqs[i])]] = seqs[i]
        self.misses += len(unique)
        fresh = super().embed_chunks(unique, chunk_batch) if unique else None
        out = torch.empty(n, self.qnet.dim, device=self.device)
        hit = np.flatnonzero(rows >= 0)
        if len(hit):
            out[torch.from_numpy(hit).to(self.device)] = self._store[torch.from_numpy(rows[hit]).to(self.device)]
        if len(miss):
            pick = torch.tensor([first[id(seqs[i])] for i in miss.tolist()], device=self.device)
            out[torch.from_numpy(miss).to(self.device)] = fresh[pick]
            self._remember(unique, fresh)
        return out

    def _lookup(self, seq: np.ndarray) -> int:
        row = self._row.get(id(seq))
        return row if row is not None and self._held[row] is seq else -1

    def _remember(self, seqs: list[np.ndarray], vecs: torch.Tensor) -> None:
        keep = [i for i, s in enumerate(seqs) if self.shared.get(id(s)) is s]
        if not keep:
            return
        if self.cached + len(keep) > self.max_cached:
            self.clear()
        new = vecs[torch.tensor(keep, device=vecs.device)]
        base, end = self.cached, self.cached + len(keep)
        capacity = 0 if self._store is None else len(self._store)
        if end > capacity:  # grow geometrically: appending stays linear in the vectors cached
            grown = vecs.new_empty(max(end, min(2 * capacity, self.max_cached)), vecs.shape[1])
            if base:
                grown[:base] = self._store[:base]
            self._store = grown
        self._store[base:end] = new
        for j, i in enumerate(keep):
            self._row[id(seqs[i])] = base + j
            self._held.append(seqs[i])


def default_paths(data: DataConfig) -> dict[str, str]:
    """Where the generators read from (for the table's provenance). A default that cannot be
    resolved (no shared data folder on this machine) is recorded as absent, not an error: the
    benchmark ran on explicitly given paths."""
    from qrag.data.babi import default_dir
    from qrag.data.babilong import default_background
    from qrag.data.niah import default_essays

    def resolved(default) -> str | None:
        try:
            return str(default())
        except DataError:
            return None

    out = {"babi": str(data.facts_path) if data.facts_path else resolved(default_dir)}
    if data.dataset == "babilong" and data.path:
        out["background"] = str(Path(data.path))
    else:
        out["background"] = resolved(default_background)
    out["essays"] = str(data.path) if data.dataset == "niah" and data.path else resolved(default_essays)
    return out
