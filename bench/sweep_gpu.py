"""A real sweep over α, λ, τ (and learning rate, batch size) on HotpotQA on one GPU (issue 4).

Runs tune/hotpot_alpha_lambda_tau.yaml with the sweep library's sequential fallback
(`qrag.distributed.sweep.local`: the same space, seed, validation metric and ASHA rule as the Ray
Tune sweep, trials one after another on the whole GPU; no Ray, no MLflow, so it needs only torch,
transformers, numpy and pyyaml). Progress is kept under --work after every evaluation, so a run
cut by --minutes (or killed) goes on where it stopped when started again on the same machine.

Writes --out (one JSON: every trial's values, status, validation curve and dev Fact F1 when it
completed; the best trial; per-hyperparameter rank correlations; the paper's defaults; machine),
and beside it <name>.csv and <name>.best.yaml (and <name>.png where matplotlib is installed;
else render it here afterwards with --plot). Prints the same JSON on one line.

GPU, from the repository root (carry .carry/minilm and .carry/data, ~48 MB; --minutes keeps each
call under the 10-minute limit, and the same command on the warm machine continues; 16 trials are
~12-18 GPU minutes on one H100/H200, `--trials 12` saves about a quarter):
    QRAG_ENCODER=.carry/minilm QRAG_DATA_DIR=.carry/data HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=platform \\
      python3 bench/sweep_gpu.py --minutes 9 --out $OUT/sweep_hotpot_h100.json
Here, afterwards (the plot; needs the same sweep file):
    python bench/sweep_gpu.py --plot bench/results/sweep_hotpot_h100.json
CPU check (tiny encoder and data, ~1 minute):
    python bench/sweep_gpu.py --config tune/smoke.yaml --work /tmp/sw --out /tmp/sw/smoke.json \\
        model.encoder=DIR data.path=FILE
The Ray Tune sweep itself, where Ray 2.60 is installed (4 trials share the GPU; add
distributed.mlflow_uri=none without mlflow-skinny). SIGINT makes Tune save its state, and the same
command resumes, so it also fits in calls of 10 minutes:
    timeout -s INT -k 30 540 python3 tune/sweep.py --config tune/hotpot_alpha_lambda_tau.yaml out_dir=runs
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "bench"))

# The paper's defaults (appendix: training details) and what §5 / Fig. 3 says about them.
PAPER = {
    "defaults": {
        "learner.alpha": 0.05,
        "learner.lam": 0.5,
        "learner.tau": 0.02,
        "learner.lr": 1.5e-5,
        "learner.episodes_per_update": 96,
    },
    "finding": "Fig. 3 (BabiLong QA2/QA3, multilingual-e5-large): "
    "Q-RAG is sensitive to the entropy temperature α and to "
    "λ of the λ-returns; the defaults α=0.05, λ=0.5, τ=0.02 are used for every benchmark. Table 3: without "
    "target networks (no EMA τ) F1 drops from ~97 to ~79 ± 26 (unstable); without soft-Q to ~95.",
}


def ranks(values: list[float]) -> list[float]:
    """Average ranks (ties share their mean rank)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx, sy = math.sqrt(sum((a - mx) ** 2 for a in rx)), math.sqrt(sum((b - my) ** 2 for b in ry))
    return None if sx == 0 or sy == 0 else cov / (sx * sy)


def sensitivity(sweep, outcomes) -> dict:
    """Per swept key: how the trials' scores go with it (Spearman over all scored trials; the score
    at each rung decision is what ASHA compared), and the best trial's value next to the paper's."""
    scored = [(o, o.score(sweep.mode, sweep.score_scope)) for o in outcomes]
    scored = [(o, s) for o, s in scored if s is not None]
    best = max(scored, key=lambda p: p[1] if sweep.mode == "max" else -p[1], default=(None, None))[0]
    out = {}
    for dim in sweep.dims:
        values = [o.params.get(dim.key) for o, _ in scored]
        entry = {
            "paper_default": PAPER["defaults"].get(dim.key),
            "best_trial_value": best.params.get(dim.key) if best else None,
        }
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            xs = [math.log(v) if dim.log_scale and v > 0 else float(v) for v in values]
            entry["spearman_vs_score"] = spearman(xs, [s for _, s in scored])
        groups: dict[str, list[float]] = {}
        for (o, s), v in zip(scored, values):
            groups.setdefault(str(v), []).append(s)
        if dim.kind in ("choice", "grid"):
            entry["mean_score_by_value"] = {k: sum(v) / len(v) for k, v in groups.items()}
        out[dim.key] = entry
    return out


