"""The ``qrag`` command. Every subcommand is thin: parse, configure, call the library."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from collections.abc import Callable
from types import ModuleType

from qrag import progress
from qrag.config import ConfigError, config_keys_epilog

COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def command(name: str, help: str):
    """Register a subcommand: ``configure(parser)`` adds options, the decorated function runs it."""

    def wrap(configure: Callable[[argparse.ArgumentParser], None]):
        def register(run: Callable[[argparse.Namespace], int]):
            COMMANDS[name] = (help, configure, run)
            return run

        return register

    return wrap


def distributed(module: str, needs_ray: bool = True) -> ModuleType:
    """Import ``qrag.distributed.<module>`` when a command needs it; without the ray extra
    installed, a one-line error that says what to install (not a traceback mid-run)."""
    if needs_ray and importlib.util.find_spec("ray") is None:
        raise ConfigError("this command runs on Ray, which is not installed here: pip install 'qrag[ray]'")
    return importlib.import_module(f"qrag.distributed.{module}")


def progress_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a progress bar with an ETA on stderr (default: when stderr is a terminal)",
    )


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="YAML", help="a preset from configs/ (defaults apply to keys it does not set)")
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides, e.g. learner.alpha=0.1 updates=200"
    )


# -- train ---------------------------------------------------------------------------------------


def _train_args(p: argparse.ArgumentParser) -> None:
    from qrag.distributed.options import add_cluster_arguments  # argparse only, no Ray

    _config_args(p)
    p.add_argument("--resume", metavar="DIR", help="continue from a checkpoint directory (same schedule, same result)")
    p.add_argument(
        "--stop-at",
        type=int,
        metavar="UPDATE",
        help="train in slices (e.g. under a job time limit): stop after this update, save a resumable checkpoint "
        "and print it; the next slice passes it to --resume (no evaluation until the last slice)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (metrics are still printed)")
    ray = p.add_argument_group("on Ray (needs the ray extra: pip install 'qrag[ray]')")
    ray.add_argument(
        "--ray",
        action="store_true",
        help="train on Ray, as jobs/train_*.py do: EpisodeFeeder actors feed a Ray Train learner, "
        "MLflow tracks the run; the same run name again resumes it (no --resume or --stop-at)",
    )
    add_cluster_arguments(ray, when="with --ray: ")


@command("train", "train a Q-RAG retriever: on one machine, or on Ray with --ray")(_train_args)
def cmd_train(args: argparse.Namespace) -> int:
    if args.ray:
        return _train_on_ray(args)
    from qrag.config import load_config
    from qrag.rl.train import TrainingRun, print_reporter

    from qrag.integrations.tracking import RunTracker

    cfg = load_config(args.config, args.overrides)
    run = TrainingRun(cfg, resume=args.resume)
    left_out = f" ({run.left_out} without an answer-bearing chunk left out)" if run.left_out else ""
    print(
        f"train: {len(run.train_tok)} train{left_out} / {len(run.dev_tok)} dev questions, device {run.device}, "
        f"{cfg.updates} updates x {cfg.learner.episodes_per_update} episodes",
        file=sys.stderr,
    )
    # The same MLflow logger as the Ray path (distributed.mlflow_uri=none: off), fed by run()'s callbacks.
    tracker = RunTracker.open(cfg, str(run.run_dir.resolve()), resuming=args.resume is not None)
    # With a progress bar the bar shows the metrics; without one they are printed as JSON lines.
    report = print_reporter if args.no_progress else (lambda step, metrics: None)
    try:
        out = run.run(report=tracker.reporter(report), progress=not args.no_progress, stop_at=args.stop_at)
    except BaseException:
        tracker.close("FAILED")
        raise
    if out.get("stopped"):
        tracker.close("KILLED")  # stopped on request; --resume sets the same MLflow run RUNNING again
        stopped = {
            "stopped_at": out["updates"],
            "checkpoint": out["checkpoint"],
            "updates": cfg.updates,
            "resume": f"--resume {out['checkpoint']}",
            "seconds": round(out["seconds"], 1),
            "total_seconds": round(out["total_seconds"], 1),
        }
        if tracker.run_id:
            stopped.update(mlflow_run_id=tracker.run_id, tracking_uri=tracker.uri)
        print(json.dumps(stopped))
        return 0
    tracker.finish(run.run_dir, out["checkpoint"])
    summary = {
        "checkpoint": out["checkpoint"],
        "fact_em": out["eval"]["fact_em"],
        "fact_f1": out["eval"]["fact_f1"],
        "num_samples": out["eval"]["num_samples"],
        "updates": out["updates"],
        "seconds": round(out["seconds"], 1),
        "total_seconds": round(out["total_seconds"], 1),
    }
    if tracker.run_id:
        summary.update(mlflow_run_id=tracker.run_id, tracking_uri=tracker.uri)
    print(json.dumps(summary))
    return 0


def _train_on_ray(args: argparse.Namespace) -> int:
    if args.resume or args.stop_at is not None:
        raise ConfigError(
            "--resume and --stop-at are for training without Ray; with --ray, run the same name again to resume"
        )
    job = distributed("job")
    prog = "qrag train"
    return job.run(lambda: job.make_job(args.config, args.overrides, args.base_dir, args.address, prog), prog)


# -- eval ----------------------------------------------------------------------------------------


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR|none",
        help="a checkpoint directory, or 'none' for the untrained encoder scored by the full-vector cosine of its "
        "pooled embeddings (the paper's multi-step RAG w/o FT); 'none:twin' scores it by the mean of two "
        "half-vector cosines instead (an extra, labelled as such)",
    )
    p.add_argument(
        "--data",
        metavar="PATH",
        help="evaluate on this data file or glob, for any checkpoint (default: the run's data; "
        "a mixed run's sources). For a mixed run, the loader of the source with this path, "
        "else --dataset says which",
    )
    p.add_argument(
        "--dataset",
        metavar="NAME",
        help="evaluate on this loader's data: hotpotqa | musique | 2wiki | jsonl | babilong | niah "
        "(the run's own path, hub and sources are not carried over; its shipped file unless --data)",
    )
    p.add_argument(
        "--split",
        default="dev",
        choices=["train", "dev", "val", "all"],
        help="which split of the data (default dev); val: the validation part of train that training held out "
        "(data.val_fraction), where checkpoints, settings and objectives are chosen",
    )
    p.add_argument(
        "--allow-train-questions",
        action="store_true",
        help="score questions whose source the checkpoint trained on "
        "(refused by default; the summary records how many)",
    )
    p.add_argument("--limit", type=int, metavar="N", help="evaluate the first N questions of the split")
    p.add_argument("--steps", type=int, metavar="T", help="retrieval steps (default: the run's search.max_steps)")
    p.add_argument("--beam", type=int, metavar="B", help="beam width; 1 = greedy (default 1)")
    p.add_argument("--stop-threshold", type=float, metavar="Q", help="stop when the best Q falls below Q")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument(
        "--label",
        metavar="NAME",
        help="the method's name in the summary, in qrag report's tables and for qrag combine-seeds, which "
        "combines each name's seeds and compares the names (e.g. 'w/o target'; default: Q-RAG, or the "
        "untrained baseline's name)",
    )
    p.add_argument("--out", metavar="FILE.json", help="write the summary here (records go to FILE.records.jsonl)")
    p.add_argument(
        "--answer",
        metavar="BACKEND",
        choices=["none", "local", "openai"],
        help="also answer with a reader LLM: local (SmolLM2-135M, offline) | openai (answer.base_url, answer.model) "
        "| none; adds ans_em/ans_f1 (default: answer.backend)",
    )
    _config_args(p)


@command("eval", "evaluate a checkpoint (or the untrained encoder) on a dataset split")(_eval_args)
def cmd_eval(args: argparse.Namespace) -> int:
    from qrag.config import load_config
    from qrag.evaluation.evaluate import evaluate_checkpoint

    overrides = list(args.overrides)
    for key, value in (
        ("search.max_steps", args.steps),
        ("search.beam_width", args.beam),
        ("search.stop_threshold", args.stop_threshold),
    ):
        if value is not None:
            overrides.append(f"{key}={value}")
    cfg = (
        load_config(args.config, overrides, check=False)
        if args.config or args.checkpoint in ("none", "none:twin")
        else None
    )
    summary = evaluate_checkpoint(
        args.checkpoint,
        cfg,
        overrides,
        split=args.split,
        limit=args.limit,
        device=args.device,
        out=args.out,
        answer=args.answer,
        data=args.data,
        dataset=args.dataset,
        allow_train_questions=args.allow_train_questions,
        label=args.label,
    )
    print(json.dumps({k: v for k, v in summary.items() if k not in ("search", "answer", "answer_error_ids")}, indent=2))
    return 0


# -- entry point ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    _load_extra_commands()
    parser = argparse.ArgumentParser(prog="qrag", description="Q-RAG multi-step retrievers: train, evaluate, serve.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, configure, _) in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=config_keys_epilog() if name in ("train", "eval") else None,
        )
        configure(p)
        if name in ("eval", "sweep-lengths"):
            progress_option(p)
    return parser


def _load_extra_commands() -> None:
    """Subcommands that live in their own modules of this package (serve, report, ...) register
    themselves with :func:`command` on import."""
    import pkgutil

    package = importlib.import_module(__package__)
    for info in pkgutil.iter_modules(package.__path__):
        if info.name != "commands":
            importlib.import_module(f"{__package__}.{info.name}")


def main(argv: list[str] | None = None) -> int:
    from qrag.model.checkpoint import CheckpointError
    from qrag.data.sample import DataError
    from qrag.model.encoder import ModelPathError

    parser = build_parser()
    # argparse stops collecting positionals after an option; accept key=value overrides anywhere.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(a.startswith("-") or "=" not in a for a in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    if hasattr(args, "progress"):
        progress.configure(args.progress)
    try:
        return COMMANDS[args.command][2](args)
    except (ConfigError, DataError, ModelPathError, CheckpointError, FileNotFoundError) as exc:
        print(f"qrag {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
