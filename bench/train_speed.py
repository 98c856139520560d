"""Training throughput of the core learner (no Ray): episodes/s, encoder tokens/s, the share of
wall time in encoder passes, and the time from process start to the first finished update.

    PYTHONPATH=platform python bench/train_speed.py --config configs/hotpot.yaml --updates 30 \
        --out bench/results/train_speed.json [key=value ...]

It times the soft PQN learner (the paper's Q-RAG) whatever the preset trains; ``learner.objective=sft``
on the command line times the supervised one.

The first ``--timed`` updates after warm-up synchronise the GPU around every encoder call to
split wall time into encoder vs the rest; the throughput figures come from untimed updates.
``--profile N`` runs N more under torch.profiler: how busy the GPU was, and the operators that cost most.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

PROCESS_START = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

from bench_common import machine_info, write_result  # noqa: E402

from qrag.config import load_config  # noqa: E402
from qrag.rl.train import TrainingRun  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "hotpot.yaml"))
    ap.add_argument("--updates", type=int, default=30, help="untimed updates measured after warm-up")
    ap.add_argument("--warmup", type=int, default=3, help="updates excluded from the throughput figures")
    ap.add_argument("--timed", type=int, default=5, help="updates with per-call encoder timing")
    ap.add_argument(
        "--split-ratio",
        type=float,
        default=None,
        help="encode()'s padding cut on this run's device (qrag.model.encoder.split_ratio_for): 0 = off, "
        "0.75 = the CPU's; default: the device's own rule",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        help="updates run under torch.profiler after the others: GPU busy share, kernels per update, "
        "the top host and GPU operators (bench/step_profile.py)",
    )
    ap.add_argument("--out", help="write the JSON result here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    total = args.warmup + args.updates + args.timed
    schedule = total + max(args.profile, 0)
    cfg = load_config(args.config, ["learner.objective=pqn", *args.overrides, f"updates={max(schedule, 1)}"])
    if args.split_ratio is not None:
        import qrag.model.encoder as encoder_module

        ratio = args.split_ratio
        encoder_module.split_ratio_for = lambda device: ratio
    t0 = time.perf_counter()
    run = TrainingRun(cfg)
    setup_s = time.perf_counter() - t0
    source = run.local_source()
    learner = run.learner
    first_update_s = None
    rows = []
    for i in range(total):
        learner.stats.timed = i >= args.warmup + args.updates
        t = time.perf_counter()
        batch = source.next_batch()
        m = learner.train_update(batch)
        if run.device.type == "cuda":
            import torch

            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        if first_update_s is None:
            first_update_s = time.perf_counter() - PROCESS_START
        rows.append((i, dt, m))
    steady = [r for r in rows if args.warmup <= r[0] < args.warmup + args.updates]
    timed = [r for r in rows if r[0] >= args.warmup + args.updates]
    wall = sum(r[1] for r in steady)
    episodes = sum(r[2].episodes for r in steady)
    tokens = sum(r[2].encoder_tokens for r in steady)
    padded = sum(r[2].encoder_padded_tokens for r in steady)
    enc_s = sum(r[2].encoder_seconds for r in timed)
    by_kind: dict[str, float] = {}
    for kind, sec in learner.stats.by_kind.items():  # the last timed update
        by_kind[kind] = sec
    timed_wall = sum(r[1] for r in timed)
    profiled = None
    if args.profile > 0:
        from step_profile import profile_updates

        learner.stats.timed = False  # the per-call syncs would distort the profile
        profiled = profile_updates(lambda: learner.train_update(source.next_batch()), args.profile, run.device)
    result = {
        "benchmark": "train_speed",
        "config": args.config,
        "overrides": args.overrides,
        "episodes_per_update": cfg.learner.episodes_per_update,
        "micro_batch": cfg.learner.micro_batch,
        "split_ratio": args.split_ratio,
        "episodes_per_s": episodes / wall,
        "encoder_tokens_per_s": tokens / wall,
        "padding_overhead": padded / max(tokens, 1) - 1,
        "encoder_share_of_wall": enc_s / timed_wall if timed_wall else None,
        "encoder_seconds_by_pass_last_update": by_kind,
        "seconds_last_timed_update": timed[-1][1] if timed else None,
        "seconds_per_update": wall / len(steady),
        "setup_s": setup_s,
        "setup_breakdown_s": run.timings,
        "import_s": t0 - PROCESS_START,
        "first_update_s_from_process_start": first_update_s,
        "train_return_last": rows[-1][2].episode_return,
        "profile": profiled,
        "packed": learner.packed,
        "unpacked_reason": learner.unpacked_reason,
        "graphed_shapes": learner.graphed.captured_shapes if learner.graphed else 0,
        "graph_fallbacks": learner.graphed.fallbacks if learner.graphed else {},
        "measured_updates": len(steady),
        **machine_info(),
    }
    print(json.dumps(result))
    if args.out:
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
