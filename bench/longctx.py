"""Long-context benchmark (issue 6): train on <= 4K-token contexts, evaluate up to 10M tokens.

For each task (qa2, qa3: BabiLong; niah: the mix of the eight RULER NIAH tasks) it
  (a) trains Q-RAG (relative positions, T = 4) on 2K-token contexts for ``--minutes`` minutes
      (the number of updates is set from the measured speed so the schedule completes);
  (b) evaluates the trained checkpoint and the untrained encoder (multi-step RAG w/o FT) at
      1K, 4K, 32K, 128K, 1M (and 10M on ``--questions-10m`` questions for BabiLong), with T =
      search.max_steps (4, as the paper);
and writes bench/results/longctx_<task>.json (+ .png when matplotlib is there) and prints one
JSON line. Needs only torch, transformers, numpy, pyyaml, tqdm, safetensors (no Ray/MLflow/FAISS).

On a GPU machine, from the repository root (one call per task keeps each under 10 minutes):

    python bench/longctx.py --pack-assets .carry/longctx            # once, here: fp16 encoder + data subset
    PYTHONPATH=platform python bench/longctx.py --assets .carry/longctx --task qa3 --minutes 5
    python bench/longctx.py --merge bench/results/longctx_*.json     # here: one table + plot

A run longer than one call is cut into slices (``--updates`` fixes the whole schedule; the
checkpoints stay under ``--runs``), and the reported checkpoint can be chosen on the val split at
a long length rather than at the training length:

    ... --task qa3 --updates 1500 --stop-at 750 checkpoint_every=250          # slice 1
    ... --task qa3 --updates 1500 --resume --select-lengths 1m checkpoint_every=250   # slice 2, then choose, then dev

Headline figures come from several training seeds (``--seed N``: the run, its files and its
training data are the seed's; dev is the frozen draw of qrag/data/dev_draw.py whatever the seed),
each trained (``--no-eval`` on the last slice), then chosen and evaluated (``--eval-only``), the
untrained encoder once (``--baseline-only``), and combined with ``qrag combine-seeds``
(docs/long-contexts.md, "Re-running the headline rows"). NIAH rows are per task with T = the
task's number of asked needles; ``--answer local`` adds a reader's answer scores beside them.

Without ``--assets`` the bundled MiniLM and ../shared/data are used (``--encoder``, ``--babi``,
``--novels``, ``--essays`` override each).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_common import machine_info  # noqa: E402
from qrag.data.dev_draw import QUESTIONS, QUESTIONS_LONG  # noqa: E402
from qrag.index.store import write_atomic  # noqa: E402
from qrag.integrations.provenance import git_state  # noqa: E402

PRESETS = {
    "qa1": "babilong-qa1.yaml",
    "qa2": "babilong-qa2.yaml",
    "qa3": "babilong-qa3.yaml",
    "qa4": "babilong-qa4.yaml",
    "qa5": "babilong-qa5.yaml",
    "niah": "niah.yaml",
}
BABILONG_LENGTHS = "1k,4k,32k,128k,1m,10m"
NIAH_LENGTHS = "4k,32k,128k,1m"
# What --pack-assets copies (sizes stored): bAbI qa1-qa5 (<1 MB), training books that hold the
# 2M-token training haystack, validation books (held out of training: a 1M-token validation context),
# evaluation books (a 10M-token context wraps around them).
PACK_TRAIN_BOOKS = 4
PACK_DEV_BOOKS = 10
PACK_VAL_BOOKS = 5  # validation background: the train collection's books that training never reads (~1.5M tokens)
# What a length row keeps where a result lists per-length scores (sweep_model's rows have more).
ROW_KEYS = (
    "task",
    "length",
    "fact_em",
    "fact_f1",
    "oracle_fact_em",
    "oracle_fact_f1",
    "num_samples",
    "steps",
    "credit",
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--task", default="qa3", help="qa1..qa5 or niah, comma-separated for several in one call (default qa3)"
    )
    p.add_argument("--minutes", type=float, default=5.0, help="training time per task (default 5)")
    p.add_argument(
        "--updates",
        type=int,
        default=None,
        help="train exactly this many updates instead of filling --minutes (the first updates are slow, so a "
        "time budget undercounts; fixed counts also make runs comparable)",
    )
    p.add_argument("--assets", metavar="DIR", help="a folder made by --pack-assets (encoder/, babi/, novels/, essays/)")
    p.add_argument("--encoder", help="encoder directory (default: assets/encoder, else the bundled MiniLM)")
    p.add_argument("--babi", help="bAbI v1.2 folder with en/ and en-10k/")
    p.add_argument("--novels", help="background books (a folder with train/ and dev/, or gutenberg_novels)")
    p.add_argument("--essays", help="PaulGrahamEssays.json[.gz]")
    p.add_argument("--lengths", help=f"evaluation lengths (default {BABILONG_LENGTHS}; NIAH {NIAH_LENGTHS})")
    p.add_argument(
        "--questions",
        type=int,
        default=QUESTIONS,
        help=f"BabiLong dev questions per length (default {QUESTIONS}: the frozen dev draw, qrag/data/dev_draw.py)",
    )
    p.add_argument(
        "--questions-10m",
        type=int,
        default=QUESTIONS_LONG,
        help=f"BabiLong dev questions at 10M tokens (default {QUESTIONS_LONG}: the frozen dev draw)",
    )
    p.add_argument("--niah-questions", type=int, default=25, help="questions per NIAH task and length (default 25)")
    p.add_argument("--train-tokens", type=int, default=2048, help="training context length (default 2048)")
    p.add_argument(
        "--stop-at",
        type=int,
        default=None,
        metavar="UPDATE",
        help="one slice of a longer run: train up to this update, save a resumable checkpoint under --runs and "
        "exit without evaluating; the next call passes --resume (needs --updates: the whole schedule)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="go on from the latest checkpoint under --runs/<task> (same --updates, --train-tokens and overrides)",
    )
    p.add_argument(
        "--select-lengths",
        default="",
        help="choose the reported checkpoint on the val split at these lengths (e.g. 1m): held-out bAbI train "
        "questions in validation books, T = search.max_steps. Candidates: the periodic checkpoints "
        "(checkpoint_every=N), keep_best's and the final weights; dev is evaluated once, with the chosen one",
    )
    p.add_argument(
        "--select-questions", type=int, default=100, help="validation questions per length with --select-lengths"
    )
    p.add_argument(
        "--val-questions",
        type=int,
        default=100,
        help="validation questions (held out of train) that choose the learned Q-threshold stop (default 100; 0 = off)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="training seed: seed=N and data.seed=N (init, data order, actions, generated training contexts); the run "
        "is <task>-seed<N> under --runs and its result longctx_<task>_seed<N>.json (dev: the frozen draw whatever N)",
    )
    p.add_argument(
        "--label",
        default=DEFAULT_LABEL,
        help="the trained model's name in the rows (a variant of the preset, e.g. 'w/o target' with "
        "learner.use_target=false); another label than the default also names the run <task>-<label>-seed<N> and "
        "its result longctx_<task>_<label>_seed<N>.json (label in letters, digits and '-'), so variants' seeds "
        "combine into one table with qrag combine-seeds",
    )
    p.add_argument(
        "--no-eval",
        action="store_true",
        help="train to the end and stop: no selection, no dev evaluation (--eval-only does them)",
    )
    p.add_argument(
        "--eval-only",
        action="store_true",
        help="no training: choose (--select-lengths) and evaluate the finished run under --runs "
        "(trained with --no-eval)",
    )
    p.add_argument(
        "--baseline-only",
        action="store_true",
        help="no training: evaluate only the untrained encoder (longctx_<task>_untrained.json)",
    )
    p.add_argument(
        "--answer",
        choices=("none", "local", "openai"),
        default="none",
        help="also answer every dev question from its retrieved chunks with a reader LLM and score it by the "
        "benchmark's rule (RULER: share of needle values found; BabiLong: the label): ans_em, ans_f1 beside the rows",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="results folder")
    p.add_argument("--runs", default=str(ROOT / "runs" / "bench-longctx"), help="checkpoints folder")
    p.add_argument("--no-baseline", action="store_true", help="skip the untrained encoder")
    p.add_argument("--pack-assets", metavar="DIR", help="write the fp16 encoder and a data subset to DIR, then exit")
    p.add_argument(
        "--pack-encoder", default="minilm", help="with --pack-assets: the encoder (minilm, mpnet, a directory)"
    )
    p.add_argument(
        "--generation-only",
        action="store_true",
        help="only time generating + tokenising one BabiLong sample per length (CPU; peak RSS), then exit",
    )
    p.add_argument(
        "--merge", nargs="+", metavar="JSON", help="merge result files into longctx_all.json (+ .png), then exit"
    )
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides for training, e.g. learner.lr=3e-5"
    )
    # Intermixed: options may follow the key=value overrides (bench/longctx_seeds.sh appends both).
    return p.parse_intermixed_args(argv)


# -- assets -------------------------------------------------------------------------------------


def pack_assets(dest: Path, encoder: str = "minilm") -> dict:
    """The encoder in fp16 (it loads back as fp32) and the data the benchmark reads."""
    from bench_common import pack_encoder
    from qrag.data.babi import default_dir
    from qrag.data.babilong import default_background
    from qrag.data.haystack import split_files
    from qrag.data.niah import default_essays

    dest.mkdir(parents=True, exist_ok=True)
    pack_encoder(dest / "encoder", encoder)
    for variant in ("en", "en-10k"):
        (dest / "babi" / variant).mkdir(parents=True, exist_ok=True)
        for f in sorted((default_dir() / variant).glob("qa[1-5]_*")):
            shutil.copy2(f, dest / "babi" / variant / f.name)
    novels = default_background()
    picks = {
        split: split_files(novels, split)[:count]
        for split, count in (("train", PACK_TRAIN_BOOKS), ("val", PACK_VAL_BOOKS), ("dev", PACK_DEV_BOOKS))
    }
    for split, files in picks.items():
        (dest / "novels" / split).mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copy2(f, dest / "novels" / split / f.name)
    (dest / "essays").mkdir(exist_ok=True)
    shutil.copy2(default_essays(), dest / "essays" / default_essays().name)
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    return {"assets": str(dest), "megabytes": round(size / 2**20, 1)}


def resolve_paths(args: argparse.Namespace) -> dict[str, str | None]:
    a = Path(args.assets) if args.assets else None
    packed_essays = next(iter(sorted((a / "essays").glob("*.json*"))), None) if a else None
    essays = args.essays or (str(packed_essays) if packed_essays else None)
    return {
        "encoder": args.encoder or (str(a / "encoder") if a else "minilm"),
        "babi": args.babi or (str(a / "babi") if a else None),
        "novels": args.novels or (str(a / "novels") if a else None),
        "essays": essays,
    }


# -- training -----------------------------------------------------------------------------------


DEFAULT_LABEL = "Q-RAG"


def label_slug(label: str) -> str:
    """A variant's label as a file and run name part: 'w/o soft-Q' -> 'w-o-soft-q'."""
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-") or "variant"


