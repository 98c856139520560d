"""``qrag sweep-lengths``: Fact EM/F1 of checkpoints (and the untrained encoder) on generated
BabiLong / RULER NIAH contexts at a list of lengths -> a JSON table and a PNG plot."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from qrag import progress
from qrag.cli.commands import _config_args, command

DEFAULT_LENGTHS = "1k,4k,16k,32k,128k"


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        action="append",
        required=False,
        metavar="[LABEL=]DIR|none",
        help="a checkpoint directory or 'none' (the untrained encoder, full-vector cosine: multi-step RAG w/o FT; "
        "'none:twin' = its half-vector variant, an extra); repeat to "
        "compare several in one table, e.g. --checkpoint Q-RAG=runs/qa3/final --checkpoint none",
    )
    p.add_argument(
        "--tasks",
        metavar="LIST",
        help="comma-separated: qa1..qa5 and/or RULER NIAH tasks (niah_single_1 or S1, MK2, MV, ...). "
        "Default: the config's data.tasks, else qa1-qa5 (babilong) or all eight NIAH tasks (niah)",
    )
    p.add_argument(
        "--lengths",
        default=DEFAULT_LENGTHS,
        metavar="LIST",
        help=f"context lengths in tokens, e.g. 1k,4k,32k,128k,1m,10m (default {DEFAULT_LENGTHS})",
    )
    p.add_argument(
        "--samples",
        type=int,
        metavar="N",
        help="questions per task and length (default: the frozen dev draw's, 500, and 100 from 10M tokens on; "
        "see qrag/data/dev_draw.py)",
    )
    p.add_argument(
        "--samples-at",
        action="append",
        default=[],
        metavar="LENGTH=N",
        help="another number of questions at some lengths, e.g. --samples-at 10m=20",
    )
    p.add_argument(
        "--split",
        default="dev",
        choices=["train", "val", "dev", "all"],
        help="which split's questions and background (default dev; val = the questions data.val_fraction holds out "
        "of train, in validation books: for choosing settings at long lengths)",
    )
    p.add_argument(
        "--steps",
        default="config",
        metavar="T|config|needles|gold",
        help="retrieval steps T; config (default) = the config's search.max_steps "
        "(4 for BabiLong and RULER, as in the paper); "
        "needles = each RULER NIAH task's number of asked needles (no spare picks: the NIAH headline); "
        "gold = each sample group's number of support facts (reads the answer key: a labelled extra)",
    )
    p.add_argument(
        "--val-samples",
        type=int,
        default=0,
        metavar="N",
        help="also report a learned Q-threshold stop, chosen per model and task on N validation questions "
        "(held-out part of train, data.val_fraction) at the training length (default 0 = off)",
    )
    p.add_argument(
        "--answer",
        metavar="BACKEND",
        choices=["none", "local", "openai"],
        help="also answer each question from its retrieved chunks with a reader LLM (local | openai; answer.* keys) "
        "and score it by the benchmark's rule (RULER: share of needle values found; BabiLong: the label): "
        "ans_em, ans_f1",
    )
    p.add_argument(
        "--allow-train-questions",
        action="store_true",
        help="score questions whose source a checkpoint trained on (refused by default; rows record how many)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument(
        "--no-cache", action="store_true", help="embed every chunk of every context (no reuse of book-chunk embeddings)"
    )
    p.add_argument(
        "--out", default="runs/lengths.json", metavar="FILE.json", help="the table; the plot goes beside it as FILE.png"
    )
    p.add_argument(
        "--plot-only", metavar="TABLE.json", nargs="+", help="re-draw (and merge) existing tables instead of evaluating"
    )
    _config_args(p)


# "none" is the paper's untrained baseline (full-vector cosine); "none:twin" the half-vector extra.
UNTRAINED_LABELS = {"none": "untrained", "none:twin": "untrained (half-vector cosines)"}


def _models(specs: list[str]) -> list[tuple[str, str]]:
    out = []
    for spec in specs:
        label, sep, target = spec.partition("=")
        if not sep:
            if spec in UNTRAINED_LABELS:
                label, target = UNTRAINED_LABELS[spec], spec
            else:
                label, target = Path(spec.rstrip("/")).parent.name or spec, spec
        out.append((label, target))
    return out


@command("sweep-lengths", "evaluate retrievers on generated long contexts (BabiLong, RULER NIAH) at several lengths")(
    _args
)
def cmd_sweep_lengths(args: argparse.Namespace) -> int:
    from qrag.config import ConfigError, load_config
    from qrag.data.dev_draw import questions_at
    from qrag.model.encoder import pick_device
    from qrag.evaluation.lengths import (
        NEEDLES,
        format_table,
        merge_tables,
        parse_length,
        plot_table,
        read_table,
        run_sweep,
        write_table,
    )

    out = Path(args.out)
    if args.plot_only:
        table = merge_tables([read_table(p) for p in args.plot_only])
        write_table(table, out)
    else:
        if not args.checkpoint:
            raise ConfigError("give at least one --checkpoint (a directory or 'none'), or --plot-only")
        cfg = load_config(args.config, args.overrides)
        if args.tasks:
            tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        elif cfg.data.tasks:
            tasks = list(cfg.data.tasks)
        elif cfg.data.dataset == "niah":
            from qrag.data.niah import TASKS

            tasks = list(TASKS)
        else:
            from qrag.data.babilong import DEFAULT_TASKS

            tasks = list(DEFAULT_TASKS)
        lengths = [parse_length(x) for x in args.lengths.split(",") if x.strip()]
        per_length: dict[int, int] = {}
        for spec in args.samples_at:
            length, sep, n = spec.partition("=")
            if not sep or not n.strip().isdigit():
                raise ConfigError(f"bad --samples-at {spec!r}: expected LENGTH=N, e.g. 10m=20")
            per_length[parse_length(length)] = int(n)
        steps = {"config": None, "gold": 0, NEEDLES: NEEDLES}.get(args.steps)
        if steps is None and args.steps != "config":
            steps = int(args.steps)
        answer = None
        if args.answer and args.answer != "none":
            from qrag.evaluation.evaluate import ReaderHook

            answer = ReaderHook(cfg.answer, args.answer)
        table = with_progress(run_sweep)(
            _models(args.checkpoint),
            cfg,
            tasks,
            lengths,
            lambda n: per_length.get(n, args.samples if args.samples is not None else questions_at(n)),
            split=args.split,
            steps=steps,
            device=pick_device(args.device),
            cache=not args.no_cache,
            val_samples=args.val_samples,
            answer=answer,
            allow_train_questions=args.allow_train_questions,
            log=progress.write,
        )
        write_table(table, out)
    png = plot_table(table, out.with_suffix(".png"))
    print(format_table(table))
    print(json.dumps({"table": str(out), "plot": str(png) if png else None, "rows": len(table["rows"])}))
    return 0


def with_progress(run_sweep: Callable[..., dict]) -> Callable[..., dict]:
    """``run_sweep`` under one bar over every question it searches, validation ones included: an
    ETA for the whole sweep (questions at long lengths take longer, so it starts optimistic)."""
    from qrag.retrieval.search import RETRIEVE

    def run(models: list, cfg, tasks: list, lengths: list, samples: Callable[[int], int], **options) -> dict:
        total = len(models) * len(tasks) * (sum(samples(n) for n in lengths) + options.get("val_samples", 0))
        with progress.bar(total, "sweep-lengths", "q", kind=RETRIEVE):
            return run_sweep(models, cfg, tasks, lengths, samples, **options)

    return run
