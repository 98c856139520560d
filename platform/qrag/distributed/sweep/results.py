"""What a finished sweep leaves behind: a results table (printed and CSV), a plot of the metric
against every swept hyperparameter (PNG) and the best configuration as a training config file.

Both the Ray Tune sweep and the sequential ``--local`` one describe each trial as a
``TrialOutcome``; nothing here needs Ray or MLflow (the plot needs matplotlib).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from qrag.config import to_dict
from qrag.distributed.sweep.spec import Sweep


@dataclass
class TrialOutcome:
    trial_id: str
    params: dict[str, Any]
    status: str  # completed | stopped (by the scheduler) | error | interrupted
    updates: int  # the last update the trial reported
    evals: list[tuple[int, float]] = field(default_factory=list)  # (update, sweep metric) at each evaluation
    dev_fact_f1: float | None = None  # the final evaluation on dev (completed trials only; never used to select)
    run_name: str = ""
    run_dir: str = ""
    mlflow_run_id: str | None = None
    checkpoint: str | None = None
    error: str | None = None

    def score(self, mode: str, scope: str) -> float | None:
        """The trial's value of the sweep metric: its best evaluation or its last one."""
        values = [v for _, v in self.evals if v is not None and not math.isnan(v)]
        if not values:
            return None
        if scope == "last":
            return values[-1]
        return max(values) if mode == "max" else min(values)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TrialOutcome":
        return cls(**{**data, "evals": [tuple(e) for e in data.get("evals", [])]})


def ranked(outcomes: list[TrialOutcome], sweep: Sweep) -> list[TrialOutcome]:
    """Best first; trials without any evaluation last."""
    sign = -1.0 if sweep.mode == "max" else 1.0

    def key(o: TrialOutcome) -> tuple[int, float]:
        s = o.score(sweep.mode, sweep.score_scope)
        return (1, 0.0) if s is None else (0, sign * s)

    return sorted(outcomes, key=key)


def best_outcome(outcomes: list[TrialOutcome], sweep: Sweep) -> TrialOutcome | None:
    """The best completed trial (it ran the whole schedule and has its checkpoint); the best of
    any trial only when none completed."""
    scored = [o for o in ranked(outcomes, sweep) if o.score(sweep.mode, sweep.score_scope) is not None]
    completed = [o for o in scored if o.status == "completed"]
    return (completed or scored or [None])[0]


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "null" if value is None else str(value)


def table_rows(outcomes: list[TrialOutcome], sweep: Sweep) -> list[dict[str, Any]]:
    metric = sweep.metric.split("/")[-1]
    rows = []
    for rank, o in enumerate(ranked(outcomes, sweep), 1):
        last = next((v for _, v in reversed(o.evals)), None)
        rows.append(
            {
                "rank": rank,
                "trial": o.trial_id,
                "status": o.status,
                "updates": o.updates,
                **{key: o.params.get(key) for key in sweep.keys},
                f"{sweep.score_scope}_{metric}": o.score(sweep.mode, sweep.score_scope),
                f"last_{metric}": last,
                "evals": len(o.evals),
                "dev_fact_f1": o.dev_fact_f1,
                "mlflow_run_id": o.mlflow_run_id or "",
                "run_dir": o.run_dir,
            }
        )
    if sweep.score_scope == "last":  # the two columns would be the same
        for row in rows:
            row.pop(f"last_{metric}")
    return rows


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["trial"])
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})


