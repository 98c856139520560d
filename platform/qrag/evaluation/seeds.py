"""One headline file from the result files of several training seeds: means and 95% intervals.

Each input file is one training seed's evaluation: a length sweep (``qrag sweep-lengths``,
``bench/longctx.py``; its rows carry their per-question scores in ``per_question``) or an eval
summary (``qrag eval --out FILE.json``, with ``FILE.records.jsonl`` beside it). A model that
appears in several files is one model trained with several seeds; the untrained encoder, whose
figures do not depend on a training seed, usually appears in one.

Every metric of a combined row is the mean over all questions of all seeds, with
``<metric>_ci`` = [low, high] (:mod:`qrag.evaluation.intervals`), ``<metric>_by_seed`` and
``num_seeds``. The seeds of one row must have been asked the same questions (the frozen dev draw):
a row whose seeds disagree is an error, not an average over different questions. Validation tables
(``split: val``, e.g. the val scores of the checkpoints ``bench/longctx.py`` chose) are the exception:
their draw follows each run's ``data.seed``, so seeds of different data seeds may hold different
questions (the bootstrap draws seeds, then each seed's own questions); equal data seeds must still
agree, and two models are compared paired where their seeds were asked the same questions, seed for seed.
A length sweep's combined table also lists ``differences``: for each task and length, every pair
of models on Fact EM, called a difference only when its interval excludes 0; eval summaries of
several methods (``qrag eval --label``) combine into a ``methods`` file with the same.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qrag.data.sample import DataError
from qrag.evaluation.intervals import LEVEL, REPLICATES, Interval, bootstrap_interval, difference_interval
from qrag.evaluation.methods import method_label

# Per-question scores a result may carry, each the mean of its questions in the figure.
METRICS = (
    "fact_em",
    "fact_f1",
    "oracle_fact_em",
    "oracle_fact_f1",
    "threshold_fact_em",
    "threshold_fact_f1",
    "ans_em",
    "ans_f1",
)
# What two rows are compared on: Fact EM, and a learned stop's Fact F1 wherever both rows carry one per question
# (qrag learned-stop, a length sweep's learned-stop column): the figure a stop is judged by, which Fact EM over
# all T picks does not see.
DIFFERENCE_METRICS = ("fact_em", "threshold_fact_f1")
# A seed's own values that no mean over seeds and questions stands for: its learned stop's threshold (or
# budget: qrag learned-stop) and that stop's score on the val questions it was chosen on (beside the oracle
# stop's there).
PER_SEED = (
    "threshold",
    "budget",
    "threshold_episode_len",
    "threshold_val_fact_f1",
    "oracle_val_fact_f1",
    "threshold_val_questions",
)
METHOD = (
    "two-stage percentile bootstrap: training seeds with replacement, then each drawn seed's questions "
    "with replacement; the figure is the mean over all questions of all seeds; a difference marked paired "
    "resamples the per-question differences of two rows asked the same questions, seed i against seed i"
)


def per_question(records: Sequence[dict[str, Any]]) -> dict[str, list]:
    """The per-question columns of eval records (``id`` and every metric all records carry)."""
    out: dict[str, list] = {"id": [str(r["id"]) for r in records]}
    for key in METRICS:
        values = [r.get(key) for r in records]
        if records and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = [round(float(v), 6) for v in values]
    return out


def interval_fields(metric: str, by_seed: list[list[float]], replicates: int = REPLICATES) -> dict[str, Any]:
    iv = bootstrap_interval(by_seed, replicates=replicates)
    return {metric: iv.mean, f"{metric}_ci": [iv.low, iv.high], f"{metric}_by_seed": [sum(s) / len(s) for s in by_seed]}


def _combine_rows(
    key: tuple, rows: list[tuple[str, dict[str, Any]]], replicates: int, draws: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One row from one (model, task, length) of each seed's file. ``draws`` (validation tables only):
    each file's data seed, which its questions follow; without it every seed holds the frozen dev draw.
    Files of one draw must have been asked the same questions."""
    missing = [f for f, r in rows if not isinstance(r.get("per_question"), dict)]
    if missing:
        raise DataError(
            f"{missing[0]}: row {key} has no per-question scores (per_question); re-run its evaluation "
            "with this version, which records them"
        )
    ids = [r["per_question"]["id"] for _, r in rows]
    first_of_draw: dict[Any, tuple[str, list[str]]] = {}
    for (file, _), asked in zip(rows, ids):
        draw = None if draws is None else draws[file]
        first, first_asked = first_of_draw.setdefault(draw, (file, asked))
        if asked == first_asked:
            continue
        if draws is None:
            raise DataError(
                f"{file}: row {key} was asked other questions than {first}: seeds must be scored on "
                "the same (frozen) dev draw"
            )
        raise DataError(
            f"{file}: row {key} was asked other questions than {first}, drawn with the same data seed "
            f"{draw}: a validation draw follows data.seed, so the two must agree"
        )
    first = rows[0][1]
    # Per-seed values (a checkpoint, its own stop threshold) are not a combined row's: lists below.
    not_copied = {*METRICS, *PER_SEED, "per_question", "checkpoint"}
    out = {k: v for k, v in first.items() if k not in not_copied and not k.startswith("threshold")}
    for k in PER_SEED:  # each seed's stop was chosen on val on its own: one value per seed
        if all(k in r for _, r in rows):
            out[f"{k}_by_seed"] = [r[k] for _, r in rows]
    for k in ("context_tokens", "chunks", "distinct_background_tokens", "seconds_per_question"):
        if all(isinstance(r.get(k), (int, float)) for _, r in rows):
            out[k] = sum(r[k] for _, r in rows) / len(rows)
    out.update(
        num_seeds=len(rows),
        num_samples=round(sum(map(len, ids)) / len(ids)),  # per seed
        checkpoints=[r.get("checkpoint") for _, r in rows],
    )
    for metric in METRICS:
        if all(metric in r["per_question"] for _, r in rows):
            out.update(interval_fields(metric, [r["per_question"][metric] for _, r in rows], replicates))
    return out


