"""Paper-style tables (Markdown) and plots (PNG) from result files.

Three kinds of input, told apart by their content:

* **eval summaries** (``qrag eval --out FILE.json``; keys ``fact_em``, ``fact_f1``, ``dataset``,
  optionally ``ans_em``/``ans_f1``) -> the paper's Table 2 layout: one row per method, for each
  dataset Fact F1 / Fact EM / Ans F1 / Ans EM, then the average answer scores. A dataset the
  checkpoint was not trained on is marked "(OOD)". ``paper=True`` adds the paper's rows.
* **length sweeps** (``{"rows": [{"task", "length", "fact_f1", "fact_em", ...}]}``, as
  ``qrag lengths`` writes) -> a table per metric (tasks x context lengths) and a plot.
* **early-stopping tables** (:func:`qrag.evaluation.early_stopping.analyse`; ``"kind": "early_stopping"``)
  -> the appendix table and its curves: early/late/perfect shares, episode length and Fact F1
  against the Q threshold, and the ROC curve.

Results combined over training seeds (``qrag combine-seeds``) carry ``<metric>_ci`` beside each
metric: tables show the 95% interval beside the mean ("0.950 [0.930, 0.970]"), plots draw it as
error bars, and a length sweep's ``differences`` become a table that calls a difference only where
its interval excludes 0.

Plots need matplotlib; without it the Markdown is still written and the report says so.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qrag.data.contexts import length_label
from qrag.evaluation.evaluate import PROTOCOL_NOTES
from qrag.evaluation.lengths import error_bars
from qrag.evaluation.methods import method_label

# The paper's Table 2 (HotPotQA, MuSiQue OOD) and its appendix table (MuSiQue in-distribution):
# (Fact F1, Fact EM, Ans F1, Ans EM); None = not reported. Reader: QwQ-32B for Q-RAG and Beam
# Retriever. Reference numbers to print beside ours, not results of this code.
PAPER_READER = "QwQ-32B"
PAPER_TABLE2: dict[str, dict[str, tuple[float | None, ...]]] = {
    "Plan Q-RAG": {
        "hotpotqa": (0.95, 0.91, 0.76, 0.60),
        "musique": (0.84, 0.76, 0.60, 0.44),
        "musique (OOD)": (0.69, 0.53, 0.51, 0.36),
    },
    "Q-RAG": {
        "hotpotqa": (0.93, 0.89, 0.76, 0.59),
        "musique": (0.81, 0.72, 0.59, 0.43),
        "musique (OOD)": (0.71, 0.55, 0.52, 0.37),
    },
    "Beam Retriever": {
        "hotpotqa": (0.97, 0.94, 0.77, 0.61),
        "musique": (0.86, 0.69, 0.59, 0.43),
        "musique (OOD)": (0.61, 0.36, 0.40, 0.27),
    },
    "Search-R1": {"hotpotqa": (0.81, 0.66, 0.65, 0.52), "musique (OOD)": (0.71, 0.55, 0.51, 0.39)},
    "RAG-RL": {"hotpotqa": (0.82, None, 0.69, None), "musique (OOD)": (0.65, None, 0.47, None)},
    "Multi-step RAG w/o FT": {"hotpotqa": (0.73, 0.54, 0.65, 0.50), "musique (OOD)": (0.51, 0.30, 0.40, 0.27)},
    "GraphReader": {"hotpotqa": (None, None, 0.46, 0.24), "musique (OOD)": (None, None, 0.40, 0.20)},
    "Single-step RAG": {"hotpotqa": (None, None, 0.53, 0.39), "musique (OOD)": (None, None, 0.28, 0.17)},
}
METRICS = ("fact_f1", "fact_em", "ans_f1", "ans_em")
METRIC_TITLES = {
    "fact_f1": "Fact F1",
    "fact_em": "Fact EM",
    "ans_f1": "Ans F1",
    "ans_em": "Ans EM",
    "oracle_fact_f1": "Fact F1, oracle stop (paper-comparable)",
    "threshold_fact_f1": "Fact F1, learned Q-threshold stop (chosen on validation)",
}
DATASET_TITLES = {
    "hotpotqa": "HotPotQA",
    "musique": "MuSiQue",
    "2wiki": "2WikiMultihopQA",
    "babilong": "BabiLong",
    "niah": "RULER NIAH",
}
COLUMN_ORDER = ("hotpotqa", "musique", "musique (OOD)", "2wiki", "2wiki (OOD)")


class ReportError(ValueError):
    """A result file that cannot be read or reported."""


@dataclass
class Report:
    markdown: list[str] = field(default_factory=list)
    plots: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def text(self) -> str:
        out = "\n".join(self.markdown).rstrip() + "\n"
        if self.notes:
            out += "\n" + "\n".join(f"- {n}" for n in self.notes) + "\n"
        return out


def fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def with_interval(value: Any, ci: Sequence[float] | None, digits: int = 3) -> Any:
    """``value``, as "mean [low, high]" text when it has an interval ``ci``."""
    if ci is None or not isinstance(value, (int, float)):
        return value
    return f"{value:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 3) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(v, digits) for v in row) + " |" for row in rows]
    return lines


# -- reading ---------------------------------------------------------------------------------------


def read_result(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReportError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: not a JSON result file ({exc})") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path}: expected a JSON object")
    return data


def result_kind(data: dict[str, Any]) -> str:
    if data.get("kind") in ("early_stopping", "methods"):
        return data["kind"]
    if "fact_f1" in data and "dataset" in data:
        return "eval"
    if isinstance(data.get("rows"), list):
        return "lengths"
    raise ReportError("not an eval summary (fact_f1, dataset), a length sweep (rows) or an early-stopping table")


# -- Table 2 -----------------------------------------------------------------------------------------


def column_key(summary: dict[str, Any]) -> str:
    """The dataset column; "(OOD)" when the checkpoint was trained on another dataset."""
    dataset = str(summary["dataset"])
    trained = summary.get("train_dataset")
    return f"{dataset} (OOD)" if trained and trained != dataset else dataset


def column_title(key: str) -> str:
    base, _, ood = key.partition(" (")
    return DATASET_TITLES.get(base, base) + (f" ({ood}" if ood else "")


def table2(summaries: Sequence[tuple[str, dict[str, Any]]], paper: bool = False, label: str | None = None) -> Report:
    """Our eval summaries (``(file, summary)``) in the paper's Table 2 layout."""
    cells: dict[str, dict[str, dict[str, Any]]] = {}
    sources: dict[tuple[str, str], str] = {}
    rep = Report()
    # An untrained encoder has no training set; like the paper, put it in the column where the
    # table's fine-tuned retrievers are out of distribution, when there is one.
    ood = {column_key(s) for _, s in summaries if s.get("train_dataset")}
    for file, s in summaries:
        name, col = label or method_label(s), column_key(s)
        if not s.get("train_dataset") and f"{col} (OOD)" in ood:
            col = f"{col} (OOD)"
        if (name, col) in sources:
            raise ReportError(
                f"two results for {name!r} on {column_title(col)}: {sources[(name, col)]} and {file}; "
                "give them different 'label' fields"
            )
        sources[(name, col)] = file
        cells.setdefault(name, {})[col] = s
    present = {c for row in cells.values() for c in row}
    columns = [c for c in COLUMN_ORDER if c in present] + sorted(present - set(COLUMN_ORDER))
    header = (
        ["Method"]
        + [f"{column_title(c)} {METRIC_TITLES[m]}" for c in columns for m in METRICS]
        + ["Avg Ans F1", "Avg Ans EM"]
    )
    rows = []
    for name, by_col in cells.items():
        values = [
            with_interval(by_col.get(c, {}).get(m), by_col.get(c, {}).get(f"{m}_ci")) for c in columns for m in METRICS
        ]
        rows.append(
            [name, *values, *_avg_answers([[by_col.get(c, {}).get(m) for c in columns] for m in ("ans_f1", "ans_em")])]
        )
    if paper:
        for name, by_col in PAPER_TABLE2.items():
            if not any(c in by_col for c in columns):
                continue
            values = [by_col[c][i] if c in by_col else None for c in columns for i in range(4)]
            avgs = _avg_answers([[by_col[c][i] if c in by_col else None for c in columns] for i in (2, 3)])
            rows.append([f"{name} (paper)", *values, *avgs])
    rep.markdown += ["## Fact and answer scores (paper Table 2 layout)", ""] + md_table(header, rows) + [""]
    for name, by_col in cells.items():
        for col in columns:
            if col in by_col:
                s = by_col[col]
                reader = s.get("reader_model") or "no reader (retrieval only)"
                extra = f", {s['answer_errors']} answer errors" if s.get("answer_errors") else ""
                if s.get("num_seeds"):
                    extra += (
                        f", mean of {s['num_seeds']} training seeds with 95% intervals "
                        f"({(s.get('interval') or {}).get('method', 'bootstrap')})"
                    )
                rep.notes.append(
                    f"{name}, {column_title(col)}: {s.get('num_samples')} questions ({s.get('split', '?')} split), "
                    f"T = {(s.get('search') or {}).get('max_steps', '?')}, reader {reader}{extra}; "
                    f"checkpoint {s.get('checkpoint', '?')} ({sources[(name, col)]})"
                )
    if paper:
        rep.notes.append(
            f"(paper) rows: Table 2 and the appendix table of the Q-RAG paper (retrievers fine-tuned on HotPotQA; "
            f"Q-RAG, Plan Q-RAG and Beam Retriever answer with {PAPER_READER}; '–' = not reported)."
        )
    return rep


