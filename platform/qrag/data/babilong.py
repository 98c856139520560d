"""BabiLong: the facts of a bAbI story hidden, in order, in book text up to a target length.

For each bAbI question (qa1-qa5 by default) the story's facts before the question are inserted
at random chunk boundaries of a run of consecutive background chunks from a random place in
the split's books (wrapping around to the next book and, past the end of the corpus, to the
first). Every fact is its own chunk; the support chunks are those of the question's supporting
facts. Chunks are sentence-aligned and hold at most ``data.chunk_tokens`` tokens.

Length: the context (all chunks, no special tokens) is ``data.context_tokens`` tokens of the
model's tokenizer, to within a few tokens. When a story's facts alone are longer than the
target, its oldest facts before the first supporting fact are dropped (they cannot change the
answer of qa1-qa5); a question whose supporting facts still do not fit is skipped.

Background split (documented, no book in both): ``gutenberg_novels/small_collection_british_fiction``
for train (its last books for val), ``gutenberg_novels/100_english_novels_pre1881`` for dev; for
your own text see :func:`qrag.data.haystack.split_files`. bAbI train questions make the train
split (those held out by ``data.val_fraction`` the val split), bAbI test questions the dev split.

Samples are a pure function of (seed, task, split, length, index): same config, same contexts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from qrag.config import DataConfig
from qrag.data import register_loader
from qrag.data.babi import BabiQuestion, load_babi
from qrag.data.babi_names import Renamer
from qrag.data.chunking import TokenCounter
from qrag.data.contexts import Generated, assemble, fresh_ids, interleave, rng_for
from qrag.data.dev_draw import DRAW
from qrag.data.hard_negatives import add_hard, candidates, take
from qrag.data.haystack import MIN_BACKGROUND_TOKENS, NOVELS_DIR, Haystack, Measure, book_files, files_haystack
from qrag.data.paths import data_root
from qrag.data.sample import DataError, Sample
from qrag.data.splits import in_validation

DEFAULT_TASKS = ("qa1", "qa2", "qa3", "qa4", "qa5")


def default_background() -> Path:
    return data_root() / NOVELS_DIR


def book_haystack(path: str | Path | None, split: str, budget: int, measure: Measure, min_tokens: int = 0) -> Haystack:
    """The chunked background books of ``split``, as many as hold ``min_tokens`` (0 = all)."""
    files = book_files(path or default_background(), split)
    return files_haystack(f"books-{split}", files, budget, measure, min_tokens)


def fit_facts(q: BabiQuestion, counts: np.ndarray, length: int) -> int | None:
    """Index of the first fact kept so that the facts fit in ``length`` tokens, or None."""
    total = int(counts.sum())
    first = 0
    limit = q.support[0] if q.support else len(q.facts)
    while total > length and first < limit:
        total -= int(counts[first])
        first += 1
    return first if total <= length else None


def generate_babilong(
    task: str,
    split: str,
    length: int,
    n: int,
    measure: Measure,
    *,
    seed: int = 0,
    budget: int = 64,
    facts_path: str | Path | None = None,
    background: str | Path | None = None,
    hard_negatives: int = 0,
    val_fraction: float = 0.0,
    rename: bool = False,
) -> Iterator[Generated]:
    """``n`` BabiLong samples of ``task`` at ``length`` tokens, one at a time (a 10M-token
    sample is only ever built alone).

    ``split`` is train, dev or val: the validation part of train (the bAbI train questions that
    ``val_fraction`` holds out of training) hidden in the validation books, none of which is in
    the training background (:func:`qrag.data.haystack.split_files`); it chooses settings and
    checkpoints at lengths longer than training. ``hard_negatives``: that many background chunks
    per context chosen by the words they share with the story (:mod:`qrag.data.hard_negatives`).
    ``rename``: each sample swaps the story's names of people, places and objects for others of
    the same kind (:mod:`qrag.data.babi_names`); ``meta['renamed']`` records it.

    Held-out questions are held out by **story** (``BabiQuestion.story``, ``meta['story_id']``):
    val takes the stories ``val_fraction`` holds out, and training never sees their questions. In
    the train split those stories' samples (the validation part of train, which the trainer filters
    out) get neither hard negatives nor renaming: no validation context is a training context.
    dev is the frozen draw of :mod:`qrag.data.dev_draw`: a different seeded question order per
    length, independent of ``seed``. ``meta['hard_negatives']`` counts the context's hard negatives.
    """
    if length <= 0:
        raise DataError(f"babilong: context length must be positive, got {length}")
    questions = load_babi(facts_path, task, "train" if split == "val" else split)
    if split == "val":
        questions = [q for q in questions if in_validation(q.source, val_fraction)]
        if not questions:
            raise DataError(f"babilong {task}: no validation questions (data.val_fraction={val_fraction})")
    # dev: the frozen draw (its own seed, one order per length); train and val: data.seed's order.
    draw = DRAW if split == "dev" else seed
    order_key = (draw, task, split, length) if split == "dev" else (seed, task, split)
    order = rng_for("babilong-order", *order_key).permutation(len(questions))
    renamer = Renamer(questions) if rename else None
    hay = book_haystack(background, split, budget, measure, max(MIN_BACKGROUND_TOKENS, 2 * length))
    produced = draws = 0
    while produced < n:
        if draws >= n + len(questions):
            raise DataError(
                f"babilong {task}: only {produced} of {len(questions)} {split} questions have facts "
                f"that fit in {length} tokens; raise data.context_tokens"
            )
        q = questions[order[draws % len(questions)]]
        story = q.source  # before renaming: the renamed story is still that story's logic
        draws += 1
        held = split == "train" and in_validation(story, val_fraction)  # the validation part of train
        if renamer is not None and not held:
            q = renamer.rename(q, renamer.draw(rng_for("babilong-names", seed, task, split, length, draws)))
        counts, ids = measure.measure(list(q.facts))  # each fact tokenised once: counts fit it, ids feed evaluation
        first = fit_facts(q, counts, length)
        if first is None:
            continue
        rng = rng_for("babilong", draw, task, split, length, draws)
        facts = list(q.facts[first:])
        fact_tokens = int(counts[first:].sum())
        hard = np.zeros(0, dtype=np.int64)
        if hard_negatives > 0 and not held:  # background from the best lexical matches of the story, the rest a window
            pool = candidates(hay, [q.question, *facts], hard_negatives, rng)
            hard = take(hay, pool, hard_negatives, length - fact_tokens)
            window = add_hard(
                hay, hay.window(rng, length - fact_tokens - int(hay.chunk_counts[hard].sum())), hard, pool, rng
            )
        else:
            window = hay.window(rng, length - fact_tokens)
        chunks, refs, fact_pos = assemble(hay, window, facts, rng)
        fresh = fresh_ids(hay, window, refs, None if ids is None else ids[first:])
        support = sorted(int(fact_pos[i - first]) for i in q.support)
        sample = Sample(
            id=f"babilong-{task}-{split}-{length}-{draws - 1}",
            question=q.question,
            chunks=chunks,
            support=support,
            answer=q.answer,
            meta={
                "task": task,
                "source_id": q.id,
                "story_id": story,
                "context_tokens": window.tokens + fact_tokens,
                "target_tokens": length,
                "facts": len(facts),
                "dropped_facts": first,
                "background": hay.name,
                "hard_negatives": len(hard),
                **({"renamed": True} if renamer is not None and not held else {}),
            },
        )
        produced += 1
        yield Generated(sample, hay, refs, fresh)


def _tasks(cfg: DataConfig) -> list[str]:
    return list(cfg.tasks) if cfg.tasks else list(DEFAULT_TASKS)


def samples_for_split(cfg: DataConfig, split: str) -> int:
    if split == "dev" and cfg.dev_samples_per_task is not None:
        return cfg.dev_samples_per_task
    return cfg.samples_per_task


def generate_from_config(
    cfg: DataConfig, split: str, measure: Measure, length: int | None = None, n: int | None = None
) -> list[Generated]:
    """Every task of ``cfg`` at one length, interleaved task by task."""
    per_task = []
    for task in _tasks(cfg):
        per_task.append(
            list(
                generate_babilong(
                    task,
                    split,
                    length or cfg.context_tokens,
                    n if n is not None else samples_for_split(cfg, split),
                    measure,
                    seed=cfg.seed,
                    budget=cfg.chunk_tokens,
                    facts_path=cfg.facts_path,
                    background=cfg.path,
                    hard_negatives=cfg.hard_negatives if split == "train" else 0,
                    val_fraction=cfg.val_fraction,
                    rename=cfg.rename_entities and split == "train",
                )
            )
        )
    return interleave(per_task)


@register_loader("babilong")
def load_babilong(cfg: DataConfig, split: str, count: TokenCounter) -> list[Sample]:
    samples = [g.sample for g in generate_from_config(cfg, split, Measure(count))]
    return samples[: cfg.limit] if cfg.limit is not None else samples
