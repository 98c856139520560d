"""Sweep α, λ, τ (and friends) of Q-RAG training with Ray Tune; every trial an MLflow run.

    python tune/sweep.py --config tune/hotpot_alpha_lambda_tau.yaml [key=value ...]   # starts a local Ray on 127.0.0.1
    ray job submit --working-dir . -- \
        python tune/sweep.py --config tune/hotpot_alpha_lambda_tau.yaml   # lands in ~/ray_results
    python tune/sweep.py --local --config tune/smoke.yaml                              # no Ray: trials one by one

Starting the same sweep again resumes it. `--help` lists the options; the sweep file's keys are
described in platform/qrag/distributed/sweep/spec.py and docs/sweeps.md. The same from an
installed qrag: `qrag sweep --config SWEEP.yaml`.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

from qrag.distributed.sweep.driver import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
