"""Train a Q-RAG retriever on BabiLong (one bAbI task or a mix) on Ray: EpisodeFeeder actors feed a
Ray Train learner; MLflow tracks the run.

    ray job submit --working-dir . -- \
        python jobs/train_babilong.py --tasks qa3 [key=value ...]   # runs land in ~/ray_results
    python jobs/train_babilong.py --tasks qa1,qa2,qa3 [--config YAML] [key=value ...]   # local Ray on 127.0.0.1

Default preset: configs/babilong-qa3.yaml (relative chunk positions, 2K-token training contexts).
``--tasks`` is short for the override ``data.tasks=[...]``; a mix trains on all its tasks at once
(name the run with ``name=...``). `--help` lists every option and config key.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))


def tasks_to_overrides(argv: list[str]) -> list[str]:
    """``--tasks qa1,qa2`` (or ``--tasks=qa1,qa2``) -> the override ``data.tasks=[qa1,qa2]``."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--tasks" and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        elif arg.startswith("--tasks="):
            value, i = arg.split("=", 1)[1], i + 1
        else:
            out.append(arg)
            i += 1
            continue
        names = [t.strip() for t in value.split(",") if t.strip()]
        out.append(f"data.tasks=[{','.join(names)}]")
    return out


def main(argv: list[str]) -> int:
    from qrag.distributed.job import run_job

    return run_job(tasks_to_overrides(argv), str(ROOT / "configs" / "babilong-qa3.yaml"))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
