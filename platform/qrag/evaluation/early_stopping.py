"""Q-threshold early stopping, analysed offline (paper appendix "Early stopping experiments").

From one full-length run (T steps, no threshold; records carry the picks ``retrieved`` in pick
order and the chosen actions' ``q_values``) we simulate, for each threshold, the policy that keeps
acting while Q_t >= threshold and stops at the first Q_t below it, without re-running the search:
the picks of a thresholded greedy search are a prefix of the full-length picks.

Per episode: ``t_stop`` = actions taken under the rule; ``t_earliest`` = the first t whose picks
a_1..a_t contain every gold chunk. Episodes that never collect the gold set are left out of the
early / perfect / late shares (as in the paper) but count everywhere else.

* early:   t_stop <  t_earliest (stopped before the gold set was complete)
* perfect: t_stop == t_earliest
* late:    t_stop >  t_earliest (kept going after it was complete)
* TPR / FPR: the rule as a per-step classifier over all episodes. Step t's decision is "take
  a_t" (Q_t >= threshold); it should be taken when the gold set is not yet complete before it
  (t <= t_earliest, or the episode never completes it). TPR = share of should-take steps taken,
  FPR = share of should-stop steps taken. The oracle (stop exactly at t_earliest) has TPR 1, FPR 0.
* episode length, Fact EM, Fact F1: over all episodes, from the truncated picks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from qrag.metrics import fact_em, fact_f1, mean

DEFAULT_THRESHOLDS = [round(-0.1 + 0.1 * i, 2) for i in range(13)]  # -0.1 .. 1.1, as in the paper


@dataclass(frozen=True)
class Trace:
    """One full-length episode: gold chunk ids, picks in order, Q of each pick."""

    id: str
    gold: tuple[int, ...]
    picks: tuple[int, ...]
    q: tuple[float, ...]

    @property
    def t_earliest(self) -> int | None:
        need = set(self.gold)
        if not need:
            return 0
        have: set[int] = set()
        for t, chunk in enumerate(self.picks, 1):
            have.add(chunk)
            if need <= have:
                return t
        return None

    def t_stop(self, threshold: float) -> int:
        for t, q in enumerate(self.q):
            if q < threshold:
                return t
        return len(self.q)


def traces_from_records(records: Iterable[dict[str, Any]]) -> list[Trace]:
    """Traces from eval records (``gold``, ``retrieved``, ``q_values``); refuses records of a run
    that already stopped on a threshold, whose Q values past the stop are unknown."""
    traces = []
    for i, rec in enumerate(records):
        where = f"record {i} (id={rec.get('id')})"
        for key in ("gold", "retrieved", "q_values"):
            if not isinstance(rec.get(key), list):
                raise ValueError(
                    f"{where}: no list field {key!r}; early stopping needs eval records of a full-length run"
                )
        if len(rec["retrieved"]) != len(rec["q_values"]):
            raise ValueError(f"{where}: {len(rec['retrieved'])} picks but {len(rec['q_values'])} Q values")
        if rec.get("stopped_early"):
            raise ValueError(
                f"{where}: the run stopped on a Q threshold; analyse a full-length run (no --stop-threshold)"
            )
        if isinstance(rec.get("fact_picks"), list) and "n_facts" in rec:
            # Fact space (qrag.data.credit): the record's credit rule decides what counts as found.
            gold, picks = tuple(range(int(rec["n_facts"]))), tuple(rec["fact_picks"])
        else:
            gold, picks = tuple(rec["gold"]), tuple(rec["retrieved"])
        traces.append(Trace(str(rec.get("id", i)), gold, picks, tuple(float(q) for q in rec["q_values"])))
    if not traces:
        raise ValueError("no records to analyse")
    return traces


def _should_take(trace: Trace) -> list[bool]:
    earliest = trace.t_earliest
    return [earliest is None or t <= earliest for t in range(1, len(trace.q) + 1)]


def analyse_threshold(traces: Sequence[Trace], threshold: float, keep_records: bool = False) -> dict[str, Any]:
    """The stop rule at ``threshold`` over ``traces``; ``keep_records`` adds each trace's Fact EM
    and F1 in order (``fact_em_each``, ``fact_f1_each``: what intervals over questions need)."""
    early = perfect = late = 0
    tp = fn = fp = tn = 0
    lengths, ems, f1s = [], [], []
    for tr in traces:
        stop = tr.t_stop(threshold)
        picked = tr.picks[:stop]
        lengths.append(stop)
        ems.append(fact_em(tr.gold, picked))
        f1s.append(fact_f1(tr.gold, picked))
        earliest = tr.t_earliest
        if earliest is not None:
            early += stop < earliest
            perfect += stop == earliest
            late += stop > earliest
        for q, should in zip(tr.q, _should_take(tr)):
            took = q >= threshold
            tp += should and took
            fn += should and not took
            fp += (not should) and took
            tn += (not should) and not took
    covered = early + perfect + late
    return {
        "threshold": threshold,
        "early": early / covered if covered else None,
        "perfect": perfect / covered if covered else None,
        "late": late / covered if covered else None,
        "tpr": tp / (tp + fn) if tp + fn else None,
        "fpr": fp / (fp + tn) if fp + tn else None,
        "episode_len": mean(lengths),
        "fact_em": mean(ems),
        "fact_f1": mean(f1s),
        **({"fact_em_each": ems, "fact_f1_each": f1s} if keep_records else {}),
    }


def roc_auc(traces: Sequence[Trace]) -> float | None:
    """Area under the ROC curve of Q_t as a score for "take a_t" (ties count half)."""
    pos = sorted(q for tr in traces for q, s in zip(tr.q, _should_take(tr)) if s)
    neg = [q for tr in traces for q, s in zip(tr.q, _should_take(tr)) if not s]
    if not pos or not neg:
        return None
    import bisect

    wins = sum(
        len(pos) - bisect.bisect_right(pos, q) + 0.5 * (bisect.bisect_right(pos, q) - bisect.bisect_left(pos, q))
        for q in neg
    )
    return wins / (len(pos) * len(neg))


def _cut(traces: Sequence[Trace], stops: Sequence[int]) -> tuple[list[float], list[float]]:
    """Fact EM and F1 of each trace's picks up to its stop."""
    ems = [fact_em(tr.gold, tr.picks[:stop]) for tr, stop in zip(traces, stops)]
    return ems, [fact_f1(tr.gold, tr.picks[:stop]) for tr, stop in zip(traces, stops)]


