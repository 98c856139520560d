"""Validation scores of seeded runs, read back from their training logs (bench/hotpot_seeds.sh's
``<tag>seed<S>.log``): per row, each seed's keep_best score (its first best periodic Fact F1 on the
validation part of train, and the Fact EM of that evaluation), the row's mean with a 95% interval,
and every pair of rows' difference. This is what choosing a preset's objective on validation reads.

A log keeps only each evaluation's means, so the intervals resample seeds and not validation
questions; the per-question val files of bench/hotpot_seeds.sh (``val_headline.json``) have both.

    python bench/val_from_logs.py DIR --out val_choice.json   # DIR: the unpacked hotpot_seeds_files.tgz
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from qrag.evaluation.seeds import pairwise_differences
from qrag.evaluation.intervals import REPLICATES, bootstrap_interval

LOG_NAME = re.compile(r"^(?P<tag>.*?)seed(?P<seed>\d+)\.log$")


def keep_best(log: Path) -> dict[str, Any] | None:
    """keep_best's pick from a log's metric lines (a resumed run repeats updates: same rule, first best)."""
    best: dict[str, Any] | None = None
    for number, line in enumerate(log.read_text().splitlines(), 1):
        if not line.startswith('{"update"'):
            continue
        try:
            metrics = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{log}:{number}: not a JSON metrics line ({exc})") from exc
        if "eval/fact_f1" in metrics and (best is None or metrics["eval/fact_f1"] > best["fact_f1"]):
            best = {"update": metrics["update"], "fact_f1": metrics["eval/fact_f1"], "fact_em": metrics["eval/fact_em"]}
    return best


def row_label(folder: Path, tag: str, seed: str) -> str:
    """The row's name as its dev summary gives it (``--label``), else the log's tag."""
    summary = folder / f"hotpot_{tag}s{seed}.json"
    if summary.is_file():
        label = json.loads(summary.read_text()).get("label")
        if label:
            return label
    return tag.rstrip("-") or "preset"


def collect(folder: Path) -> dict[str, dict[int, dict[str, Any]]]:
    rows: dict[str, dict[int, dict[str, Any]]] = {}
    for log in sorted(folder.glob("*seed*.log")):
        match = LOG_NAME.match(log.name)
        if not match:
            continue
        best = keep_best(log)
        if best is None:
            raise ValueError(f"{log}: no periodic evaluation (eval/fact_f1) in it")
        rows.setdefault(row_label(folder, match["tag"], match["seed"]), {})[int(match["seed"])] = best
    if not rows:
        raise ValueError(f"{folder}: no <tag>seed<S>.log files")
    return rows


def summarise(rows: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    by_seed = {name: [[seeds[s]["fact_em"]] for s in sorted(seeds)] for name, seeds in rows.items()}
    table = []
    for name, seeds in rows.items():
        entry: dict[str, Any] = {"label": name, "seeds": {str(s): seeds[s] for s in sorted(seeds)}}
        for metric in ("fact_em", "fact_f1"):
            iv = bootstrap_interval([[seeds[s][metric]] for s in sorted(seeds)])
            entry[metric], entry[f"{metric}_ci"] = iv.mean, [iv.low, iv.high]
        table.append(entry)
    return {
        "split": "validation part of train (keep_best's periodic evaluations, read from the training logs)",
        "interval": "95%, bootstrap over training seeds only (the logs keep no per-question scores)",
        "methods": table,
        "differences": pairwise_differences(by_seed, REPLICATES),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="the folder holding the runs' logs and dev summaries")
    parser.add_argument("--out", type=Path, help="write the summary here (JSON)")
    args = parser.parse_args(argv)
    try:
        summary = summarise(collect(args.folder))
    except ValueError as exc:
        print(f"val_from_logs: error: {exc}", file=sys.stderr)
        return 2
    for m in summary["methods"]:
        lo, hi = m["fact_em_ci"]
        print(f"{m['label']:>16}  val Fact EM {m['fact_em']:.3f} [{lo:.3f}, {hi:.3f}]  seeds {len(m['seeds'])}")
    for d in summary["differences"]:
        print(f"{d['a']} - {d['b']} = {d['difference']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]: {d['called']}")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
