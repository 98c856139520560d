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


# -- answers per benchmark -------------------------------------------------------------------------

# The answer vocabulary of the BabiLong tasks this project runs (bAbI qa1-qa5). A model output counts
# as correct when the gold label is the only label it names (labels the question names are ignored).
BABILONG_LABELS: dict[str, tuple[str, ...]] = {
    "qa1": ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office"),
    "qa2": ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office"),
    "qa3": ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office"),
    "qa4": ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office"),
    "qa5": ("bill", "fred", "jeff", "mary", "apple", "football", "milk"),
}


def _first_sentence(output: str) -> str:
    """BabiLong scores the first sentence only, and cuts off text where a model starts inventing
    further examples or questions."""
    text = output.lower().split(".")[0]
    for marker in ("<context>", "<example>", "question"):
        text = text.split(marker)[0]
    return text


def _mentions(text: str, word: str) -> bool:
    return re.search(rf"(?<![a-z0-9]){re.escape(word)}(?![a-z0-9])", text) is not None


def babilong_accuracy(prediction: str, gold: str, question: str = "", labels: Sequence[str] | None = None) -> float:
    """BabiLong's answer accuracy: the gold word appears in the output's first sentence,
    case-insensitive. With the task's ``labels``, the gold label must also be the only label the
    output names, not counting labels the question itself mentions (so "the apple is in the
    kitchen, or the garden" is wrong). Multi-word golds "a,b" need every part and nothing else."""
    out = _first_sentence(prediction)
    targets = [t.strip() for t in gold.lower().split(",") if t.strip()]
    if not targets:
        return 0.0
    if not labels:
        return float(all(_mentions(out, t) for t in targets))
    q = question.lower()
    vocab = {label.lower() for label in labels}
    named = {label for label in vocab if _mentions(out, label)} - {label for label in vocab if _mentions(q, label)}
    return float(set(targets) <= named and len(named) == len(set(targets)))


def contains_all(prediction: str, golds: Sequence[str]) -> float:
    """RULER's string match: the share of gold values that appear in the output (case-insensitive)."""
    if not golds:
        return 0.0
    out = prediction.lower()
    return sum(1.0 for g in golds if g.lower() in out) / len(golds)


def score_answer(
    dataset: str, prediction: str, golds: Sequence[str], question: str = "", task: str | None = None
) -> tuple[float, float]:
    """(EM, F1) of one answer by the benchmark's own rule.

    hotpotqa, 2wiki, musique, jsonl: HotpotQA normalisation, best over the gold aliases.
    babilong: BabiLong's accuracy (EM = F1 = accuracy). niah: RULER's share of values found.
    """
    if dataset == "babilong":
        acc = babilong_accuracy(prediction, golds[0] if golds else "", question, BABILONG_LABELS.get(task or ""))
        return acc, acc
    if dataset == "niah":
        share = contains_all(prediction, golds)
        return float(share == 1.0), share
    return best_over_aliases(answer_em, prediction, golds), best_over_aliases(answer_f1, prediction, golds)
