"""``qrag learned-stop``: a stop chosen on one evaluation's records, applied to another's."""

from __future__ import annotations

import argparse
import json

from qrag.cli.commands import command


def _args(p: argparse.ArgumentParser) -> None:
    from qrag.evaluation.early_stopping import STOP_RULES

    p.add_argument(
        "val", metavar="VAL.json", help="where the stop is chosen: qrag eval --out of questions not reported"
    )
    p.add_argument("results", metavar="RESULT.json", help="what it is applied to: the same checkpoint's reported split")
    p.add_argument(
        "--rule",
        choices=STOP_RULES,
        default="threshold",
        help="threshold: stop at the first pick whose Q falls below the threshold with the best val Fact F1 (the "
        "paper's); budget: the number of steps with the best val Fact F1; best: whichever of the two scores higher on "
        "val (ties: budget)",
    )
    p.add_argument("--out", required=True, metavar="FILE.json", help="RESULT's summary and records with the stop's")


@command("learned-stop", "score a full-length greedy evaluation under a stop chosen on another one's questions")(_args)
def cmd_learned_stop(args: argparse.Namespace) -> int:
    from qrag.evaluation.learned_stop import apply_learned_stop

    s = apply_learned_stop(args.val, args.results, args.rule, args.out)
    keys = (
        "stop_rule",
        "threshold",
        "budget",
        "threshold_val_fact_f1",
        "fact_f1",
        "threshold_fact_em",
        "threshold_fact_f1",
    )
    print(json.dumps({k: s[k] for k in keys if k in s}))
    return 0