def _differences(grouped: dict[tuple, list[tuple[str, dict[str, Any]]]], replicates: int) -> list[dict[str, Any]]:
    """Every pair of models within each task and length (``grouped``: each (model, task, length)'s seeds)."""
    out = []
    models = list(dict.fromkeys(model for model, _, _ in grouped))
    for task, length in sorted({(task, length) for _, task, length in grouped}):
        present = {
            m: [r["per_question"] for _, r in grouped[(m, task, length)]]
            for m in models
            if (m, task, length) in grouped
        }
        out += metric_differences(present, replicates, task=task, length=length)
    return out


def metric_differences(
    columns: dict[str, list[dict[str, list]]], replicates: int, **where: Any
) -> list[dict[str, Any]]:
    """:func:`pairwise_differences` on each of ``DIFFERENCE_METRICS``, between the models whose seeds all carry
    it per question. ``columns``: each model's per-question columns (``id`` and metrics), one per seed."""
    ids = {m: [c["id"] for c in seeds] for m, seeds in columns.items()}
    out = []
    for metric in DIFFERENCE_METRICS:
        scores = {m: [c[metric] for c in seeds] for m, seeds in columns.items() if all(metric in c for c in seeds)}
        if len(scores) > 1:
            out += pairwise_differences(scores, replicates, {m: ids[m] for m in scores}, metric, **where)
    return out


def pairwise_differences(
    scores: dict[str, list[list[float]]],
    replicates: int,
    ids: dict[str, list[list[str]]] | None = None,
    metric: str = "fact_em",
    **where: Any,
) -> list[dict[str, Any]]:
    """Every pair of models (in order) on ``metric``: a - b, its interval and what it allows one to say;
    ``where`` (a length sweep's task and length) leads each entry. ``ids``: each model's question ids
    per seed; two models whose seeds were asked the same questions, seed for seed, are compared
    paired (:func:`qrag.evaluation.intervals.difference_interval`)."""
    names = list(scores)
    out = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            paired = ids is not None and ids[a] == ids[b]
            iv = difference_interval(scores[a], scores[b], replicates=replicates, paired=paired)
            out.append(
                {
                    **where,
                    "metric": metric,
                    "a": a,
                    "b": b,
                    "difference": iv.mean,
                    "ci": [iv.low, iv.high],
                    "paired": paired,
                    "called": called(iv, a, b),
                }
            )
    return out


def called(iv: Interval, a: str, b: str) -> str:
    """What a difference's interval allows one to say."""
    if not iv.excludes(0.0):
        return "no difference shown"
    return f"{a} > {b}" if iv.low > 0 else f"{a} < {b}"


