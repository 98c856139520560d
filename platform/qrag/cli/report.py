"""``qrag report``: paper-style Markdown tables and PNG plots from result files."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qrag.cli.commands import command


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "results",
        nargs="+",
        metavar="RESULT",
        help='eval summaries (qrag eval --out FILE.json), length sweeps ({"rows": [...]}), early-stopping '
        "tables, or eval records (FILE.records.jsonl, analysed for Q-threshold early stopping)",
    )
    p.add_argument("--out", default="report", metavar="DIR", help="where report.md and the plots go (default ./report)")
    p.add_argument("--paper", action="store_true", help="add the paper's Table 2 rows beside ours")
    p.add_argument(
        "--label",
        metavar="NAME",
        help="method name for every eval summary (default: the summary's 'label', "
        "else Q-RAG / Plan Q-RAG / Multi-step RAG w/o FT)",
    )
    p.add_argument(
        "--early-stopping",
        action="store_true",
        help="also analyse the records beside each eval summary (FILE.records.jsonl; run eval with a large "
        "--steps and no --stop-threshold)",
    )
    p.add_argument("--thresholds", metavar="Q,Q,...", help="Q thresholds for early stopping (default -0.1,0.0,...,1.1)")
    p.add_argument(
        "--seeds",
        action="store_true",
        help="the results are one evaluation per training seed: combine them first (means with 95-percent intervals, "
        "bootstrap over seeds then questions; written to DIR/combined.json, as qrag combine-seeds does)",
    )
    p.add_argument("--title", default="Q-RAG results", help="the report's heading")


def _thresholds(text: str | None) -> list[float] | None:
    if not text:
        return None
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--thresholds: expected comma-separated numbers, got {text!r}") from None


def _records_of(path: Path) -> Path:
    if path.name.endswith(".records.jsonl"):
        return path
    return path.with_suffix(".records.jsonl")


def _early_stopping_file(records: Path, out: Path, thresholds: list[float] | None) -> Path:
    from qrag.data.paths import read_jsonl
    from qrag.evaluation.early_stopping import analyse

    if not records.is_file():
        raise ValueError(f"{records}: no such records file (qrag eval --out FILE.json writes FILE.records.jsonl)")
    try:
        table = analyse([rec for _, rec in read_jsonl(records)], thresholds)
    except ValueError as exc:
        raise ValueError(f"{records}: {exc}") from None
    table["source"] = str(records)
    target = out / (records.name.removesuffix(".records.jsonl") + ".early_stopping.json")
    target.write_text(json.dumps(table, indent=2) + "\n")
    return target


@command("report", "render paper-style tables (Markdown) and plots (PNG) from eval / length-sweep results")(
    _report_args
)
def cmd_report(args: argparse.Namespace) -> int:
    from qrag.evaluation.report import ReportError, build_report

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    try:
        thresholds = _thresholds(args.thresholds)
        if args.seeds:
            from qrag.evaluation.seeds import combine_files
            from qrag.integrations.provenance import write_json

            args.results = [str(write_json(out / "combined.json", combine_files(args.results)))]
        for name in args.results:
            path = Path(name)
            if path.name.endswith(".jsonl"):
                files.append(_early_stopping_file(path, out, thresholds))
                continue
            files.append(path)
            if args.early_stopping:
                from qrag.evaluation.report import read_result, result_kind

                if result_kind(read_result(path)) == "eval":
                    files.append(_early_stopping_file(_records_of(path), out, thresholds))
        report = build_report(files, out, paper=args.paper, label=args.label, title=args.title)
    except (ReportError, ValueError) as exc:  # DataError (combining seeds) is a ValueError
        print(f"qrag report: error: {exc}", file=sys.stderr)
        return 2
    print(report.text())
    print(f"report: {out / 'report.md'}" + "".join(f"\nplot: {p}" for p in report.plots), file=sys.stderr)
    return 0
