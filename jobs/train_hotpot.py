"""Train a Q-RAG retriever on HotpotQA on Ray (EpisodeFeeder actors + a Ray Train learner, MLflow).

    ray job submit --working-dir . -- \
        python jobs/train_hotpot.py [--config YAML] [key=value ...]   # runs land in ~/ray_results
    python jobs/train_hotpot.py [--config YAML] [key=value ...]     # starts a local Ray on 127.0.0.1

Default preset: configs/hotpot.yaml. `--help` lists every option and config key. The same job
from an installed qrag, without this checkout: `qrag train --ray --config configs/hotpot.yaml`.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))

from qrag.distributed.job import run_job  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(run_job(sys.argv[1:], str(ROOT / "configs" / "hotpot.yaml")))