def run_stem(task: str, args: argparse.Namespace) -> str:
    """<task>, <task>-<label> for a variant: the run folder's and the result file's common part."""
    return task if args.label == DEFAULT_LABEL else f"{task}-{label_slug(args.label)}"


def run_name(task: str, args: argparse.Namespace) -> str:
    return run_stem(task, args) if args.seed is None else f"{run_stem(task, args)}-seed{args.seed}"


def run_config(task: str, args: argparse.Namespace, paths: dict):
    """The run's config: the task's preset, this bench's settings, then the command line's overrides."""
    from qrag.config import load_config

    overrides = [
        f"model.encoder={paths['encoder']}",
        f"out_dir={args.runs}",
        f"name={run_name(task, args)}",
        f"data.context_tokens={args.train_tokens}",
        "checkpoint_every=0",
        "eval_every=0",
    ]
    if args.seed is not None:
        overrides += [f"seed={args.seed}", f"data.seed={args.seed}"]
    overrides += list(args.overrides)
    if args.updates:
        overrides.append(f"updates={args.updates}")
    if task == "niah":
        overrides += [f"data.path={paths['essays']}"] if paths["essays"] else []
    else:
        overrides += [f"data.path={paths['novels']}"] if paths["novels"] else []
        overrides += [f"data.facts_path={paths['babi']}"] if paths["babi"] else []
    return load_config(ROOT / "configs" / PRESETS[task], overrides)


