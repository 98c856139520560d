"""`make demo`: train through Ray on embedded defaults, then compare with the untrained encoder.

Starts a local Ray on 127.0.0.1 and runs the main training job (`qrag.distributed.job`, what
`jobs/train_hotpot.py` runs) on the `configs/smoke.yaml` preset: EpisodeFeeder actors load and
tokenise the shipped HotpotQA subset, a Ray Train worker trains the bundled MiniLM, MLflow
records the run in runs/mlflow.db. Then it evaluates the untrained encoder (the paper's
"multi-step RAG w/o FT") on the same dev questions and prints both.
Extra arguments are config overrides, e.g. `python jobs/demo.py updates=10`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

from qrag.distributed.job import USER_ERRORS, launch, prepare  # noqa: E402
from qrag.evaluation.evaluate import evaluate_checkpoint  # noqa: E402

SMOKE = str(ROOT / "configs" / "smoke.yaml")


def main(argv: list[str]) -> int:
    # The learner gets the machine's cores for torch; the runners only tokenise, once, at start.
    cores = min(4, os.cpu_count() or 1)
    defaults = [f"distributed.learner_cpus={cores}", "distributed.runner_cpus=0.5"]
    try:
        job = prepare(["--config", SMOKE, *defaults, *argv], SMOKE, prog="demo")
    except USER_ERRORS as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 2
    trained = launch(job)
    run_dir = Path(trained["run_dir"])
    untrained = evaluate_checkpoint("none", job.cfg, out=run_dir / "eval_untrained.json")
    print()
    print(f"{'model':<28}{'fact_em':>9}{'fact_f1':>9}{'questions':>11}")
    rows = (
        ("Q-RAG (smoke-trained)", trained["fact_em"], trained["fact_f1"], trained["eval_questions"]),
        ("untrained encoder (w/o FT)", untrained["fact_em"], untrained["fact_f1"], untrained["num_samples"]),
    )
    for name, em, f1, n in rows:
        print(f"{name:<28}{em:>9.3f}{f1:>9.3f}{n:>11}")
    if trained.get("mlflow_run_id"):
        print(
            f"\nMLflow: run {trained['mlflow_run_id']} in {trained['tracking_uri']}; "
            "to browse it (needs `pip install mlflow`):\n"
            f"  mlflow ui --backend-store-uri {trained['tracking_uri']} --host 127.0.0.1 --port 5000"
        )
    print(
        json.dumps(
            {
                "checkpoint": trained["checkpoint"],
                "trained": trained["fact_em"],
                "untrained": untrained["fact_em"],
                "mlflow_run_id": trained.get("mlflow_run_id"),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