def combine_tables(tables: Sequence[tuple[str, dict[str, Any]]], replicates: int = REPLICATES) -> dict[str, Any]:
    """One length-sweep table from several seeds' tables (``(file, table)`` pairs)."""
    if not tables:
        raise DataError("combine-seeds: no result files")
    grouped: dict[tuple, list[tuple[str, dict[str, Any]]]] = {}
    for file, table in tables:
        seen: set[tuple] = set()
        for r in table["rows"]:
            key = (r["model"], r["task"], r["length"])
            if key in seen:
                raise DataError(f"{file}: two rows for {key}; one file is one seed's evaluation")
            seen.add(key)
            grouped.setdefault(key, []).append((file, r))
    grouped.update(_task_means(grouped))
    draws = None
    if all(t.get("split") == "val" for _, t in tables):
        draws = {file: (t.get("data") or {}).get("seed") for file, t in tables}
    rows = [_combine_rows(key, group, replicates, draws) for key, group in grouped.items()]
    base = dict(tables[-1][1])
    for k in ("rows", "training", "machine", "selection"):
        base.pop(k, None)
    sources = [_source(file, t) for file, t in tables]
    return {
        **base,
        # The last file's own provenance would speak for every model (e.g. the untrained file's
        # selection note for the trained seeds): each source's, grouped.
        **_joint_provenance(sources),
        "kind": "seeds",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "combined_from": sources,
        "interval": {"level": LEVEL, "method": METHOD, "replicates": replicates},
        "rows": rows,
        "differences": _differences(grouped, replicates),
    }


MEAN_TASK = "mean"


def _task_means(
    grouped: dict[tuple, list[tuple[str, dict[str, Any]]]],
) -> dict[tuple, list[tuple[str, dict[str, Any]]]]:
    """A ``mean`` row per model and length measured on several tasks (RULER NIAH's headline): per
    seed, the questions of all its tasks pooled (equal questions per task: the mean of the tasks)."""
    by_cell: dict[tuple, dict[str, list[dict[str, Any]]]] = {}
    for (model, _, length), group in grouped.items():
        for file, row in group:
            by_cell.setdefault((model, length), {}).setdefault(file, []).append(row)
    out = {}
    for (model, length), files in by_cell.items():
        if len({r["task"] for rows in files.values() for r in rows}) < 2:
            continue
        pooled = []
        for file, rows in files.items():
            rows = sorted(rows, key=lambda r: r["task"])
            if any(not isinstance(r.get("per_question"), dict) for r in rows):
                break
            pq: dict[str, list] = {"id": [f"{r['task']}/{i}" for r in rows for i in r["per_question"]["id"]]}
            for metric in METRICS:
                if all(metric in r["per_question"] for r in rows):
                    pq[metric] = [v for r in rows for v in r["per_question"][metric]]
            pooled.append(
                (
                    file,
                    {
                        "model": model,
                        "task": MEAN_TASK,
                        "length": length,
                        "credit": rows[0].get("credit"),
                        "tasks": [r["task"] for r in rows],
                        "per_question": pq,
                    },
                )
            )
        else:
            out[(model, MEAN_TASK, length)] = pooled
    return out


def _source(file: str, table: dict[str, Any]) -> dict[str, Any]:
    training = table.get("training") or {}
    models = list(dict.fromkeys(r.get("model") for r in table.get("rows", [])))
    return {
        "file": file,
        "git_commit": table.get("git_commit") or (table.get("machine") or {}).get("commit"),
        "git_dirty": table.get("git_dirty"),
        "models": models,
        "training_seed": (training.get("config") or {}).get("seed"),
        "selected_on": table.get("selected_on") or training.get("selected_on"),  # the whole note: the file's own
    }


def _joint_provenance(sources: list[dict[str, Any]]) -> dict[str, Any]:
    """The combined file's commit, dirty flag and selection note, drawn from every source (notes
    that differ are told per model; an eval summary, one method, names none: per file)."""
    commits = list(dict.fromkeys(s["git_commit"] for s in sources))
    notes: dict[str, list[str]] = {}
    for s in sources:
        if s["selected_on"]:
            notes.setdefault(s["selected_on"], []).extend([m for m in s["models"] if m] or [Path(s["file"]).name])
    selected_on = " | ".join(
        f"{', '.join(dict.fromkeys(names))}: {note}" if len(notes) > 1 else note for note, names in notes.items()
    )
    return {
        "git_commit": commits[0] if len(commits) == 1 else commits,
        "git_dirty": any(bool(s["git_dirty"]) for s in sources),
        **({"selected_on": selected_on} if selected_on else {}),
    }