def train(task: str, args: argparse.Namespace, paths: dict, device, log) -> tuple[dict, object]:
    """Train for ``args.minutes``: a few timed updates set the total so the schedule completes."""
    from qrag.data.haystack import Measure
    from qrag.evaluation.longcontext import ChunkTokens
    from qrag.rl.train import TrainingRun, latest_checkpoint

    cfg = run_config(task, args, paths)
    run_dir = Path(cfg.out_dir) / cfg.name
    t0 = time.perf_counter()
    resume = latest_checkpoint(run_dir) if args.resume else None
    if args.resume and resume is None:
        raise SystemExit(f"longctx: --resume: no checkpoint under {run_dir}")
    run = TrainingRun(cfg, resume=resume, device=device, load_data=False)
    # Data without re-tokenising: generated samples take their token ids from the measured books.
    if task == "niah":
        from qrag.data.niah import generate_from_config
    else:
        from qrag.data.babilong import generate_from_config
    measure = Measure.from_tokenizer(run.tokenizer)
    tokens = ChunkTokens(run.tokenizer, run.layout, cfg.data.chunk_tokens, cfg.data.question_tokens)
    data_info = attach_data(
        run, generate_from_config(cfg.data, "train", measure), generate_from_config(cfg.data, "dev", measure), tokens
    )
    tokens.clear()
    data_s = time.perf_counter() - t0
    log(f"{task}: {len(run.train_tok)} train / {len(run.dev_tok)} dev samples in {data_s:.0f}s")

    source = run.local_source()
    per_update = None
    if resume is None and not args.updates:  # a time budget: a few timed updates size the schedule
        probe = 6
        for i in range(probe):  # the first update warms up kernels; time the rest
            if i == 1:
                t1 = time.perf_counter()
            run.learner.train_update(source.next_batch())
        per_update = (time.perf_counter() - t1) / (probe - 1)
        # The budget counts from the end of data preparation; 5% is kept for the final dev eval.
        budget = 0.95 * args.minutes * 60 - (time.perf_counter() - t0 - data_s)
        updates = max(probe + 1, probe + int(budget / per_update))
        run.cfg.updates = run.learner.total_updates = updates
        log(f"{task}: {per_update:.2f}s/update -> {updates} updates x {cfg.learner.episodes_per_update} episodes")
    elif resume is not None:
        log(f"{task}: resumed from {resume} at update {run.learner.update} of {cfg.updates}")
    start_update = run.learner.update

    def checkpointed(path: Path, metrics: dict[str, float]) -> None:
        # A call killed at its time limit (SIGTERM from `timeout`) never reaches the record below, and
        # a later call resumes from its last periodic checkpoint: record the slice up to each one. What
        # a killed slice trains after its last checkpoint is lost work, so the time counted is the time
        # up to the checkpoint, the time that produced the updates kept.
        if Path(path) == run.checkpoint_dir(run.learner.update):  # not best/ nor final/: nothing resumes them
            record_slice(run.run_dir, start_update, run.learner.update, time.perf_counter() - t0, data_s)

    out = run.run(source=source, report=lambda step, m: None, on_checkpoint=checkpointed, stop_at=args.stop_at)
    slices = record_slice(run.run_dir, start_update, out["updates"], time.perf_counter() - t0, data_s)
    if out.get("stopped"):
        return {"stopped_at": out["updates"], "checkpoint": out["checkpoint"], "slices": slices}, cfg
    # Over every slice of the run (one slice when it was not cut).
    train_s = sum(sl["seconds"] for sl in slices)
    data_s = sum(sl["data_seconds"] for sl in slices)
    trained, loop_s = slice_speed(slices)
    history = run.history
    last = [h for h in history if "train/return" in h][-5:]
    # The periodic evaluations on the val split at the training length (what keep_best chose from).
    periodic = [
        {"update": h["update"], "fact_em": round(h["eval/fact_em"], 4), "fact_f1": round(h["eval/fact_f1"], 4)}
        for h in history
        if "eval/fact_f1" in h
    ]
    best_update = max(periodic, key=lambda e: e["fact_f1"])["update"] if cfg.keep_best and periodic else None
    return {
        "checkpoint": out["checkpoint"],
        "updates": out["updates"],
        "seconds": round(train_s, 1),
        "data_seconds": round(data_s, 1),
        **({"slices": slices} if len(slices) > 1 else {}),
        # Measured over the whole loop: the probe's first updates run full-length episodes on cold
        # kernels, so its per-update time (kept as probe_seconds_per_update) overstates the cost.
        # Only the slices' own updates and times count (see slice_speed); None when none is known.
        "seconds_per_update": round(loop_s / trained, 3) if trained else None,
        **({"probe_seconds_per_update": round(per_update, 3)} if per_update is not None else {}),
        "episodes_per_s": round(cfg.learner.episodes_per_update * trained / loop_s, 1) if trained else None,
        "episodes_per_update": cfg.learner.episodes_per_update,
        "train_return_last": sum(h["train/return"] for h in last) / max(1, len(last)),
        "dev_fact_f1": out["eval"]["fact_f1"],
        "dev_fact_em": out["eval"]["fact_em"],
        **({"val_by_update": periodic} if periodic else {}),
        **({"keep_best_update": best_update} if best_update else {}),
        "config": {
            "context_tokens": cfg.data.context_tokens,
            "positions": cfg.model.positions,
            "env.max_steps": cfg.env.max_steps,
            "lr": cfg.learner.lr,
            "alpha": cfg.learner.alpha,
            "value_top_k": cfg.learner.value_top_k,
            "credit": cfg.env.credit,
            "samples_per_task": cfg.data.samples_per_task,
            "seed": cfg.seed,
            "data_seed": cfg.data.seed,
            "val_fraction": cfg.data.val_fraction,
            "overrides": list(args.overrides),
        },
        "data": data_info,
        "selected_on": training_selection(task, cfg, args, data_info),
    }, cfg