def format_table(rows: list[dict[str, Any]]) -> str:
    """The table as aligned text (long columns such as paths left out)."""
    if not rows:
        return "(no trials)"
    columns = [c for c in rows[0] if c not in ("run_dir", "evals") and any(row[c] not in (None, "") for row in rows)]
    cells = [[_short(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def plot(outcomes: list[TrialOutcome], sweep: Sweep, path: Path) -> Path:
    """The metric against each swept hyperparameter, one panel per key: completed trials as
    dots, stopped ones as crosses, the best as a star."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    best = best_outcome(outcomes, sweep)
    n = len(sweep.dims)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    label = f"{sweep.score_scope} {sweep.metric} (validation)"
    for ax, dim in zip(axes.flat, sweep.dims):
        numeric = all(
            isinstance(o.params.get(dim.key), (int, float)) and not isinstance(o.params.get(dim.key), bool)
            for o in outcomes
        )
        categories = (
            []
            if numeric
            else list(dict.fromkeys(_short(v) for v in dim.values))
            if dim.kind in ("choice", "grid")
            else sorted({_short(o.params.get(dim.key)) for o in outcomes})
        )

        def x_of(o: TrialOutcome) -> float:
            value = o.params.get(dim.key)
            return float(value) if numeric else float(categories.index(_short(value)))

        for status, marker, color in (("completed", "o", "tab:blue"), ("stopped", "x", "tab:red")):
            pts = [(x_of(o), o.score(sweep.mode, sweep.score_scope)) for o in outcomes if o.status == status]
            pts = [(x, y) for x, y in pts if y is not None]
            if pts:
                ax.scatter(*zip(*pts), marker=marker, color=color, label=f"{status} ({len(pts)})", zorder=2)
        if best is not None and best.score(sweep.mode, sweep.score_scope) is not None:
            ax.scatter(
                [x_of(best)],
                [best.score(sweep.mode, sweep.score_scope)],
                marker="*",
                s=220,
                color="gold",
                edgecolors="black",
                label="best",
                zorder=3,
            )
        if numeric and dim.log_scale:
            ax.set_xscale("log")
            # 1-2-5 ticks labelled plainly: a sweep's log range is often less than two decades
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
        if not numeric:
            ax.set_xticks(range(len(categories)), categories)
        ax.set_xlabel(f"{dim.key}  ({dim.kind})")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"sweep {sweep.name}: {len(outcomes)} trials", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_best_config(sweep: Sweep, best: TrialOutcome, path: Path) -> Path:
    """A training config file (``qrag train --config`` / ``jobs/train_*.py --config``) with the
    best trial's values; the header says where they come from."""
    cfg = sweep.best_config(best.params)
    score = best.score(sweep.mode, sweep.score_scope)
    header = [
        f"# Best trial of sweep {sweep.name} ({sweep.source}): trial {best.trial_id}, {best.status}, "
        f"{sweep.score_scope} {sweep.metric} {score:.4f} on the validation split"
        if score is not None
        else f"# Best trial of sweep {sweep.name} ({sweep.source}): trial {best.trial_id}, {best.status}",
        f"# swept: {json.dumps(best.params)}",
    ]
    if best.mlflow_run_id:
        header.append(f"# MLflow run {best.mlflow_run_id}; trial run {best.run_dir}")
    header.append("# Train it: qrag train --config THIS_FILE   or   python jobs/train_hotpot.py --config THIS_FILE")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(header) + "\n" + yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")
    return path


@dataclass
class SweepReport:
    csv: Path
    png: Path | None
    best_yaml: Path | None
    best: TrialOutcome | None
    table: str


def write_report(outcomes: list[TrialOutcome], sweep: Sweep, directory: Path) -> SweepReport:
    """results.csv, <metric>_vs_hparams.png (when matplotlib is installed) and best.yaml in ``directory``."""
    rows = table_rows(outcomes, sweep)
    csv_path = directory / "results.csv"
    write_csv(rows, csv_path)
    png = None
    try:
        png = plot(outcomes, sweep, directory / f"{sweep.metric.split('/')[-1]}_vs_hparams.png")
    except ImportError:
        pass  # e.g. a GPU box with torch only: the CSV has every number
    best = best_outcome(outcomes, sweep)
    best_yaml = write_best_config(sweep, best, directory / "best.yaml") if best is not None else None
    return SweepReport(csv_path, png, best_yaml, best, format_table(rows))