def write_files(sweep, outcomes, out: Path) -> dict:
    """<out>.csv, <out>.best.yaml and <out>.png (when matplotlib is installed) beside the JSON."""
    from qrag.distributed.sweep.results import write_report

    tmp = out.parent / f".{out.stem}_report"
    report = write_report(outcomes, sweep, tmp)
    files = {}
    for src, suffix in ((report.csv, ".csv"), (report.best_yaml, ".best.yaml"), (report.png, ".png")):
        if src is not None and src.is_file():
            dst = out.with_name(out.stem + suffix)
            shutil.move(str(src), dst)
            files[suffix.lstrip(".")] = str(dst)
    shutil.rmtree(tmp, ignore_errors=True)
    print(report.table, file=sys.stderr, flush=True)
    return files


def plot_only(result_path: Path) -> int:
    """Render the table, plot and best config of a result JSON here (its sweep file must exist)."""
    from qrag.distributed.sweep.results import TrialOutcome
    from qrag.distributed.sweep.spec import load_sweep

    result = json.loads(result_path.read_text())
    sweep = load_sweep(ROOT / result["config"], result["overrides"], trials=result["trials_per_grid_point"])
    outcomes = [TrialOutcome.from_json(t) for t in result["trial_outcomes"]]
    print(json.dumps(write_files(sweep, outcomes, result_path)))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--config", default="tune/hotpot_alpha_lambda_tau.yaml", help="sweep file (relative to the repository root)"
    )
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="training config overrides for every trial")
    ap.add_argument("--trials", type=int, help="draws from the space (default: the sweep file's)")
    ap.add_argument(
        "--work", default="runs/sweep_gpu", help="where trials train and progress is kept (kept between calls)"
    )
    ap.add_argument(
        "--minutes", type=float, help="start no trial that would end past this many minutes; run again to go on"
    )
    ap.add_argument("--out", help="result JSON (default bench/results/sweep_hotpot_<gpu>.json)")
    ap.add_argument("--plot", metavar="RESULT.json", help="only render the CSV, PNG and best config of a result JSON")
    args = ap.parse_args()
    if args.plot:
        return plot_only(Path(args.plot))

    from bench_common import machine_info, write_result
    from qrag.distributed.sweep.driver import check_same_sweep, prepare
    from qrag.distributed.sweep.local import LocalSweep

    t0 = time.monotonic()
    work = Path(args.work).resolve()
    argv = ["--local", "--config", str(ROOT / args.config), *args.overrides, f"out_dir={work}"]
    if args.trials:
        argv += ["--trials", str(args.trials)]
    sweep, _ = prepare(argv, "sweep_gpu")
    check_same_sweep(sweep, resuming=True)
    deadline = t0 + 60 * args.minutes if args.minutes else None
    outcomes, complete = LocalSweep(sweep).run(deadline)
    info = machine_info()
    gpu = (info.get("gpu") or "cpu").lower().replace("nvidia ", "").split()[0]
    out = Path(args.out or ROOT / "bench" / "results" / f"sweep_hotpot_{gpu}.json")
    result = {
        "benchmark": "sweep_hotpot",
        "config": args.config,
        "overrides": [o for o in args.overrides if not o.startswith("out_dir=")],
        "trials_per_grid_point": sweep.spec.trials,
        "complete": complete,
        "trials_done": len(outcomes),
        "trials_total": sweep.total_trials(),
        "sweep": sweep.summary(),
        "metric": f"{sweep.score_scope} {sweep.metric} on the validation part of train (data.val_fraction "
        f"{sweep.base.data.val_fraction}); dev_fact_f1 = the final dev evaluation of completed trials",
        "counts": {s: sum(o.status == s for o in outcomes) for s in ("completed", "stopped", "error")},
        "seconds_this_call": round(time.monotonic() - t0, 1),
        "sensitivity": sensitivity(sweep, outcomes),
        "paper": PAPER,
        "trial_outcomes": [o.to_json() for o in outcomes],
        **info,
    }
    if complete:
        result["files"] = write_files(sweep, outcomes, out)
        from qrag.distributed.sweep.results import best_outcome

        best = best_outcome(outcomes, sweep)
        result["best"] = (
            None
            if best is None
            else {
                "trial": best.trial_id,
                "params": best.params,
                "score": best.score(sweep.mode, sweep.score_scope),
                "dev_fact_f1": best.dev_fact_f1,
                "updates": best.updates,
            }
        )
    else:
        result["next"] = "run the same command again (same machine, same --work) to continue"
    write_result(out, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("trial_outcomes", "sweep", "paper")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
