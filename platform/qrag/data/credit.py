"""Which retrieved chunks count as which support fact: the credit rule, shared by the reward and
by Fact EM/F1 so that training and every table use one definition.

* ``chunk`` (default): a support fact is found only by selecting its own chunk (the index).
* ``text``: any chunk whose text equals a support fact's text counts as that fact (the public
  reference's ``GroundTruthReward``). bAbI stories repeat sentences ("Mary went to the kitchen."),
  so under ``chunk`` an identical earlier copy of a support fact earns nothing.
* ``any``: the support chunks are alternatives, one fact found by picking any of them (training on
  answer-bearing chunks, :mod:`qrag.data.answer_support`; not a rule for reporting Fact EM).

Support facts with identical text are one fact under ``text`` (selecting one copy finds both).
Chunks are compared as strings (samples) or token-id arrays (tokenised episodes); with one
tokenizer the two agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

CREDIT_RULES = ("chunk", "text")  # what env.credit and the reports take
ANY = "any"  # the training environment's rule under data.supervision=answer only


def _key(chunk: Any) -> Any:
    return chunk.tobytes() if isinstance(chunk, np.ndarray) else chunk


def support_classes(chunks: Sequence[Any], support: Sequence[int], rule: str) -> tuple[np.ndarray, int]:
    """For each chunk the support fact it counts as (-1: none), and the number of facts."""
    if rule not in CREDIT_RULES and rule != ANY:
        raise ValueError(f"credit rule {rule!r}: expected one of {', '.join(CREDIT_RULES)}")
    classes = np.full(len(chunks), -1, dtype=np.int64)
    if rule == ANY:
        classes[sorted(set(int(s) for s in support))] = 0
        return classes, 1
    if rule == "chunk":
        for k, i in enumerate(sorted(set(int(s) for s in support))):
            classes[i] = k
        return classes, len(set(int(s) for s in support))
    fact_of: dict[Any, int] = {}
    for i in support:
        fact_of.setdefault(_key(chunks[int(i)]), len(fact_of))
    for j, chunk in enumerate(chunks):
        classes[j] = fact_of.get(_key(chunk), -1)
    return classes, len(fact_of)


def fact_picks(classes: np.ndarray, retrieved: Sequence[int]) -> list[int]:
    """Picks in *fact space*: a pick's support fact id the first time that fact is found, else a
    unique negative id (a pick that finds nothing new). Set metrics over ``range(n_facts)`` and
    these ids (:func:`qrag.metrics.fact_em` / ``fact_f1``) then apply the credit rule, and under
    ``chunk`` credit they equal the metrics over chunk indices."""
    seen: set[int] = set()
    out = []
    for t, j in enumerate(retrieved):
        k = int(classes[j])
        if k >= 0 and k not in seen:
            seen.add(k)
            out.append(k)
        else:
            out.append(-1 - t)
    return out
