"""``qrag combine-seeds``: one headline file (means, 95% intervals) from several training seeds'
result files."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qrag.cli.commands import command


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "results",
        nargs="+",
        metavar="RESULT.json",
        help="one file per training seed: length sweeps (qrag sweep-lengths, bench/longctx.py) or eval summaries "
        "(qrag eval --out, with their .records.jsonl); a model found in one file only (e.g. the untrained "
        "encoder) is one seed. Eval summaries of several methods (qrag eval --label) give a methods file: each "
        "method's seeds combined, and every pair's difference in Fact EM with its interval",
    )
    p.add_argument(
        "--out", required=True, metavar="FILE.json", help="the combined file (a length sweep also gets FILE.png)"
    )
    p.add_argument("--replicates", type=int, default=2000, metavar="N", help="bootstrap replicates (default 2000)")


@command(
    "combine-seeds",
    "combine several training seeds' result files into means with 95-percent intervals "
    "(bootstrap over seeds, then questions)",
)(_args)
def cmd_combine_seeds(args: argparse.Namespace) -> int:
    from qrag.evaluation.lengths import format_table, plot_table
    from qrag.evaluation.seeds import combine_files
    from qrag.integrations.provenance import write_json

    if len(args.results) < 3:
        print(
            f"qrag combine-seeds: warning: {len(args.results)} file(s); "
            "a headline figure needs at least 3 training seeds",
            file=sys.stderr,
        )
    combined = combine_files(args.results, replicates=args.replicates)
    out = write_json(args.out, combined)
    if isinstance(combined.get("rows"), list):
        png = plot_table(combined, Path(out).with_suffix(".png"))
        print(format_table(combined))
        for d in combined.get("differences", []):
            print(f"{d['task']} {d['length']}: {_difference_line(d)}")
        print(json.dumps({"combined": str(out), "plot": str(png) if png else None, "rows": len(combined["rows"])}))
    else:
        shown = (
            *("fact_em", "fact_em_ci", "fact_f1", "fact_f1_ci", "threshold_fact_f1", "threshold_fact_f1_ci"),
            *("num_seeds", "num_samples"),
        )
        for method in combined.get("methods", [combined]):
            print(json.dumps({"method": method.get("label"), **{k: v for k, v in method.items() if k in shown}}))
        for d in combined.get("differences", []):
            print(_difference_line(d))
    return 0


def _difference_line(d: dict) -> str:
    return (
        f"{d.get('metric', 'fact_em')}: {d['a']} - {d['b']} = {100 * d['difference']:+.1f} "
        f"[{100 * d['ci'][0]:+.1f}, {100 * d['ci'][1]:+.1f}]: {d['called']}"
    )
