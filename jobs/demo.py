"""`make demo`: train on embedded defaults, then compare with the untrained encoder.

Trains the `configs/smoke.yaml` preset on the shipped HotpotQA subset with the bundled MiniLM,
then evaluates the trained checkpoint and the untrained encoder (the paper's "multi-step RAG
w/o FT") on the same dev questions, and prints both.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

from qrag.config import load_config  # noqa: E402
from qrag.evaluate import evaluate_checkpoint  # noqa: E402
from qrag.train import TrainingRun, print_reporter  # noqa: E402


def main(argv: list[str]) -> int:
    cfg = load_config(ROOT / "configs" / "smoke.yaml", argv)
    run = TrainingRun(cfg)
    print(f"demo: training {cfg.updates} updates x {cfg.learner.episodes_per_update} episodes on "
          f"{len(run.train_tok)} HotpotQA questions ({run.device})", flush=True)
    out = run.run(report=print_reporter)
    limit = cfg.eval_limit
    trained = evaluate_checkpoint(out["checkpoint"], limit=limit, out=Path(out["run_dir"]) / "eval_trained.json")
    untrained = evaluate_checkpoint("none", cfg, limit=limit, out=Path(out["run_dir"]) / "eval_untrained.json")
    print()
    print(f"{'model':<28}{'fact_em':>9}{'fact_f1':>9}{'questions':>11}")
    for name, s in (("Q-RAG (smoke-trained)", trained), ("untrained encoder (w/o FT)", untrained)):
        print(f"{name:<28}{s['fact_em']:>9.3f}{s['fact_f1']:>9.3f}{s['num_samples']:>11}")
    print(json.dumps({"checkpoint": out["checkpoint"], "trained": trained["fact_em"], "untrained": untrained["fact_em"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
