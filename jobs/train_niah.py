"""Train a Q-RAG retriever on the RULER needle-in-a-haystack mix (S1-S3, MK1-MK3, MV, MQ) on Ray.

    ray job submit --working-dir . -- python jobs/train_niah.py [key=value ...]   # runs land in ~/ray_results
    python jobs/train_niah.py [--tasks S1,MK2] [--config YAML] [key=value ...]   # local Ray on 127.0.0.1

Default preset: configs/niah.yaml (all eight tasks, relative chunk positions, 2K-token contexts).
``--tasks`` restricts the mix (RULER names or S1/S2/S3/MK1/MK2/MK3/MV/MQ).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "jobs"))


def main(argv: list[str]) -> int:
    from qrag.distributed.job import run_job
    from train_babilong import tasks_to_overrides

    return run_job(tasks_to_overrides(argv), str(ROOT / "configs" / "niah.yaml"))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