def combine_summaries(
    summaries: Sequence[tuple[str, dict[str, Any], list[dict[str, Any]]]], replicates: int = REPLICATES
) -> dict[str, Any]:
    """One eval summary from several seeds' (file, summary, records) of one method and dataset; or,
    when the files hold several methods (``qrag eval --label``: Table 3's rows), a ``methods`` file:
    each method combined so, and the difference between every pair on Fact EM (and on a learned stop's Fact F1,
    where both rows' seeds carry one) with its interval."""
    if not summaries:
        raise DataError("combine-seeds: no result files")
    kinds = {(s.get("dataset"), s.get("split")) for _, s, _ in summaries}
    if len(kinds) > 1:
        raise DataError(
            f"combine-seeds: eval summaries of different datasets or splits: {sorted(map(str, kinds))}; "
            "combine one split of one dataset at a time"
        )
    groups: dict[str, list[tuple[str, dict[str, Any], list[dict[str, Any]]]]] = {}
    for item in summaries:
        groups.setdefault(method_label(item[1]), []).append(item)
    columns = {name: [per_question(records) for _, _, records in group] for name, group in groups.items()}
    methods = {name: _combine_method(group, columns[name], replicates) for name, group in groups.items()}
    if len(methods) == 1:
        return next(iter(methods.values()))
    first = next(iter(columns))
    for name, cols in columns.items():
        if cols[0]["id"] != columns[first][0]["id"]:
            raise DataError(
                f"combine-seeds: {name} was scored on other questions than {first}; methods compared "
                "with each other must be asked the same questions"
            )
    dataset, split = next(iter(kinds))
    return {
        "kind": "methods",
        "dataset": dataset,
        "split": split,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **_joint_provenance([_source(file, s) for file, s, _ in summaries]),
        "interval": {"level": LEVEL, "method": METHOD, "replicates": replicates},
        "methods": [{**m, "label": name} for name, m in methods.items()],
        "differences": metric_differences(columns, replicates),
    }


def _combine_method(
    summaries: Sequence[tuple[str, dict[str, Any], list[dict[str, Any]]]],
    columns: Sequence[dict[str, list]],
    replicates: int,
) -> dict[str, Any]:
    """One method's seeds (with each one's per-question columns), each scored on the same
    questions, as one summary with intervals."""
    cols = [(file, c) for (file, _, _), c in zip(summaries, columns)]
    for file, c in cols[1:]:
        if c["id"] != cols[0][1]["id"]:
            raise DataError(f"{file}: other questions than {cols[0][0]}: seeds must be scored on the same questions")
    out = {k: v for k, v in summaries[-1][1].items() if k not in METRICS and k not in PER_SEED}
    for k in PER_SEED:  # each seed's own stop (qrag learned-stop): one value per seed, never the last one's
        if all(k in s for _, s, _ in summaries):
            out[f"{k}_by_seed"] = [s[k] for _, s, _ in summaries]
    out.update(_joint_provenance([_source(file, s) for file, s, _ in summaries]))
    out.update(
        num_seeds=len(summaries),
        num_samples=len(cols[0][1]["id"]),
        checkpoints=[s.get("checkpoint") for _, s, _ in summaries],
        combined_from=[f for f, _, _ in summaries],
        interval={"level": LEVEL, "method": METHOD, "replicates": replicates},
    )
    for metric in METRICS:
        if all(metric in c for _, c in cols):
            out.update(interval_fields(metric, [c[metric] for _, c in cols], replicates))
    return out


def read_records(summary_file: str | Path) -> list[dict[str, Any]]:
    path = Path(summary_file).with_suffix(".records.jsonl")
    if not path.is_file():
        raise DataError(f"{summary_file}: no per-question records beside it ({path.name}); qrag eval --out writes them")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def combine_files(files: Sequence[str | Path], replicates: int = REPLICATES) -> dict[str, Any]:
    """Length sweeps or eval summaries (not both), one file per training seed, combined."""
    loaded = []
    for f in files:
        try:
            loaded.append((str(f), json.loads(Path(f).read_text())))
        except (OSError, json.JSONDecodeError) as exc:
            raise DataError(f"{f}: cannot read a result file: {exc}") from None
    sweeps = [isinstance(d, dict) and isinstance(d.get("rows"), list) for _, d in loaded]
    if all(sweeps):
        return combine_tables(loaded, replicates)
    if not any(sweeps) and all(isinstance(d, dict) and "fact_em" in d and "dataset" in d for _, d in loaded):
        return combine_summaries([(f, d, read_records(f)) for f, d in loaded], replicates)
    raise DataError("combine-seeds: give length sweeps (rows) or eval summaries (fact_em, dataset), one kind at a time")