def oracle(traces: Sequence[Trace]) -> dict[str, Any]:
    """The policy that stops exactly at t_earliest (and runs to T when the gold set never completes)."""
    lengths = [tr.t_earliest if tr.t_earliest is not None else len(tr.picks) for tr in traces]
    ems, f1s = _cut(traces, lengths)
    return {"tpr": 1.0, "fpr": 0.0, "episode_len": mean(lengths), "fact_em": mean(ems), "fact_f1": mean(f1s)}


def analyse(records: Iterable[dict[str, Any]], thresholds: Sequence[float] | None = None) -> dict[str, Any]:
    """The early-stopping table for ``thresholds`` (default -0.1 .. 1.1 by 0.1) from full-length records."""
    traces = traces_from_records(records)
    thresholds = sorted(DEFAULT_THRESHOLDS if thresholds is None else thresholds)
    covered = sum(1 for tr in traces if tr.t_earliest is not None)
    return {
        "kind": "early_stopping",
        "episodes": len(traces),
        "collected_gold": covered,
        "max_steps": max(len(tr.q) for tr in traces),
        "rows": [analyse_threshold(traces, t) for t in thresholds],
        "oracle": oracle(traces),
        "auc": roc_auc(traces),
    }


def choose_threshold(traces: Sequence[Trace], max_candidates: int = 256) -> float:
    """The Q threshold with the best mean Fact F1 on ``traces`` — validation data, never the
    data the stop is reported on (ties: the lowest threshold, i.e. the longest searches)."""
    qs = sorted({q for tr in traces for q in tr.q})
    if not qs:
        raise ValueError("no Q values to choose a threshold from")
    if len(qs) > max_candidates:
        qs = [qs[round(i * (len(qs) - 1) / (max_candidates - 1))] for i in range(max_candidates)]
    # A threshold equal to a Q value takes that step; one above the largest stops at once.
    candidates = [*qs, qs[-1] + 1.0]
    return max(candidates, key=lambda th: (analyse_threshold(traces, th)["fact_f1"], -th))


