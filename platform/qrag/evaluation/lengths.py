"""Length sweeps: Fact EM/F1 of retrievers on generated long contexts at several lengths.

The table (JSON, schema ``qrag.length_sweep/1``) has one row per (model, task, length)::

    {"schema": "qrag.length_sweep/1", "created": ..., "device": ..., "git_commit": ..., "git_dirty": ...,
     "git_diff_sha256": ..., "split": "dev", "dev_draw": {...}, "selected_on": ...,
     "memory": "cuda_max_allocated" | "rss_peak",
     "rows": [{"model": "Q-RAG", "checkpoint": "runs/qa3/final", "task": "qa3", "length": 1048576,
               "fact_em": 0.97, "fact_f1": 0.98, "num_samples": 100, "steps": 3,
               "seconds_per_question": 0.05, "generate_seconds_per_question": 0.02,
               "peak_memory_mb": 812.0, "context_tokens": 1048575.2, "chunks": 20684.0,
               "haystack_tokens": 6512000, "distinct_background_tokens": 1046000.0, "hard_negatives": 0.0,
               "positions": "relative", "cached_chunks": 20512, "embedded_chunks": 41800,
               "per_question": {"id": [...], "fact_em": [...], ...}}, ...]}

``fact_em``/``fact_f1`` are means over the questions (0-1); ``length`` is the target context
length in tokens and ``context_tokens`` the mean measured one; ``haystack_tokens`` is the size of
the background corpus the contexts were cut from and ``distinct_background_tokens`` the mean
number of different background tokens a context holds (less than its length once it wraps
around the corpus); ``seconds_per_question`` is tokenising + embedding + search,
``generate_seconds_per_question`` building the context text; ``peak_memory_mb`` is
torch.cuda.max_memory_allocated on GPU, the peak RSS on CPU, during that row. ``steps`` is the
search budget T. ``per_question`` keeps each question's scores, so that several training seeds'
tables combine into means with intervals (:mod:`qrag.evaluation.seeds`).
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from qrag.config import TrainConfig, to_dict
from qrag.data.contexts import length_label, parse_length  # noqa: F401 - one definition, used by qrag report too
from qrag.data.haystack import Measure
from qrag.data.sample import DataError
from qrag.data.splits import in_validation, validation_key
from qrag.evaluation.seeds import per_question
from qrag.evaluation.early_stopping import analyse_threshold, choose_threshold, traces_from_records
from qrag.evaluation.evaluate import PROTOCOL_NOTES, protocol_means, score_retrievals
from qrag.evaluation.longcontext import CachingRetriever, ChunkTokens, canonical_task, generate, task_dataset
from qrag.evaluation.memory import memory_kind, peak_mb, reset_peak
from qrag.metrics import mean
from qrag.integrations.provenance import git_fields, write_json

SCHEMA = "qrag.length_sweep/1"
NEEDLES = "needles"  # steps: each NIAH task's number of asked needles (no spare picks)
# answer(records, samples, dataset) -> summary fields: a reader that scores the retrieved chunks' answers.
AnswerHook = Callable[[list[dict[str, Any]], list[Any], str], dict[str, Any]]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def load_model(checkpoint: str, cfg: TrainConfig, device: torch.device):
    """(qnet, tokenizer, layout) of a checkpoint, or of the untrained encoder for ``"none"`` (the
    paper's baseline: full-vector cosine, no positions) or ``"none:twin"`` (half-vector cosines)."""
    from qrag.model.checkpoint import baseline_qnet, is_untrained, load_qnet

    if is_untrained(checkpoint):
        return baseline_qnet(cfg.model, device, checkpoint)
    qnet, tokenizer, layout, _ = load_qnet(checkpoint, device, with_targets=False)
    return qnet, tokenizer, layout


def sweep_model(
    label: str,
    checkpoint: str,
    cfg: TrainConfig,
    tasks: Sequence[str],
    lengths: Sequence[int],
    samples: Callable[[int], int],
    *,
    split: str = "dev",
    steps: int | str | None = None,
    device: torch.device,
    cache: bool = True,
    max_batch_chunks: int = 65536,
    val_samples: int = 0,
    answer: AnswerHook | None = None,
    allow_train_questions: bool = False,
    log: Callable[[str], None] = lambda s: None,
) -> list[dict[str, Any]]:
    """Rows of one model over tasks x lengths (see the module docstring). ``steps``: the search
    budget T (None = ``cfg.search.max_steps``; ``"needles"`` = each NIAH task's number of asked
    needles, from the task's definition; 0 = each sample group's number of support facts, the
    answer key's T: a labelled extra). With ``val_samples`` > 0 a Q-threshold stop is chosen per
    task on that many validation questions (the held-out part of train, ``data.val_fraction``) at
    the training length, and every row also reports it (``threshold_fact_*``). ``answer``: a reader
    that answers each question from its retrieved chunks; rows gain ``ans_em``/``ans_f1``.
    Questions from sources the checkpoint trained on are refused unless ``allow_train_questions``
    (:mod:`qrag.evaluation.trained`; the val split never holds any)."""
    from qrag.evaluation.trained import Guard

    qnet, tokenizer, layout = load_model(checkpoint, cfg, device)
    measure = Measure.from_tokenizer(tokenizer)
    tokens = ChunkTokens(tokenizer, layout, cfg.data.chunk_tokens, cfg.data.question_tokens)
    retriever = CachingRetriever(qnet, layout, device, cfg.learner.encode_tokens, shared=tokens.shared if cache else {})
    guard = Guard(checkpoint, allow_train_questions)

    def run(
        task: str, which: str, length: int, n: int, answering: bool = False
    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        gen_s = search_s = answer_s = 0.0
        records, ctx_tokens, n_chunks, distinct, hard = [], [], [], [], []
        t_steps = task_steps(task, cfg.search.max_steps if steps is None else steps) or None
        answers: list[dict[str, Any]] = []
        hay_tokens = 0
        stream = generate_split(task, which, length, n, measure, cfg.data)
        while True:
            t0 = time.perf_counter()
            group = list(_take(stream, max_batch_chunks))
            gen_s += time.perf_counter() - t0
            if not group:
                break
            guard.check([g.sample for g in group])
            t0 = time.perf_counter()
            tok = tokens(group)
            if t_steps is None:
                t_steps = max(len(g.sample.support) for g in group)
            search = replace(cfg.search, max_steps=t_steps, stop_threshold=None)
            retrievals = retriever.retrieve(tok, search, max_batch_chunks=max_batch_chunks)
            search_s += time.perf_counter() - t0
            scored = score_retrievals([g.sample for g in group], retrievals, cfg.env.credit)
            if answering and answer is not None:
                t0 = time.perf_counter()
                answers.append(answer(scored, [g.sample for g in group], task_dataset(task)))
                answer_s += time.perf_counter() - t0
            records.extend(scored)
            ctx_tokens.extend(g.sample.meta["context_tokens"] for g in group)
            n_chunks.extend(len(g.sample.chunks) for g in group)
            distinct.extend(g.haystack.distinct_tokens(g.refs) for g in group)
            hard.extend(g.sample.meta.get("hard_negatives", g.sample.meta.get("near_misses", 0)) for g in group)
            hay_tokens = max(hay_tokens, *(g.haystack.tokens for g in group))
            del group, tok, retrievals
        return records, {
            "steps": t_steps,
            "gen_s": gen_s,
            "search_s": search_s,
            "context_tokens": mean(ctx_tokens),
            "chunks": mean(n_chunks),
            "haystack_tokens": hay_tokens,
            "distinct_background_tokens": mean(distinct),
            "hard_negatives": mean(hard),
            **answer_means(records, answers, answer_s),
        }

    rows = []
    for task in [canonical_task(t) for t in tasks]:
        threshold, on_val = None, {}
        if val_samples > 0:
            val_records, _ = run(task, "val", cfg.data.context_tokens, val_samples)
            if val_records:
                val_traces = traces_from_records(val_records)
                threshold = choose_threshold(val_traces)
                # The stop's score where it was chosen (optimistic, alike for every model): with the oracle's
                # there, what a model's learned stop can be compared on without touching dev.
                stopped_val = analyse_threshold(val_traces, threshold)
                on_val = {
                    "threshold_val_fact_f1": stopped_val["fact_f1"],
                    "oracle_val_fact_f1": protocol_means(val_records)["oracle_fact_f1"],
                    "threshold_val_questions": len(val_records),
                }
                log(
                    f"{label:>12} {task:>16}: Q threshold {threshold:.4f} "
                    f"chosen on {len(val_records)} validation questions"
                )
            else:  # too few training questions for data.val_fraction to hold any out
                log(f"{label:>12} {task:>16}: no validation questions (data.val_fraction); no learned stop")
        for length in sorted(lengths):
            n = samples(length)
            reset_peak(device)
            embedded0, cached0, trained0 = retriever.misses, retriever.hits, guard.hits
            records, info = run(task, split, length, n, answering=True)
            gen_s, search_s = info.pop("gen_s"), info.pop("search_s")
            row = {
                "model": label,
                "checkpoint": checkpoint,
                "task": task,
                "length": int(length),
                **protocol_means(records),
                "credit": cfg.env.credit,
                "num_samples": len(records),
                "seconds_per_question": search_s / max(1, len(records)),
                "generate_seconds_per_question": gen_s / max(1, len(records)),
                "peak_memory_mb": round(peak_mb(device), 1),
                **info,
                "positions": qnet.cfg.positions,
                "cached_chunks": retriever.hits - cached0,
                "embedded_chunks": retriever.misses - embedded0,
                "train_questions": {**guard.record(), "trained_on": guard.hits - trained0},
            }
            if threshold is not None:
                stopped = analyse_threshold(traces_from_records(records), threshold, keep_records=True)
                for rec, em, f1 in zip(records, stopped["fact_em_each"], stopped["fact_f1_each"]):
                    rec["threshold_fact_em"], rec["threshold_fact_f1"] = em, f1
                row.update(
                    threshold=threshold,
                    threshold_fact_em=stopped["fact_em"],
                    threshold_fact_f1=stopped["fact_f1"],
                    threshold_steps=stopped["episode_len"],
                    **on_val,
                )
            row["per_question"] = per_question(records)
            rows.append(row)
            log(
                f"{label:>12} {task:>16} {length_label(length):>6}: "
                f"fact_f1 {row['fact_f1']:.3f} fact_em {row['fact_em']:.3f} "
                f"n={row['num_samples']} {row['seconds_per_question']:.3f}s/q peak {row['peak_memory_mb']:.0f}MB"
            )
        tokens.clear()  # haystack chunk arrays of this task; the embedding cache goes with them
        retriever.clear()
    return rows


def task_steps(task: str, steps: int | str) -> int:
    """The search budget T of one task: ``steps``, or for ``"needles"`` the NIAH task's number of
    asked needles (no spare picks: one needle found among four picks is not a retrieval)."""
    if steps != NEEDLES:
        return int(steps)
    if task_dataset(task) != "niah":
        raise DataError(f"steps={NEEDLES!r} is for RULER NIAH tasks; {task} is not one")
    from qrag.data.niah import asked_needles

    return asked_needles(task)


def answer_means(records: list[dict[str, Any]], answers: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """A row's answer fields from its records (each scored by the reader hook), if it answered."""
    if not answers:
        return {}
    scored = [r for r in records if r.get("ans_em") is not None]
    return {
        "ans_em": mean([r["ans_em"] for r in scored]) if scored else None,
        "ans_f1": mean([r["ans_f1"] for r in scored]) if scored else None,
        "answer_errors": sum(a.get("answer_errors", 0) for a in answers),
        "reader_model": answers[0].get("reader_model"),
        "answer_seconds_per_question": seconds / max(1, len(records)),
    }


def generate_split(task: str, split: str, length: int, n: int, measure: Measure, data) -> Iterator[Any]:
    """``generate`` for train/dev/all, and "val": the held-out part of train (by the source
    question, :func:`qrag.data.splits.validation_key`), never trained on. BabiLong builds it
    itself, in the validation books (background no training context holds); NIAH questions are
    drawn from train and filtered."""
    if split == "val" and data.val_fraction <= 0:
        raise DataError("a validation split needs data.val_fraction > 0")
    if split != "val" or task_dataset(task) == "babilong":
        yield from generate(task, split, length, n, measure, data)
        return

    # A NIAH sample's validation key is its own id, so the train samples val leaves out are
    # skipped before their contexts are built; the filter below still decides what is kept.
    def train_side(sample_id: str) -> bool:
        return not in_validation(sample_id, data.val_fraction)

    taken = 0
    for g in generate(task, "train", length, int(n / data.val_fraction * 3) + 100, measure, data, skip=train_side):
        if in_validation(validation_key(g.sample), data.val_fraction):
            yield g
            taken += 1
            if taken >= n:
                return


def _take(stream, max_chunks: int, max_items: int = 64):
    """Pull generated samples from ``stream`` until their chunks would pass ``max_chunks``
    (always at least one sample, so a 10M-token context is searched alone)."""
    size = 0
    taken = 0
    for g in stream:
        yield g
        taken += 1
        size += len(g.sample.chunks)
        if size >= max_chunks or taken >= max_items:
            return


def run_sweep(
    models: Sequence[tuple[str, str]],
    cfg: TrainConfig,
    tasks: Sequence[str],
    lengths: Sequence[int],
    samples: Callable[[int], int],
    *,
    split: str = "dev",
    steps: int | str | None = None,
    device: torch.device,
    cache: bool = True,
    val_samples: int = 0,
    answer: AnswerHook | None = None,
    allow_train_questions: bool = False,
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """The whole table for several models (a checkpoint directory, or ``"none"``)."""
    rows = []
    for label, checkpoint in models:
        rows.extend(
            sweep_model(
                label,
                checkpoint,
                cfg,
                tasks,
                lengths,
                samples,
                split=split,
                steps=steps,
                device=device,
                cache=cache,
                val_samples=val_samples,
                answer=answer,
                allow_train_questions=allow_train_questions,
                log=log,
            )
        )
    return run_sweep_table(rows, cfg, device, split, selected_on=selection_note(cfg, val_samples))


def selection_note(cfg: TrainConfig, val_samples: int) -> str:
    """What the sweep itself chose, and on what (generated from its arguments, never hand-written)."""
    if val_samples <= 0:
        return "nothing in this sweep: every row is all T picks, no stop, no threshold"
    return (
        f"learned stop only: a Q threshold per model and task, chosen on {val_samples} validation questions "
        f"(held out of train by source, data.val_fraction={cfg.data.val_fraction}) "
        f"at {cfg.data.context_tokens} tokens; "
        "the checkpoints were given to the sweep"
    )


def run_sweep_table(
    rows: list[dict[str, Any]],
    cfg: TrainConfig,
    device: torch.device,
    split: str = "dev",
    selected_on: str | None = None,
) -> dict[str, Any]:
    """The table (module docstring) around rows of :func:`sweep_model`."""
    from qrag.data.dev_draw import describe
    from qrag.evaluation.longcontext import default_paths

    return {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        **git_fields(),
        "split": split,
        **({"dev_draw": describe()} if split == "dev" else {}),
        **({"selected_on": selected_on} if selected_on else {}),
        "memory": memory_kind(device),
        "data": {"seed": cfg.data.seed, "chunk_tokens": cfg.data.chunk_tokens, **default_paths(cfg.data)},
        "search": to_dict(cfg.search),
        # Every row names its protocol: fact_* = T picks, no oracle (the headline, within T);
        # oracle_fact_* = stopped once the support is complete (the reference's, paper-comparable);
        # threshold_fact_* = stopped by a Q threshold chosen on validation questions.
        "protocols": {
            "fact": "all T picks, no oracle",
            "oracle_fact": "stop once the support is complete (answer key)",
            "threshold_fact": "learned Q-threshold stop chosen on validation questions",
        },
        "credit": cfg.env.credit,
        "rows": rows,
    }


def write_table(table: dict[str, Any], path: str | Path) -> Path:
    return write_json(path, table)


def read_table(path: str | Path) -> dict[str, Any]:
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: cannot read a length-sweep table: {exc}") from None
    if not isinstance(table, dict) or table.get("schema") != SCHEMA or not isinstance(table.get("rows"), list):
        raise DataError(f"{path}: not a {SCHEMA} table")
    return table


def merge_tables(tables: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One table from several (e.g. one GPU run per task); later rows win on the same key."""
    if not tables:
        raise DataError("nothing to merge")
    rows: dict[tuple, dict[str, Any]] = {}
    for t in tables:
        for r in t["rows"]:
            rows[(r["model"], r["task"], r["length"])] = r
    out = dict(tables[-1])
    out["rows"] = list(rows.values())
    return out


def format_table(table: dict[str, Any]) -> str:
    """One block per protocol (:data:`qrag.evaluation.evaluate.PROTOCOL_NOTES`, those the rows
    have, the headline first), each titled with it, the number of picks T and the credit rule:
    x100 per model and task, one column per length (the paper's layout). A table combined over
    training seeds shows each figure's 95% interval beside it."""
    rows = table["rows"]
    width = 22 if any(f"{m}_ci" in r for r in rows for m in PROTOCOL_NOTES) else 8
    lengths = sorted({r["length"] for r in rows})
    keys = sorted({(r["task"], r["model"]) for r in rows})
    by = {(r["task"], r["model"], r["length"]): r for r in rows}
    steps = ", ".join(str(x) for x in sorted({r["steps"] for r in rows if "steps" in r})) or "?"
    credit = ", ".join(sorted({r["credit"] for r in rows if "credit" in r})) or "?"
    head = f"{'task':<16}{'model':<18}" + "".join(f"{length_label(n):>{width}}" for n in lengths)
    blocks = []
    for metric, note in PROTOCOL_NOTES.items():
        if not any(metric in r for r in rows):
            continue
        lines = [f"Fact {metric[-2:].upper()} (%): {note}; T = {steps}; credit: {credit}", head]
        for task, model in keys:
            cells = [
                f"{percent_cell(by[(task, model, n)], metric):>{width}}"
                if metric in by.get((task, model, n), {})
                else f"{'-':>{width}}"
                for n in lengths
            ]
            lines.append(f"{task:<16}{model[:17]:<18}" + "".join(cells))
        blocks.append("\n".join(lines))
    if width > 8:
        seeds = sorted({r.get("num_seeds", 1) for r in rows})
        blocks.append(
            f"[low, high]: 95% interval, bootstrap over training seeds ({', '.join(map(str, seeds))} per row), "
            "then questions"
        )
    return "\n\n".join(blocks)


def percent_cell(row: dict[str, Any], metric: str) -> str:
    """``95.0`` or, with an interval, ``95.0 [93.1, 96.9]`` (x100)."""
    ci = row.get(f"{metric}_ci")
    text = f"{100 * row[metric]:.1f}"
    return f"{text} [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else text


def error_bars(values: Sequence[float], intervals: Sequence[Sequence[float] | None], scale: float = 100.0):
    """matplotlib's ``yerr`` (distances below and above each point) from [low, high] intervals
    (0-1, drawn x ``scale``); None when no point has one."""
    if not any(intervals):
        return None
    # Clipped at 0: a mean and a bound summed in another order can differ in the last bit (every
    # seed at 0.4 gives a mean a hair above its interval), and matplotlib refuses a negative bar.
    below = [max(0.0, v - scale * ci[0]) if ci else 0.0 for v, ci in zip(values, intervals)]
    above = [max(0.0, scale * ci[1] - v) if ci else 0.0 for v, ci in zip(values, intervals)]
    return [below, above]


def plot_table(table: dict[str, Any], path: str | Path) -> Path | None:
    """Fact F1 against context length, one panel per task, one line per model (like Fig. 2), with
    95% intervals as error bars where the table has them. Returns None (with no file) when
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = table["rows"]
    tasks = sorted({r["task"] for r in rows})
    models = list(dict.fromkeys(r["model"] for r in rows))
    cols = min(4, len(tasks))
    nrows = -(-len(tasks) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax, task in zip(axes.flat, tasks):
        for m in models:
            pts = sorted(
                (r["length"], 100 * r["fact_f1"], r.get("fact_f1_ci"))
                for r in rows
                if r["task"] == task and r["model"] == m
            )
            if not pts:
                continue
            style = "--" if m.lower().startswith(("untrained", "none", "w/o ft")) else "-"
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            ax.errorbar(xs, ys, yerr=error_bars(ys, [p[2] for p in pts]), fmt=style, marker="o", capsize=3, label=m)
        ax.set_xscale("log", base=2)
        ticks = sorted({r["length"] for r in rows if r["task"] == task})
        ax.set_xticks(ticks, [length_label(t) for t in ticks], rotation=45)
        ax.set_ylim(0, 102)
        ax.set_title(task)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("Fact F1 (%)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
