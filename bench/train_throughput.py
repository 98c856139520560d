"""Training throughput through Ray: the learner fed by 1, 2, 4 EpisodeFeeder actors, against the
same learner alone (``qrag.rl.train.TrainingRun`` with its own in-process sampling, no Ray).

    python bench/train_throughput.py --mode cpu --out bench/results/train_throughput_cpu.json
    python bench/train_throughput.py --mode gpu --out bench/results/train_throughput_gpu.json

Both modes run the real code paths: ``train_with_ray`` (Ray Train learner + runners, MLflow off)
and ``TrainingRun.run``. Figures are steady state: the first ``--skip`` updates are left out.

* episodes/s      episodes_per_update x measured updates / their wall time (waiting included)
* runner_wait     share of that wall time the learner spent waiting for episodes (goal: < 10 %)
* setup_s         learner alone: loading model and data; job_wall_s (Ray): the whole run

``--mode cpu``: a tiny random-init encoder (the tests' one), 32 episodes per update, so that the
learner is fast and the figures show whether runners and the object store keep up; add
``--encoder minilm`` for the smoke preset's real model (slow on 2 cores).
``--mode gpu``: configs/hotpot.yaml with MiniLM (256 episodes per update). Needs ray[train] on
the GPU machine for the Ray rows; without Ray the learner-alone row is still measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_common import machine_info, write_result  # noqa: E402

MODES = {
    # A tiny random-init encoder (the tests' one) keeps the learner fast, so the figures show
    # whether the runners and the object store keep up, not how slow MiniLM is on 2 cores.
    # `--encoder minilm` measures the smoke preset's real model instead.
    "cpu": {
        "config": "configs/smoke.yaml",
        "updates": 30,
        "skip": 5,
        "runners": [1, 2, 4],
        "encoder": "tiny",
        "overrides": ["learner.episodes_per_update=32", "learner.micro_batch=32"],
    },
    # The paper's HotpotQA settings as configs/hotpot.yaml sizes them for one GPU, its soft PQN learner.
    "gpu": {
        "config": "configs/hotpot.yaml",
        "updates": 40,
        "skip": 5,
        "runners": [2, 4],
        "encoder": "minilm",
        "overrides": ["learner.objective=pqn"],
    },
}


def steady_state(update_s: list[float], wait_s: list[float], episodes: int, skip: int) -> dict:
    upd, wait = update_s[skip:], wait_s[skip:]
    total = sum(upd)
    return {
        "updates_measured": len(upd),
        "episodes_per_s": round(episodes * len(upd) / total, 2) if total else None,
        "seconds_per_update": round(total / len(upd), 4) if upd else None,
        "runner_wait_share": round(sum(wait) / total, 4) if total else None,
    }


def learner_alone(cfg, skip: int) -> dict:
    from qrag.rl.train import TrainingRun

    t0 = time.perf_counter()
    run = TrainingRun(cfg)
    setup_s = time.perf_counter() - t0
    run.run(report=lambda update, metrics: None)
    hist = run.history
    row = steady_state(
        [h["perf/update_s"] for h in hist],
        [h["perf/runner_wait_s"] for h in hist],
        cfg.learner.episodes_per_update,
        skip,
    )
    return {
        "setup": "learner alone (no Ray)",
        "runners": 0,
        "device": str(run.device),
        "setup_s": round(setup_s, 1),
        **row,
    }


def with_runners(cfg, runners: int, skip: int) -> dict:
    import ray

    from qrag.distributed.job import Job, connect
    from qrag.distributed.preflight import worker_env
    from qrag.distributed.train import train_with_ray

    cfg = dataclasses.replace(cfg, distributed=dataclasses.replace(cfg.distributed, runners=runners))
    t0 = time.perf_counter()
    # A fresh local Ray per row. Its workers inherit this environment (PYTHONPATH with platform/,
    # the data and encoder variables): no runtime env, which a trimmed Ray install may not support.
    os.environ.update(worker_env())
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "platform"), os.environ.get("PYTHONPATH")]))
    # Ray runs its workers at nice 15; on a shared machine that alone would slow the learner down
    # against the learner-alone row (nice 0). Same priority for both.
    os.environ.setdefault("RAY_worker_niceness", "0")
    connect(Job(cfg, None, {}, "bench"), ship_code=False)
    try:
        result = train_with_ray(cfg, run_name=f"{cfg.name}-r{runners}", tracking=False)
    finally:
        ray.shutdown()
    out = result.return_value
    row = steady_state(out["update_seconds"], out["wait_seconds"], cfg.learner.episodes_per_update, skip)
    return {
        "setup": f"Ray Train learner + {runners} EpisodeFeeders",
        "runners": runners,
        "job_wall_s": round(time.perf_counter() - t0, 1),
        **row,
    }


def measure(cfg, args, mode: dict, skip: int, rows: list[dict]) -> None:
    if not args.no_alone:
        rows.append(learner_alone(cfg, skip))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    for n in args.runners or mode["runners"]:
        try:
            rows.append(with_runners(cfg, n, skip))
        except Exception as exc:  # noqa: BLE001 - e.g. no Ray on the GPU machine: keep the other rows
            traceback.print_exc()
            rows.append(
                {
                    "setup": f"Ray Train learner + {n} EpisodeFeeders",
                    "runners": n,
                    "error": f"{type(exc).__name__}: {exc}",
                }
            )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=sorted(MODES), default="cpu")
    ap.add_argument("--updates", type=int, help="updates per setup (default: by mode)")
    ap.add_argument("--skip", type=int, help="first updates left out of the figures (default: by mode)")
    ap.add_argument(
        "--runners",
        type=lambda text: [int(n) for n in text.split(",")],
        metavar="N,N,...",
        help="runner counts to measure, e.g. 1,2,4 (default: by mode)",
    )
    ap.add_argument("--no-alone", action="store_true", help="skip the learner-alone row")
    ap.add_argument(
        "--encoder",
        help="tiny (random-init 2-layer BERT, MiniLM's tokenizer) | minilm | a directory (default: by mode)",
    )
    ap.add_argument("--out", help="write the JSON result here, e.g. bench/results/train_throughput_cpu.json")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = ap.parse_args()
    mode = MODES[args.mode]
    updates, skip = args.updates or mode["updates"], args.skip if args.skip is not None else mode["skip"]

    from qrag.config import load_config
    from qrag.distributed.preflight import preflight, resolve_paths

    work = Path(tempfile.mkdtemp(prefix="qrag-bench-"))
    encoder = args.encoder or mode["encoder"]
    if encoder == "tiny":
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import build_tiny_encoder

        encoder = str(build_tiny_encoder(work / "tiny_encoder"))
    cores = os.cpu_count() or 1
    base = [
        *mode["overrides"],
        f"model.encoder={encoder}",
        f"updates={updates}",
        "eval_every=0",
        "checkpoint_every=0",
        "log_every=1000",
        "data.dev_fraction=0.05",  # the final evaluation is not what is measured: keep it short
        f"out_dir={work}",
        "name=throughput",
        "distributed.mlflow_uri=none",
        "distributed.max_failures=0",
        f"distributed.learner_cpus={min(4, cores) if args.mode == 'cpu' else 4}",
        f"distributed.runner_cpus={0.5 if args.mode == 'cpu' else 1}",
    ]
    cfg = resolve_paths(load_config(ROOT / mode["config"], [*base, *args.overrides]), Path.cwd())
    preflight(cfg)

    rows = []
    load_start = round(os.getloadavg()[0], 2)
    try:
        measure(cfg, args, mode, skip, rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # checkpoints of the measured runs
    try:
        import ray

        ray_version = ray.__version__
    except ImportError:
        ray_version = None
    result = {
        "bench": "train_throughput",
        "mode": args.mode,
        **machine_info(),
        "ray": ray_version,
        "load_avg_1m": {"start": load_start, "end": round(os.getloadavg()[0], 2)},  # a shared machine is noisy
        "encoder": args.encoder or mode["encoder"],
        "config": mode["config"],
        "episodes_per_update": cfg.learner.episodes_per_update,
        "updates": updates,
        "skip": skip,
        "overrides": [*mode["overrides"], *args.overrides],
        "rows": rows,
    }
    print(json.dumps(result))
    if args.out:
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