def _avg_answers(per_metric: Sequence[Sequence[float | None]]) -> list[float | None]:
    """Mean over the dataset columns, only where every column has a value (as the paper's Avg)."""
    out = []
    for values in per_metric:
        out.append(sum(values) / len(values) if values and all(v is not None for v in values) else None)
    return out


# -- length sweeps -----------------------------------------------------------------------------------


Series = dict[str, dict[str, dict[int, float]]]  # metric -> row label -> length -> value
Intervals = dict[str, dict[str, dict[int, list[float]]]]  # metric -> row label -> length -> [low, high]


def length_tables(data: dict[str, Any], name: str) -> tuple[Report, Series, Intervals]:
    """Tables (rows: task, or task and model when the sweep compares several; columns: lengths)
    for each metric the rows carry: Fact F1/EM and any answer score; with their 95% intervals
    when the sweep was combined over seeds."""
    rows = data["rows"]
    models = list(dict.fromkeys(str(r.get("model", "")) for r in rows if isinstance(r, dict)))
    series: Series = {}
    intervals: Intervals = {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or "task" not in row or "length" not in row:
            raise ReportError(f"{name}: rows[{i}] needs 'task' and 'length'")
        label = str(row["task"]) if len(models) <= 1 else f"{row['task']} · {row.get('model', '')}"
        for key in (
            "fact_em",
            "fact_f1",
            "oracle_fact_f1",
            "threshold_fact_f1",
            "ans_f1",
            "ans_em",
            "ans_acc",
            "accuracy",
        ):
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(key, {}).setdefault(label, {})[int(row["length"])] = float(value)
                if row.get(f"{key}_ci"):
                    intervals.setdefault(key, {}).setdefault(label, {})[int(row["length"])] = list(row[f"{key}_ci"])
    if not series:
        raise ReportError(f"{name}: the rows hold no fact_f1 / fact_em / answer metric")
    rep = Report()
    for metric, by_label in series.items():
        lengths = sorted({n for vals in by_label.values() for n in vals})
        header = ["Task"] + [length_label(n) for n in lengths]
        cis = intervals.get(metric, {})
        body = [
            [label, *(with_interval(vals.get(n), cis.get(label, {}).get(n)) for n in lengths)]
            for label, vals in sorted(by_label.items())
        ]
        for model in models:
            members = [
                v
                for label, v in by_label.items()
                if (len(models) <= 1 or label.endswith(f" · {model}")) and not label.startswith("mean")
            ]
            # A table combined over seeds has its own mean rows (with intervals); no second one.
            if len(members) > 1 and not any(label.startswith("mean") for label in by_label):
                body.append(
                    [
                        f"mean · {model}" if len(models) > 1 else "mean",
                        *(_mean([v.get(n) for v in members]) for n in lengths),
                    ]
                )
        steps = sorted({r.get("steps") for r in rows if isinstance(r, dict) and r.get("steps") is not None})
        credit = sorted({str(r.get("credit", data.get("credit", "chunk"))) for r in rows if isinstance(r, dict)})
        note = (
            [
                f"Protocol: {PROTOCOL_NOTES[metric]}; T = {', '.join(map(str, steps)) or '?'}; "
                f"credit: {', '.join(credit)}.",
                "",
            ]
            if metric in PROTOCOL_NOTES
            else []
        )
        rep.markdown += (
            [f"## {METRIC_TITLES.get(metric, metric)} by context length ({name})", ""]
            + md_table(header, body)
            + [""]
            + note
        )
    if intervals:
        seeds = sorted({r.get("num_seeds", 1) for r in rows if isinstance(r, dict)})
        rep.notes.append(
            f"{name}: means over {', '.join(map(str, seeds))} training seed(s) per row; [low, high] = 95% interval, "
            f"{(data.get('interval') or {}).get('method', 'bootstrap over seeds, then questions')}."
        )
    rep.markdown += differences_table(data.get("differences") or [], name)
    return rep, series, intervals


def differences_table(differences: Sequence[dict[str, Any]], name: str) -> list[str]:
    """Each compared pair: the difference, its 95% interval and what it allows one to say; one table per
    metric compared (Fact EM, and a learned stop's Fact F1 where the rows carry one)."""
    by_metric: dict[str, list[dict[str, Any]]] = {}
    for d in differences:
        by_metric.setdefault(d.get("metric", "fact_em"), []).append(d)
    out: list[str] = []
    for metric, of_metric in by_metric.items():
        # A length sweep's pairs are per task and length; eval summaries' (one split) are not.
        where = "task" in of_metric[0]
        header = (["Task", "Length"] if where else []) + ["A", "B", "A − B", "95% interval", "called"]
        body = [
            ([d["task"], length_label(d["length"])] if where else [])
            + [d["a"], d["b"], f"{d['difference']:+.3f}", f"[{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]", d["called"]]
            for d in of_metric
        ]
        title = METRIC_TITLES.get(metric, metric)
        out += [f"## Differences in {title} ({name}): a difference only where the interval excludes 0", ""]
        out += md_table(header, body) + [""]
    return out


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if len(vals) == len(values) and vals else None


# -- early stopping ----------------------------------------------------------------------------------


def early_stopping_table(data: dict[str, Any], name: str) -> Report:
    rep = Report()
    header = [
        "Q threshold",
        "stopped early",
        "stopped late",
        "perfect stop",
        "TPR",
        "FPR",
        "Episode len",
        "Fact EM",
        "Fact F1",
    ]
    keys = ["threshold", "early", "late", "perfect", "tpr", "fpr", "episode_len", "fact_em", "fact_f1"]
    if any("ans_em" in r for r in data["rows"]):
        header += ["Ans EM", "Ans F1"]
        keys += ["ans_em", "ans_f1"]
    rows = [[r.get(k) for k in keys] for r in data["rows"]]
    o = data.get("oracle") or {}
    rows.append(
        [
            "oracle",
            None,
            None,
            None,
            o.get("tpr"),
            o.get("fpr"),
            o.get("episode_len"),
            o.get("fact_em"),
            o.get("fact_f1"),
        ]
        + [None] * (len(keys) - 9)
    )
    rep.markdown += [f"## Early stopping on the Q threshold ({name})", ""] + md_table(header, rows) + [""]
    auc = data.get("auc")
    rep.notes.append(
        f"Early stopping ({name}): {data.get('episodes')} episodes of up to {data.get('max_steps')} steps, "
        f"{data.get('collected_gold')} of them collect every gold chunk (early/late/perfect shares are over those); "
        f"ROC AUC of Q as a stop signal {fmt(auc)}."
    )
    return rep


# -- plots ---------------------------------------------------------------------------------------------


def _save(plt, fig, title: str, path: Path) -> Path:
    """Title, layout, PNG at ``path``; the figure is closed (a report draws many)."""
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        return None


def plot_lengths(series: Series, path: Path, title: str, intervals: Intervals | None = None) -> Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    metrics = list(series)
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.8), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for task, vals in sorted(series[metric].items()):
            xs = sorted(vals)
            ys = [vals[x] for x in xs]
            cis = (intervals or {}).get(metric, {}).get(task, {})
            ax.errorbar(
                xs, ys, yerr=error_bars(ys, [cis.get(x) for x in xs], scale=1.0), marker="o", capsize=3, label=task
            )
        ax.set_xscale("log", base=2)
        ticks = sorted({x for vals in series[metric].values() for x in vals})
        ax.set_xticks(ticks, [length_label(x) for x in ticks])
        ax.minorticks_off()
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(METRIC_TITLES.get(metric, metric))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(plt, fig, title, path)


