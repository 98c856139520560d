"""Retrieval and answer metrics.

Fact EM = 1 when every gold chunk was retrieved (gold ⊆ retrieved; extra chunks allowed, as in
the paper); Fact F1 over the sets of chunk indices. Answer EM/F1 use the official HotpotQA
normalisation (lowercase, strip punctuation and articles, collapse whitespace); with several
gold aliases the best score counts (MuSiQue).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence


def fact_em(gold: Iterable[int], retrieved: Iterable[int]) -> float:
    return 1.0 if set(gold) <= set(retrieved) else 0.0


def fact_f1(gold: Iterable[int], retrieved: Iterable[int]) -> float:
    g, r = set(gold), set(retrieved)
    if not g and not r:
        return 1.0
    hit = len(g & r)
    if hit == 0:
        return 0.0
    precision, recall = hit / len(r), hit / len(g)
    return 2 * precision * recall / (precision + recall)


def normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def answer_em(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def answer_f1(prediction: str, gold: str) -> float:
    """Token F1 as in the official HotpotQA evaluation (yes/no/noanswer must match exactly)."""
    pred_n, gold_n = normalize_answer(prediction), normalize_answer(gold)
    special = {"yes", "no", "noanswer"}
    if (pred_n in special or gold_n in special) and pred_n != gold_n:
        return 0.0
    pred_t, gold_t = pred_n.split(), gold_n.split()
    common = Counter(pred_t) & Counter(gold_t)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_t), same / len(gold_t)
    return 2 * precision * recall / (precision + recall)


def best_over_aliases(metric, prediction: str, golds: Sequence[str]) -> float:
    return max((metric(prediction, g) for g in golds if g is not None), default=0.0)


def mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0
