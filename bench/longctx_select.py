"""Choose long-context training settings on validation questions (never on dev).

Trains each variant (a set of config overrides on a BabiLong/NIAH preset) for the same wall-clock
budget (or number of updates) on the training data *its own* ``data.*`` settings generate (variants
with the same data settings share one copy), then scores every variant on the same *validation*
questions: those the shared settings hold out of training by source (bAbI stories,
``data.val_fraction``), at the training length, T = the preset's ``search.max_steps``. A variant
whose training data would hold one of those stories is refused. Each variant's result records
what its training data measured to be: mean context length, hard negatives per context, renamed
share (``data``). Records every variant's learning-signal diagnostics by update
(success rate, policy entropy, Q of successful / failed transitions, V(s'), share of transitions
with a return to come), so a pathology shows in the JSON. The untrained encoder is scored on the
same questions. Writes ``<out>/longctx_select_<task>.json`` after every variant.

    python bench/longctx.py --pack-assets .carry/longctx          # here, once
    PYTHONPATH=platform python bench/longctx_select.py --assets .carry/longctx --task qa3 --minutes-each 1.5 \\
        --variant preset: --variant cold:learner.alpha=0.005,learner.value_top_k=5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_common import machine_info  # noqa: E402
from longctx import PRESETS, ROW_KEYS, describe_data, resolve_paths, split_items  # noqa: E402

DIAGNOSTICS = (
    "success",
    "policy_entropy",
    "q_taken",
    "q_success",
    "q_failure",
    "value_next",
    "nonzero_return_share",
    "target",
    "loss",
    "alpha",
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="qa3", help="qa1..qa5 or niah")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:k=v,k=v",
        help="a variant: a name and config overrides (repeat; 'NAME:' = the preset as it is)",
    )
    p.add_argument(
        "--minutes-each",
        type=float,
        default=1.5,
        help="training time per variant (its schedule is sized from the speed of updates 3-5)",
    )
    p.add_argument(
        "--updates",
        type=int,
        default=0,
        help="train every variant for exactly this many updates instead (equal episodes: a fair ablation)",
    )
    p.add_argument("--val-questions", type=int, default=200, help="validation questions scored per variant")
    p.add_argument("--assets", metavar="DIR", help="a folder made by bench/longctx.py --pack-assets")
    p.add_argument("--encoder")
    p.add_argument("--babi")
    p.add_argument("--novels")
    p.add_argument("--essays")
    p.add_argument(
        "--lengths",
        default="",
        help="also evaluate each trained variant on dev at these lengths "
        "(e.g. 4k,128k,1m; T = search.max_steps; reported once, never used for choosing)",
    )
    p.add_argument(
        "--val-lengths",
        default="",
        help="also score each trained variant on the val split at these lengths (e.g. 1m): "
        "held-out bAbI train questions in the validation books, which no training context holds; T = search.max_steps",
    )
    p.add_argument(
        "--val-questions-long", type=int, default=100, help="validation questions per length with --val-lengths"
    )
    p.add_argument("--dev-questions", type=int, default=100, help="dev questions per length with --lengths")
    p.add_argument(
        "--table-out", help="with --lengths: also write the variants' length table here (qrag report reads it)"
    )
    p.add_argument(
        "--score-credit",
        default="chunk",
        choices=("chunk", "text"),
        help="credit rule of the validation score, the same for every variant",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides for every variant")
    return p.parse_args(argv)


def variant_overrides(spec: str) -> tuple[str, list[str]]:
    name, _, rest = spec.partition(":")
    return name, [kv for kv in rest.split(",") if kv.strip()]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from qrag.config import load_config, to_dict
    from qrag.data.haystack import Measure
    from qrag.data.splits import validation_key
    from qrag.model.encoder import pick_device
    from qrag.evaluation.longcontext import ChunkTokens
    from qrag.rl.train import TrainingRun

    if args.task == "niah":
        from qrag.data.niah import generate_from_config
    else:
        from qrag.data.babilong import generate_from_config
    device = pick_device(args.device)
    paths = resolve_paths(args)
    base = [f"model.encoder={paths['encoder']}", "checkpoint_every=0", "eval_every=0", "out_dir=/tmp/qrag-select"]
    if args.task == "niah":
        base += [f"data.path={paths['essays']}"] if paths["essays"] else []
    else:
        base += [f"data.path={paths['novels']}"] if paths["novels"] else []
        base += [f"data.facts_path={paths['babi']}"] if paths["babi"] else []
    variants = [variant_overrides(v) for v in (args.variant or ["preset:"])]

    def log(text: str) -> None:
        print(f"[select {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    cfg0 = load_config(ROOT / "configs" / PRESETS[args.task], base + args.overrides)
    first = TrainingRun(cfg0, device=device, load_data=False)
    measure = Measure.from_tokenizer(first.tokenizer)
    tokens = ChunkTokens(first.tokenizer, first.layout, cfg0.data.chunk_tokens, cfg0.data.question_tokens)
    datasets: dict[str, tuple] = {}

    def data_for(data_cfg) -> tuple:
        """(train samples, train tokens, val samples, val tokens) of these data settings, made once."""
        key = json.dumps(to_dict(data_cfg), sort_keys=True, default=str)
        if key not in datasets:
            train_items, val_items = split_items(
                generate_from_config(data_cfg, "train", measure), data_cfg.val_fraction
            )
            datasets[key] = (
                [g.sample for g in train_items],
                tokens(train_items),
                [g.sample for g in val_items],
                tokens(val_items),
            )
        return datasets[key]

    common = data_for(cfg0.data)
    val_sources = {validation_key(s) for s in common[2]}
    log(f"{len(common[1])} train / {len(common[3])} validation samples in {time.perf_counter() - t0:.0f}s")
    n_val = min(args.val_questions, len(common[3]))
    out_path = Path(args.out) / f"longctx_select_{args.task}.json"
    result = {
        "bench": "longctx_select",
        "task": args.task,
        "machine": machine_info(),
        "selected_on": (
            f"validation: the first {n_val} of {len(common[3])} samples of the {len(val_sources)} sources "
            f"(bAbI stories; NIAH samples) that data.val_fraction={cfg0.data.val_fraction} holds out of every "
            "variant's training data; the same questions for every variant; dev never looked at"
        ),
        "val_questions": n_val,
        "common_data": describe_data(common[0], common[2]),
        "minutes_each": args.minutes_each,
        "common_overrides": args.overrides,
        "variants": [],
    }

    def score(run) -> dict:
        # One credit rule for every variant (a text-credit run is still scored by its chunks).
        ev = run.evaluate(n_val, split="val", credit=args.score_credit).summary
        return {k: round(ev[k], 4) for k in ("fact_em", "fact_f1", "oracle_fact_em", "oracle_fact_f1")} | {
            "steps": run.cfg.search.max_steps,
            "credit": ev["credit"],
        }

    for label, how in (("untrained (full-vector cosine)", "cosine"), ("untrained (half-vector cosines)", "twin")):
        cfg_b = load_config(
            ROOT / "configs" / PRESETS[args.task],
            base + args.overrides + ["model.positions=none", f"model.similarity={how}"],
        )
        run = TrainingRun(cfg_b, device=device, load_data=False)
        run.train_samples, run.train_tok, run.val_samples, run.val_tok = common
        result["variants"].append({"name": label, "val": score(run)})
        log(f"{label}: {result['variants'][-1]['val']}")
        del run

    table_rows: list[dict] = []
    for name, overrides in variants:
        cfg = load_config(ROOT / "configs" / PRESETS[args.task], base + args.overrides + overrides)
        run = TrainingRun(cfg, device=device, load_data=False)
        train_samples, train_tok = data_for(cfg.data)[:2]  # this variant's own data settings
        leaked = val_sources & {validation_key(s) for s in train_samples}
        if leaked:
            raise SystemExit(
                f"longctx_select: variant {name!r} would train on {len(leaked)} validation source(s) (e.g. "
                f"{sorted(leaked)[0]}): keep data.val_fraction and data.seed common to every variant"
            )
        run.train_samples, run.train_tok, run.val_samples, run.val_tok = train_samples, train_tok, common[2], common[3]
        from qrag.rl.train import EpochSampler

        run.sampler = EpochSampler(len(run.train_tok), cfg.seed)
        source = run.local_source()
        started = time.perf_counter()
        history, per_update = [], None
        budget = args.minutes_each * 60
        # The schedule's length (warm-up, decay, α annealing) is set from the measured speed.
        if args.updates:
            run.learner.total_updates = per_update = args.updates
        while True:
            m = run.learner.train_update(source.next_batch())
            if run.learner.update == 2:
                timed = time.perf_counter()  # the first updates warm up kernels: time from here
            if run.learner.update == 5 and not args.updates:
                per_update = (time.perf_counter() - timed) / 3
                run.learner.total_updates = max(6, int((budget - (time.perf_counter() - started)) / per_update) + 5)
            if run.learner.update % 5 == 0 or run.learner.update == 1:
                d = m.as_dict()
                history.append(
                    {"update": run.learner.update, **{k: round(float(d[k]), 4) for k in DIAGNOSTICS if k in d}}
                )
            if run.learner.update >= run.learner.total_updates and per_update is not None:
                break
        train_s = time.perf_counter() - started
        val = score(run)
        long_val = []
        if args.lengths or args.val_lengths:
            from qrag.evaluation.lengths import parse_length, sweep_model

            ckpt = str(run.save(Path("/tmp/qrag-select") / name, resumable=False))
            tasks = [args.task] if args.task != "niah" else list(run.cfg.data.tasks)
            run_cfg = run.cfg  # the closure must not see `run`, which is deleted below

            def sweep(spec: str, split: str, n: int) -> list[dict]:
                lengths = [parse_length(x) for x in spec.split(",") if x.strip()]
                return (
                    sweep_model(name, ckpt, run_cfg, tasks, lengths, lambda _: n, split=split, device=device, log=log)
                    if lengths
                    else []
                )

            long_val = [{k: r[k] for k in ROW_KEYS} for r in sweep(args.val_lengths, "val", args.val_questions_long)]
            table_rows.extend(sweep(args.lengths, "dev", args.dev_questions))
        entry = {
            "name": name,
            "overrides": overrides,
            "data": describe_data(train_samples, common[2]),
            "updates": run.learner.update,
            "episodes_per_s": round(run.learner.update * cfg.learner.episodes_per_update / train_s, 1),
            "train_seconds": round(train_s, 1),
            "val": val,
            **({"val_lengths": long_val} if long_val else {}),
            "history": history,
        }
        result["variants"].append(entry)
        log(
            f"{name}: {run.learner.update} updates in {train_s:.0f}s; val {val}; long val {long_val}; "
            f"last {history[-1] if history else {}}"
        )
        if table_rows:
            result["dev_lengths"] = [{k: r[k] for k in ("model", *ROW_KEYS)} for r in table_rows]
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1) + "\n")
        del run, source
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    if args.table_out and table_rows:
        from qrag.evaluation.lengths import run_sweep_table, write_table

        write_table(run_sweep_table(table_rows, cfg0, device), args.table_out)
    print(json.dumps({"written": str(out_path), "variants": [(v["name"], v["val"]) for v in result["variants"]]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
