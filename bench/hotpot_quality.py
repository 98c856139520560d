"""HotpotQA quality run: train a preset, then evaluate on the dev split next to the untrained
encoder and the paper, and write one JSON with the learning curve.

    PYTHONPATH=platform python bench/hotpot_quality.py --config configs/hotpot.yaml \
        --out bench/results/hotpot_quality.json [key=value ...]

Dev questions are never used for training or checkpoint selection (selection uses the
validation part of train, ``data.val_fraction``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

from bench_common import machine_info, write_result  # noqa: E402

from qrag.config import load_config, to_dict  # noqa: E402
from qrag.evaluation.evaluate import evaluate_checkpoint  # noqa: E402
from qrag.rl.train import TrainingRun  # noqa: E402

PAPER = {
    "source": "Q-RAG paper, Table 2 "
    "(multilingual-e5-large, 560M parameters, ~12 h on one A100, 90K training questions)",
    "q_rag": {"fact_f1": 0.93, "fact_em": 0.89},
    "plan_q_rag": {"fact_f1": 0.95, "fact_em": 0.91},
    "multi_step_rag_without_ft": {"fact_f1": 0.73, "fact_em": 0.54},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "hotpot.yaml"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    cfg = load_config(args.config, args.overrides)
    t0 = time.perf_counter()
    curve: list[dict] = []

    def report(update: int, metrics: dict) -> None:
        row = {"update": update, **{k: v for k, v in metrics.items() if not k.startswith("perf/update")}}
        curve.append(row)
        print(json.dumps(row), flush=True)

    run = TrainingRun(cfg)
    out = run.run(report=report)
    train_s = time.perf_counter() - t0
    selected = out["checkpoint"]
    evals = {
        "selected_greedy": evaluate_checkpoint(selected, split="dev"),
        f"selected_beam{args.beam}": evaluate_checkpoint(
            selected, overrides=["search.beam_width=%d" % args.beam], split="dev"
        ),
        "last_greedy": evaluate_checkpoint(out["final_checkpoint"], split="dev"),
        "untrained_greedy": evaluate_checkpoint("none", cfg, split="dev"),  # the paper's: full-vector cosine
        "untrained_halfvector_greedy": evaluate_checkpoint(
            "none:twin", cfg, split="dev"
        ),  # extra: mean of half cosines
    }
    for value in evals.values():
        value.pop("search", None)
    episodes = cfg.updates * cfg.learner.episodes_per_update
    result = {
        "benchmark": "hotpot_quality",
        "config": args.config,
        "overrides": args.overrides,
        "resolved_config": to_dict(cfg),
        "train_questions": len(run.train_tok),
        "val_questions": len(run.val_tok),
        "dev_questions": len(run.dev_tok),
        "episodes": episodes,
        "train_seconds": train_s,
        "selected_checkpoint": selected,
        "dev": evals,
        "learning_curve": curve,
        "paper": PAPER,
        **machine_info(),
    }
    write_result(args.out, result)
    summary = {k: {m: round(v[m], 4) for m in ("fact_em", "fact_f1")} for k, v in evals.items()}
    print(json.dumps({"train_seconds": round(train_s, 1), "dev": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