def analyse_budget(traces: Sequence[Trace], budget: int, keep_records: bool = False) -> dict[str, Any]:
    """Every trace cut after its first ``budget`` picks (a greedy search of that many steps);
    ``keep_records`` as :func:`analyse_threshold`."""
    lengths = [min(budget, len(tr.picks)) for tr in traces]
    ems, f1s = _cut(traces, lengths)
    return {
        "budget": budget,
        "episode_len": mean(lengths),
        "fact_em": mean(ems),
        "fact_f1": mean(f1s),
        **({"fact_em_each": ems, "fact_f1_each": f1s} if keep_records else {}),
    }


def choose_budget(traces: Sequence[Trace]) -> int:
    """The number of steps with the best mean Fact F1 on ``traces`` — validation data, never the
    data it is reported on (ties: the larger budget, as :func:`choose_threshold`'s longest searches)."""
    longest = max((len(tr.picks) for tr in traces), default=0)
    if longest == 0:
        raise ValueError("no picks to choose a budget from")
    return max(range(1, longest + 1), key=lambda k: (analyse_budget(traces, k)["fact_f1"], k))


# How a stop is learned on validation records: a Q threshold (the paper's), a number of steps, or whichever of the
# two scores higher there (a checkpoint whose Q does not place the stop, e.g. out of distribution, gets the count).
STOP_RULES = ("threshold", "budget", "best")


def stop_chosen_on(
    val_records: Iterable[dict[str, Any]], records: Iterable[dict[str, Any]], rule: str
) -> dict[str, Any]:
    """``records`` stopped by ``rule`` chosen on ``val_records`` (full-length greedy records of the
    same checkpoint): the choice, its score on val, and the Fact EM and F1 under it, mean and per record.
    ``best``: the budget and the threshold each chosen so, then the one with the higher val Fact F1 (ties:
    the budget, which needs no calibrated Q)."""
    val, traces = traces_from_records(val_records), traces_from_records(records)
    if rule == "best":
        by_rule = [_stop_on_traces(val, traces, r) for r in ("budget", "threshold")]
        return max(by_rule, key=lambda stop: stop["val_fact_f1"])  # the first of equals: the budget
    return _stop_on_traces(val, traces, rule)


def _stop_on_traces(val: Sequence[Trace], traces: Sequence[Trace], rule: str) -> dict[str, Any]:
    if rule == "threshold":
        threshold = choose_threshold(val)
        chosen, on_val = {"threshold": threshold}, analyse_threshold(val, threshold)
        row = analyse_threshold(traces, threshold, keep_records=True)
    elif rule == "budget":
        budget = choose_budget(val)
        chosen, on_val = {"budget": budget}, analyse_budget(val, budget)
        row = analyse_budget(traces, budget, keep_records=True)
    else:
        raise ValueError(f"stop rule must be one of {', '.join(STOP_RULES)}, got {rule!r}")
    return {
        "stop_rule": rule,
        **chosen,
        "val_fact_f1": on_val["fact_f1"],
        "val_questions": len(val),
        "episode_len": row["episode_len"],
        "fact_em": row["fact_em"],
        "fact_f1": row["fact_f1"],
        "fact_em_each": row["fact_em_each"],
        "fact_f1_each": row["fact_f1_each"],
    }