def training_selection(task: str, cfg, args: argparse.Namespace, data_info: dict) -> str:
    """What the training run itself chose, and on what: generated from its settings."""
    settings = (
        f"settings: the preset configs/{PRESETS[task]} with overrides {list(args.overrides) or 'none'}, "
        "given to this run (it chose none of them)"
    )
    if cfg.keep_best and cfg.eval_every > 0:
        checkpoint = (
            f"checkpoint: the best Fact F1 of the evaluations every {cfg.eval_every} updates on "
            f"{min(cfg.eval_limit or 10**9, data_info['val_samples'])} "
            f"samples of the validation part of train ({data_info['val_sources']} sources held out by "
            f"{'story' if task != 'niah' else 'sample'}, data.val_fraction={cfg.data.val_fraction})"
        )
    else:
        checkpoint = "checkpoint: the final weights, no selection"
    return f"{settings}; {checkpoint}"


def record_slice(run_dir: Path, first: int, last: int, seconds: float, data_seconds: float) -> list[dict]:
    """Append this call's slice (updates first -> last, wall and data seconds) to the run's
    slices.json and return them all: the training time of a run cut into slices."""
    path = run_dir / "slices.json"
    slices = json.loads(path.read_text()) if first > 0 and path.is_file() else []
    slices = [
        sl for sl in slices if sl["to"] <= first
    ]  # a slice re-run from an older checkpoint replaces the later ones
    git = git_state()
    slices.append(
        {
            "from": first,
            "to": last,
            "seconds": round(seconds, 1),
            "data_seconds": round(data_seconds, 1),
            "git_commit": git["commit"],
            "git_dirty": git["dirty"],
            "git_diff_sha256": git["diff_sha256"],
        }
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    # Written during training too (each periodic checkpoint): a kill mid-write keeps the old file whole.
    write_atomic(path, (json.dumps(slices, indent=1) + "\n").encode(), durable=False)
    return slices


def slice_speed(slices: list[dict]) -> tuple[int, float]:
    """(updates trained, training seconds) over the slices that trained any update with known
    time: a slice's seconds less its data seconds. A resumed slice with nothing left to train (or a
    killed slice never recorded) must not pass its data loading off as the run's training time."""
    timed = [
        sl
        for sl in slices
        if sl["to"] > sl["from"] and sl.get("seconds") is not None and sl.get("data_seconds") is not None
    ]
    seconds = sum(sl["seconds"] - sl["data_seconds"] for sl in timed)
    if seconds <= 0:
        return 0, 0.0
    return sum(sl["to"] - sl["from"] for sl in timed), seconds


def split_items(items: list, val_fraction: float) -> tuple[list, list]:
    """(train, validation) parts of generated training items: held out by source (a bAbI story,
    ``qrag.data.splits.validation_key``), so no validation question's story is trained on."""
    from qrag.data.splits import in_validation, validation_key

    val = [g for g in items if in_validation(validation_key(g.sample), val_fraction)]
    return [g for g in items if not in_validation(validation_key(g.sample), val_fraction)], val


def describe_data(train_samples: list, val_samples: list) -> dict:
    """What the training data measured to be: its mean context length, hard negatives per context
    (near-miss needles for NIAH), renamed share, and how many sources the validation part holds."""
    from qrag.data.splits import validation_key
    from qrag.metrics import mean

    metas = [s.meta for s in train_samples]
    return {
        "train_samples": len(train_samples),
        "val_samples": len(val_samples),
        "train_sources": len({validation_key(s) for s in train_samples}),
        "val_sources": len({validation_key(s) for s in val_samples}),
        "context_tokens": round(mean([m.get("context_tokens", 0) for m in metas]), 1),
        "hard_negatives": round(mean([m.get("hard_negatives", m.get("near_misses", 0)) for m in metas]), 2),
        "renamed_share": round(mean([1.0 if m.get("renamed") else 0.0 for m in metas]), 3),
    }


def attach_data(run, train_items, dev_items, tokens) -> dict:
    """Generated samples into a TrainingRun: train minus its validation part (held out by bAbI
    story, ``data.val_fraction``: periodic eval and keep_best look only at it), and dev. Returns
    :func:`describe_data` of what it attached."""
    train_items, val_items = split_items(train_items, run.cfg.data.val_fraction)
    run.use_data(*(([g.sample for g in items], tokens(items)) for items in (train_items, val_items, dev_items)))
    return describe_data(run.train_samples, run.val_samples)


# -- evaluation ---------------------------------------------------------------------------------


def task_list(task: str) -> list[str]:
    from qrag.data.niah import TASKS

    return list(TASKS) if task == "niah" else [task]


def steps_for(task: str) -> str | None:
    """NIAH is searched with T = each task's number of asked needles (no spare picks); BabiLong
    with the preset's search.max_steps (4, the paper's)."""
    from qrag.evaluation.lengths import NEEDLES

    return NEEDLES if task == "niah" else None


def evaluate(task: str, checkpoint: str | None, cfg, args: argparse.Namespace, device, log) -> dict:
    """The dev table: the checkpoint (None: none) and, unless --no-baseline, the untrained encoder,
    in one run and one file."""
    from qrag.evaluation.lengths import parse_length, run_sweep

    is_niah = task == "niah"
    lengths = [parse_length(x) for x in (args.lengths or (NIAH_LENGTHS if is_niah else BABILONG_LENGTHS)).split(",")]
    if is_niah:
        lengths = [n for n in lengths if n <= 2**20]  # RULER: 4K to 1M
    models = ([(args.label, checkpoint)] if checkpoint else []) + ([] if args.no_baseline else [("untrained", "none")])

    def samples(length: int) -> int:
        if is_niah:
            return args.niah_questions
        return args.questions_10m if length >= 10 * 2**20 else args.questions

    answer = None
    if args.answer != "none":
        from qrag.evaluation.evaluate import ReaderHook

        answer = ReaderHook(cfg.answer, args.answer)
    return run_sweep(
        models,
        cfg,
        task_list(task),
        lengths,
        samples,
        split="dev",
        steps=steps_for(task),
        device=device,
        val_samples=args.val_questions,
        answer=answer,
        log=log,
    )


def select_checkpoint(task: str, run_dir: Path, cfg, args: argparse.Namespace, device, log) -> dict:
    """Score every candidate checkpoint of the run on the val split at ``--select-lengths`` and
    keep the best mean Fact EM (ties: Fact F1; then the later one). Dev is never looked at.

    Each candidate's score is kept in ``<run_dir>/selection/<candidate>.json`` as soon as it is
    known, so a call cut short resumes the selection: a later call reuses every score whose key
    (:func:`selection_key`: the candidate's weights and what the val draw and search were) still
    matches and scores only the rest."""
    from qrag.evaluation.lengths import parse_length, sweep_model
    from qrag.model.checkpoint import is_checkpoint

    lengths = [parse_length(x) for x in args.select_lengths.split(",") if x.strip()]
    # A *.partial folder is a save a kill cut short (never renamed into place): no candidate.
    periodic = sorted(
        p for p in (run_dir / "checkpoints").glob("update_*") if is_checkpoint(p) and p.suffix != ".partial"
    )
    candidates = periodic + [p for p in (run_dir / "best", run_dir / "final") if is_checkpoint(p)]
    scored, reused = [], []
    for c in candidates:
        record = run_dir / "selection" / f"{c.name}.json"
        key = selection_key(task, c, lengths, cfg, args)
        entry = kept_score(record, key)
        if entry is not None:
            reused.append(c.name)
            scored.append(entry)
            log(
                f"select: {c.name}: val Fact EM {entry['val_fact_em']}, F1 {entry['val_fact_f1']} "
                f"(reused {record}: its weights and settings are unchanged)"
            )
            continue
        rows = sweep_model(
            c.name,
            str(c),
            cfg,
            task_list(task),
            lengths,
            lambda _: args.select_questions,
            split="val",
            steps=steps_for(task),
            device=device,
            log=log,
        )
        scored.append(
            {
                "checkpoint": str(c),
                "val_fact_em": round(sum(r["fact_em"] for r in rows) / len(rows), 4),
                "val_fact_f1": round(sum(r["fact_f1"] for r in rows) / len(rows), 4),
                # per_question: the chosen one's val table (val_table) pairs variants seed for seed
                "rows": [{**{k: r[k] for k in ROW_KEYS}, "per_question": r["per_question"]} for r in rows],
            }
        )
        keep_score(record, key, scored[-1])
        log(f"select: {c.name}: val Fact EM {scored[-1]['val_fact_em']}, F1 {scored[-1]['val_fact_f1']}")
    if not scored:
        raise SystemExit(f"longctx: --select-lengths: no checkpoint under {run_dir}")
    chosen = max(reversed(scored), key=lambda x: (x["val_fact_em"], x["val_fact_f1"]))
    return {
        "checkpoint": chosen["checkpoint"],
        "val_rows": chosen["rows"],
        "lengths": args.select_lengths,
        "questions": args.select_questions,
        "split": "val (held-out train stories, never trained on; in validation books)"
        if task != "niah"
        else "val (held-out train samples, never trained on: their own needles, RULER's haystack texts)",
        "candidates": [{**c, "rows": [without_questions(r) for r in c["rows"]]} for c in scored],
        "chosen_among": [Path(c["checkpoint"]).name for c in scored],
        "reused": reused,
    }


def without_questions(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "per_question"}


def val_table(selection: dict, val_rows: list[dict], label: str, cfg, device) -> dict:
    """The chosen checkpoint's val scores as a length-sweep table (``split: val``, per-question
    scores): ``qrag combine-seeds`` over several variants' seeds gives their val differences, paired
    seed for seed (each run's val draw follows its data seed, which is its training seed)."""
    from qrag.evaluation.lengths import run_sweep_table

    rows = [{**r, "model": label, "checkpoint": selection["checkpoint"]} for r in val_rows]
    note = (
        f"these are the val scores the checkpoint was chosen on ({selection['questions']} questions per length, "
        f"{selection['split']}), the best of {len(selection['candidates'])} candidates: compare variants chosen "
        "the same way, never report them as a result"
    )
    return run_sweep_table(rows, cfg, device, split="val", selected_on=note)


def weights_stamp(checkpoint: Path) -> dict:
    """What changes when a checkpoint folder is written again (a re-trained ``final`` or ``best``):
    its files' count, total size and newest modification time."""
    stats = [p.stat() for p in sorted(checkpoint.rglob("*")) if p.is_file()]
    return {
        "files": len(stats),
        "bytes": sum(st.st_size for st in stats),
        "mtime_ns": max((st.st_mtime_ns for st in stats), default=0),
    }


def selection_key(task: str, checkpoint: Path, lengths: list[int], cfg, args: argparse.Namespace) -> dict:
    """Everything a candidate's val score depends on: its weights, the lengths, questions per
    length, search budget and tasks, and the data, search and credit settings the draw and the
    search read. A stored score is reused only under an equal key."""
    from qrag.config import to_dict

    steps = steps_for(task)
    key = {
        "weights": weights_stamp(checkpoint),
        "lengths": lengths,
        "questions": args.select_questions,
        "steps": cfg.search.max_steps if steps is None else steps,
        "tasks": task_list(task),
        "data": to_dict(cfg.data),
        "search": to_dict(cfg.search),
        "credit": cfg.env.credit,
    }
    return json.loads(json.dumps(key))  # as it reads back from the file


def kept_score(record: Path, key: dict) -> dict | None:
    """The scored entry an earlier call kept for this key, or None (none, another key, or a file
    cut short by a kill)."""
    try:
        kept = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("key") != key:
        return None
    entry = kept.get("entry")
    # An entry an older version kept without per-question scores is scored again: val_table needs them.
    rows = entry.get("rows") if isinstance(entry, dict) else None
    return entry if isinstance(rows, list) and all("per_question" in r for r in rows) else None


def keep_score(record: Path, key: dict, entry: dict) -> None:
    # Written whole, then renamed: a call killed while writing leaves no half file to misread.
    record.parent.mkdir(parents=True, exist_ok=True)
    partial = record.with_suffix(".json.tmp")
    partial.write_text(json.dumps({"key": key, "entry": entry}, indent=1) + "\n")
    partial.replace(record)


def measure_generation(args: argparse.Namespace, paths: dict) -> dict:
    """Seconds and peak RSS to generate and tokenise one BabiLong sample at each length, after
    the background books are measured (timed separately: once per process and tokenizer)."""
    from qrag.data.babilong import book_haystack, generate_babilong
    from qrag.data.haystack import MIN_BACKGROUND_TOKENS, Measure
    from qrag.model.encoder import load_tokenizer, resolve_encoder
    from qrag.evaluation.lengths import length_label, parse_length
    from qrag.evaluation.longcontext import ChunkTokens
    from qrag.evaluation.memory import peak_mb, reset_peak
    from qrag.data.tokens import TokenLayout

    import torch

    cpu = torch.device("cpu")
    tokenizer = load_tokenizer(resolve_encoder(paths["encoder"]))
    layout = TokenLayout.from_tokenizer(tokenizer, 512)
    measure = Measure.from_tokenizer(tokenizer)
    lengths = [parse_length(x) for x in (args.lengths or "1m,10m").split(",")]
    t0 = time.perf_counter()
    hay = book_haystack(paths["novels"], "dev", 64, measure, max(MIN_BACKGROUND_TOKENS, 2 * max(lengths)))
    out = {"background_tokens": hay.tokens, "background_seconds": round(time.perf_counter() - t0, 1), "rows": []}
    for length in lengths:
        tokens = ChunkTokens(tokenizer, layout, 64, 48)
        reset_peak(cpu)
        t0 = time.perf_counter()
        g = next(
            generate_babilong("qa3", "dev", length, 1, measure, facts_path=paths["babi"], background=paths["novels"])
        )
        gen_s = time.perf_counter() - t0
        tok = tokens([g])[0]
        out["rows"].append(
            {
                "length": length_label(length),
                "chunks": len(g.sample.chunks),
                "context_tokens": g.sample.meta["context_tokens"],
                "generate_seconds": round(gen_s, 2),
                "tokenize_seconds": round(time.perf_counter() - t0 - gen_s, 2),
                "peak_rss_mb": round(peak_mb(cpu)),
                "token_array_mb": round(sum(c.nbytes for c in tok.chunks) / 2**20, 1),
            }
        )
        del g, tok, tokens
    return out


def summary_line(task: str, training: dict, table: dict) -> dict:
    from qrag.evaluation.evaluate import PROTOCOL_NOTES
    from qrag.evaluation.lengths import length_label

    em: dict[str, dict[str, float]] = {}
    f1: dict[str, dict[str, float]] = {}
    for r in table["rows"]:
        key = r["model"] if task != "niah" else f"{r['model']}/{r['task']}"
        em.setdefault(key, {})[length_label(r["length"])] = round(100 * r["fact_em"], 1)
        f1.setdefault(key, {})[length_label(r["length"])] = round(100 * r["fact_f1"], 1)
    if task == "niah":  # the headline: per model, the mean of the eight tasks' rows
        for model in dict.fromkeys(r["model"] for r in table["rows"]):
            for name, source in (("fact_em", em), ("fact_f1", f1)):
                per_length = {}
                for key, values in source.items():
                    if key.startswith(f"{model}/"):
                        for length, v in values.items():
                            per_length.setdefault(length, []).append(v)
                source[f"{model}/mean"] = {k: round(sum(v) / len(v), 1) for k, v in per_length.items()}
    return {
        "bench": "longctx",
        "task": task,
        "device": table["device"],
        "updates": training.get("updates"),
        "train_seconds": training.get("seconds"),
        "fact_em": em,
        "fact_f1": f1,
        "protocols": {k: PROTOCOL_NOTES[k] for k in ("fact_em", "fact_f1")},
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from qrag.evaluation.lengths import format_table, merge_tables, plot_table, read_table, write_table

    out_dir = Path(args.out)
    if args.pack_assets:
        print(json.dumps(pack_assets(Path(args.pack_assets), args.pack_encoder)))
        return 0
    if args.merge:
        table = merge_tables([read_table(p) for p in args.merge])
        path = write_table(table, out_dir / "longctx_all.json")
        png = plot_table(table, path.with_suffix(".png"))
        print(format_table(table))
        print(json.dumps({"table": str(path), "plot": str(png) if png else None}))
        return 0

    from qrag.model.encoder import pick_device

    device = pick_device(args.device)
    paths = resolve_paths(args)
    if args.generation_only:
        print(json.dumps({"bench": "longctx-generation", "machine": machine_info(), **measure_generation(args, paths)}))
        return 0

    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "longctx.log"

    def log(text: str) -> None:
        line = f"[longctx {time.strftime('%H:%M:%S')}] {text}"
        print(line, file=sys.stderr, flush=True)
        # Also a file under --out, written as it goes: a call killed at its time limit still
        # brings back how far it got (a piped `| tail` prints nothing when the process dies).
        with open(log_path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")

    if (args.stop_at or args.resume) and not args.updates:
        raise SystemExit(
            "longctx: --stop-at and --resume need --updates (the whole run's schedule, the same in every slice)"
        )
    if sum((args.no_eval, args.eval_only, args.baseline_only)) > 1:
        raise SystemExit("longctx: --no-eval, --eval-only and --baseline-only exclude each other")
    for task in [t.strip() for t in args.task.split(",") if t.strip()]:
        if task not in PRESETS:
            raise SystemExit(f"longctx: unknown task {task!r} (choose from {', '.join(PRESETS)})")
        run_task(task, args, paths, device, out_dir, log)
    return 0


def run_task(task: str, args: argparse.Namespace, paths: dict, device, out_dir: Path, log) -> None:
    """One task: train (or read the finished run's record), choose, evaluate dev, write the result."""
    from qrag.evaluation.lengths import format_table, plot_table, write_table

    if args.baseline_only:
        cfg, training, checkpoint, name = run_config(task, args, paths), {}, None, f"longctx_{task}_untrained.json"
    else:
        if args.eval_only:
            training, cfg = finished_training(task, args, paths)
        else:
            training, cfg = train(task, args, paths, device, log)
            if "stopped_at" in training:
                print(
                    json.dumps(
                        {
                            "bench": "longctx",
                            "task": task,
                            **training,
                            "next": "run the same command with --resume (and without --stop-at for the last slice)",
                        }
                    ),
                    flush=True,
                )
                return
            (Path(cfg.out_dir) / cfg.name / "training.json").write_text(json.dumps(training, indent=1) + "\n")
            if args.no_eval:
                print(
                    json.dumps(
                        {
                            "bench": "longctx",
                            "task": task,
                            "trained": training["checkpoint"],
                            "updates": training["updates"],
                            "next": "the same command with --eval-only instead of --no-eval",
                        }
                    ),
                    flush=True,
                )
                return
        if args.select_lengths:
            t0 = time.perf_counter()
            selection = select_checkpoint(task, Path(cfg.out_dir) / cfg.name, cfg, args, device, log)
            val_rows = selection.pop("val_rows")
            training.update(
                checkpoint=selection["checkpoint"],
                selection={**selection, "seconds": round(time.perf_counter() - t0, 1)},
                selected_on=training["selected_on"].split("; ")[0]
                + f"; checkpoint: the best Fact EM on the val split at "
                f"{args.select_lengths} ({args.select_questions} questions, {selection['split']}) among "
                f"{', '.join(selection['chosen_among'])}",
            )
        checkpoint = training["checkpoint"]
        stem = run_stem(task, args).replace("-", "_", 1)
        name = f"longctx_{stem}.json" if args.seed is None else f"longctx_{stem}_seed{args.seed}.json"
        if args.select_lengths:
            write_table(
                val_table(training["selection"], val_rows, args.label, cfg, device),
                out_dir / f"val_{name}",
            )
    t0 = time.perf_counter()
    table = evaluate(task, checkpoint, cfg, args, device, log)
    table.update(
        bench="longctx",
        task=task,
        machine=machine_info(),
        training=training,
        paths=paths,
        eval_seconds=round(time.perf_counter() - t0, 1),
        selected_on="; ".join(
            x
            for x in (
                training.get("selected_on"),
                table.get("selected_on"),
                "dev: never used for choosing, evaluated once on the frozen draw",
            )
            if x
        ),
    )
    path = out_dir / name
    write_table(table, path)
    plot_table(table, path.with_suffix(".png"))
    print(format_table(table), file=sys.stderr)
    print(json.dumps(summary_line(task, training, table)), flush=True)


def finished_training(task: str, args: argparse.Namespace, paths: dict) -> tuple[dict, object]:
    """The record a --no-eval training run left in its run folder, and the run's config."""
    cfg = run_config(task, args, paths)
    record = Path(cfg.out_dir) / cfg.name / "training.json"
    if not record.is_file():
        raise SystemExit(
            f"longctx: --eval-only: {record} not found (train the run to its end first, e.g. with --no-eval)"
        )
    return json.loads(record.read_text()), cfg


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
