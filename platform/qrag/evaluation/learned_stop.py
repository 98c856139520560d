"""A stop learned on one evaluation's records and applied to another's, offline (``qrag learned-stop``).

Both files are ``qrag eval --out`` summaries of the same checkpoint at the same T, searched greedily
to the end (no threshold): the picks of a stopped greedy search are a prefix of those
(:mod:`qrag.evaluation.early_stopping`). The rule (a Q threshold, or a number of steps) is chosen on
the first file's questions and the second file is scored under it, so the choice never sees what it
is reported on. Out of distribution, the first can be questions of the target dataset that the
checkpoint never trained on (MuSiQue's train subset for a HotpotQA-only checkpoint) and the second
its dev questions.

The output is the second summary with the learned stop's figures beside the full-length ones:
``threshold_fact_em`` / ``threshold_fact_f1`` (whatever the rule; per question in the records, so
``qrag combine-seeds`` gives them intervals), the rule and its value (``threshold`` or ``budget``),
its score on the questions it was chosen on, and a ``selected_on`` that says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qrag.data.sample import DataError
from qrag.evaluation.early_stopping import stop_chosen_on


def _load(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from qrag.evaluation.seeds import read_records

    try:
        summary = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: cannot read an eval summary: {exc}") from None
    if not isinstance(summary, dict) or "fact_f1" not in summary:
        raise DataError(f"{path}: not an eval summary (qrag eval --out)")
    return summary, read_records(path)


def _check_pair(val_file: str, val: dict[str, Any], eval_file: str, ev: dict[str, Any]) -> None:
    """The two files must be searches of one checkpoint, greedy and full length, at the same T,
    on different questions."""
    if Path(str(val.get("checkpoint"))).resolve() != Path(str(ev.get("checkpoint"))).resolve():
        raise DataError(
            f"{val_file} scored checkpoint {val.get('checkpoint')} and {eval_file} {ev.get('checkpoint')}: "
            "a stop is learned for one checkpoint"
        )
    if (val.get("dataset"), val.get("split")) == (ev.get("dataset"), ev.get("split")):
        raise DataError(
            f"{val_file} and {eval_file} are both {val.get('dataset')} {val.get('split')}: the stop would be "
            "chosen on the questions it is reported on"
        )
    for file, summary in ((val_file, val), (eval_file, ev)):
        search = summary.get("search") or {}
        if search.get("beam_width", 1) != 1 or search.get("stop_threshold") is not None:
            raise DataError(
                f"{file}: searched with beam_width={search.get('beam_width')}, stop_threshold="
                f"{search.get('stop_threshold')}; a stop is learned from greedy full-length searches"
            )
    steps = [(summary.get("search") or {}).get("max_steps") for summary in (val, ev)]
    if steps[0] != steps[1]:
        raise DataError(f"{val_file} searched {steps[0]} steps and {eval_file} {steps[1]}: use the same T")


def apply_learned_stop(val_file: str | Path, eval_file: str | Path, rule: str, out: str | Path) -> dict[str, Any]:
    """``eval_file`` stopped by ``rule`` chosen on ``val_file``, written to ``out`` (with records)."""
    val_file, eval_file = str(val_file), str(eval_file)
    val, val_records = _load(val_file)
    summary, records = _load(eval_file)
    _check_pair(val_file, val, eval_file, summary)
    try:
        stop = stop_chosen_on(val_records, records, rule)
    except ValueError as exc:
        raise DataError(f"{val_file} / {eval_file}: {exc}") from None
    chosen = {k: stop[k] for k in ("threshold", "budget") if k in stop}
    where = f"{val.get('dataset')} {val.get('split')}, {stop['val_questions']} questions ({Path(val_file).name})"
    value = ", ".join(f"{k} {v:g}" for k, v in chosen.items())
    summary = {
        **summary,
        "threshold_fact_em": stop["fact_em"],
        "threshold_fact_f1": stop["fact_f1"],
        "threshold_episode_len": stop["episode_len"],
        "stop_rule": stop["stop_rule"],
        **chosen,
        "threshold_val_fact_f1": stop["val_fact_f1"],
        "threshold_val_questions": stop["val_questions"],
        "selected_on": f"{summary.get('selected_on', '')}; stop: the {stop['stop_rule']} ({value}) with the best "
        f"Fact F1 on {where}" + (", of the best budget and the best threshold there" if rule == "best" else ""),
    }
    records = [
        {**r, "threshold_fact_em": em, "threshold_fact_f1": f1}
        for r, em, f1 in zip(records, stop["fact_em_each"], stop["fact_f1_each"])
    ]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    with open(out.with_suffix(".records.jsonl"), "w") as fh:
        for rec in records:
            fh.write(json.dumps(rec) + "\n")
    return summary
