"""Training without support labels: the answer is all a record tells (``data.supervision=answer``).

Each training question's support becomes the chunks whose text holds its answer (or an alias, in
``meta["answer_aliases"]`` or ``meta["answers"]``), as whole words, case-insensitively; the training
environment counts a step that picks any of them as the success (credit rule ``any`` of
:mod:`qrag.data.credit`). Neither the step-by-step order nor the other supporting facts are used, so
this is the setting where a policy learnt from reward can find chunks a label never named, and the one
where supervised learning has only these weak labels too. Validation and dev keep their support
facts: Fact EM/F1 still measures what the questions need.

Questions whose answer is "yes" or "no" (HotpotQA's comparisons) or appears in no chunk have no
answer-bearing chunk and are left out of training; how many is reported.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np

from qrag.data.sample import DataError, Sample
from qrag.data.tokens import TokenizedSample

SUPERVISIONS = ("support", "answer")
UNLOCATABLE = {"yes", "no", ""}


def answers_of(sample: Sample) -> list[str]:
    """The answer and its aliases, without those no chunk can hold (yes, no, empty)."""
    found = [sample.answer]
    for key in ("answer_aliases", "answers"):
        extra = sample.meta.get(key)
        if isinstance(extra, list):
            found.extend(str(a) for a in extra)
    out = []
    for a in found:
        a = a.strip()
        if a.lower() not in UNLOCATABLE and a not in out:
            out.append(a)
    return out


def answer_chunks(sample: Sample) -> list[int]:
    """Indices of the chunks whose text holds one of the sample's answers as whole words."""
    patterns = [re.compile(r"(?<!\w)" + re.escape(a) + r"(?!\w)", re.IGNORECASE) for a in answers_of(sample)]
    return [i for i, chunk in enumerate(sample.chunks) if any(p.search(chunk) for p in patterns)]


def answer_supervised(
    samples: Sequence[Sample], tokenized: Sequence[TokenizedSample], where: str = "training split"
) -> tuple[list[Sample], list[TokenizedSample], int]:
    """The samples (and their tokenised twins, in the same order) whose answer lies in a chunk, each
    with those chunks as its support; and how many were left out. Raises when none is left."""
    if len(samples) != len(tokenized):
        raise ValueError(f"{where}: {len(samples)} samples against {len(tokenized)} tokenised ones")
    kept_s, kept_t = [], []
    for sample, tok in zip(samples, tokenized):
        chunks = answer_chunks(sample)
        if chunks:
            kept_s.append(dataclasses.replace(sample, support=chunks))
            kept_t.append(dataclasses.replace(tok, support=np.asarray(chunks, dtype=np.int64)))
    if samples and not kept_s:
        raise DataError(
            f"data.supervision=answer: no question of the {where} has its answer in one of its chunks "
            f"({len(samples)} questions; yes/no answers cannot be located)"
        )
    return kept_s, kept_t, len(samples) - len(kept_s)


def training_part(
    supervision: str, samples: Sequence[Sample], tokenized: Sequence[TokenizedSample]
) -> tuple[list[Sample], list[TokenizedSample], int]:
    """The training questions as the learner sees them under ``data.supervision`` and how many were
    left out (answer supervision: questions without an answer-bearing chunk)."""
    if supervision == "answer":
        return answer_supervised(samples, tokenized)
    if supervision != "support":
        raise ValueError(f"data.supervision: expected one of {', '.join(SUPERVISIONS)}, got {supervision!r}")
    return list(samples), list(tokenized), 0