def plot_early_stopping(data: dict[str, Any], path: Path, title: str) -> Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    rows = data["rows"]
    th = [r["threshold"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    ax = axes[0]
    ax.plot(th, [r["early"] for r in rows], marker="o", label="stopped early")
    ax.plot(th, [r["late"] for r in rows], marker="s", label="stopped late")
    ax.set_title("(a) early and late stops")
    ax.legend(fontsize=8)
    axes[1].plot(th, [r["perfect"] for r in rows], marker="o", color="tab:green")
    axes[1].set_title("(b) perfect stops")
    ax = axes[2]
    ax.plot(th, [r["episode_len"] for r in rows], marker="o", color="tab:purple", label="episode length")
    ax.set_title("(c) episode length and Fact F1")
    ax2 = ax.twinx()
    ax2.plot(th, [r["fact_f1"] for r in rows], marker="^", color="tab:orange", label="Fact F1")
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_ylabel("Fact F1")
    ax.set_ylabel("chunks selected")
    ax.legend(loc="lower left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    for a in axes[:3]:
        a.set_xlabel("Q threshold")
        a.grid(alpha=0.3)
    ax = axes[3]
    pts = sorted((r["fpr"], r["tpr"]) for r in rows if r["fpr"] is not None and r["tpr"] is not None)
    ax.plot(
        [0, *(p[0] for p in pts), 1],
        [0, *(p[1] for p in pts), 1],
        marker="o",
        label=f"Q threshold (AUC {fmt(data.get('auc'), 2)})",
    )
    ax.plot([0, 1], [0, 1], linestyle="--", color="gray", label="random")
    ax.plot([0], [1], marker="*", markersize=14, color="red", linestyle="none", label="oracle")
    ax.set_xlabel("FPR")
    ax.set_ylabel("TPR")
    ax.set_title("(d) ROC of the stopping rule")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    return _save(plt, fig, title, path)


# -- everything ---------------------------------------------------------------------------------------


def build_report(
    files: Sequence[str | Path],
    out_dir: str | Path,
    *,
    paper: bool = False,
    label: str | None = None,
    title: str = "Q-RAG results",
) -> Report:
    """Read result files, write ``report.md`` and PNG plots into ``out_dir``; return the report."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    evals, others, comparisons = [], [], []
    for f in files:
        data = read_result(f)
        try:
            kind = result_kind(data)
        except ReportError as exc:
            raise ReportError(f"{f}: {exc}") from None
        if kind == "methods":  # several methods' seeds combined: each a row, their differences below
            evals += [(str(f), "eval", m) for m in data["methods"]]
            comparisons.append((str(f), data))
        else:
            (evals if kind == "eval" else others).append((str(f), kind, data))
    report = Report(markdown=[f"# {title}", ""])
    parts: list[Report] = []
    if evals:
        parts.append(table2([(f, d) for f, _, d in evals], paper=paper, label=label))
    parts += [
        Report(markdown=differences_table(d["differences"], f"{d['dataset']} {d['split']}, {Path(f).name}"))
        for f, d in comparisons
    ]
    plotting = _pyplot() is not None
    for f, kind, data in others:
        stem = Path(f).name.removesuffix(".json").removesuffix(".early_stopping").removesuffix(".lengths")
        if kind == "lengths":
            part, series, intervals = length_tables(data, stem)
            png = (
                plot_lengths(series, out / f"{stem}.lengths.png", f"Q-RAG by context length: {stem}", intervals)
                if plotting
                else None
            )
        else:
            part = early_stopping_table(data, stem)
            png = (
                plot_early_stopping(data, out / f"{stem}.early_stopping.png", f"Early stopping: {stem}")
                if plotting
                else None
            )
        if png:
            part.markdown += [f"![{stem}]({png.name})", ""]
            part.plots.append(png)
        parts.append(part)
    for part in parts:
        report.markdown += part.markdown
        report.plots += part.plots
        report.notes += part.notes
    if others and not plotting:
        report.notes.append("Plots skipped: matplotlib is not installed (pip install matplotlib).")
    (out / "report.md").write_text(report.text(), encoding="utf-8")
    return report
