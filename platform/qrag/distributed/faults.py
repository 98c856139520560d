"""Fault injection for the failure tests: ``distributed.fail_at_update`` and ``kill_runner_at_update``.

Each fault fires once per run: it claims a marker file in ``<run>/.faults/`` first, so the
restarted learner or runner does not fail again. (Runs in URI storage get no faults.)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from qrag.config import TrainConfig


def claim_once(marker: str | None) -> bool:
    """True the first time ``marker`` is claimed (atomic across processes)."""
    if marker is None:
        return False
    Path(marker).parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def hard_exit(message: str) -> None:
    """Die like a crash: no clean-up, no exception for anyone to catch."""
    sys.stderr.write(f"fault injection: {message}\n")
    sys.stderr.flush()
    os._exit(1)


class FaultPlan:
    def __init__(self, cfg: TrainConfig, run_dir: str):
        self.d = cfg.distributed
        self.batch_size = cfg.learner.episodes_per_update
        self.folder = None if "://" in run_dir else Path(run_dir) / ".faults"

    def marker(self, name: str) -> str | None:
        return None if self.folder is None else str(self.folder / name)

    def before_update(self, done: int) -> None:
        """The learner calls this with the number of updates done, before asking for episodes."""
        at = self.d.fail_at_update
        if at and done == at and claim_once(self.marker(f"learner_after_{at}")):
            hard_exit(f"the learner exits after update {done}")

    def runner_crash(self, runners: int, per_request: int) -> tuple[int | None, str | None]:
        """(request number, marker) at which runner 0 dies: its first request that holds episodes
        of the update after ``kill_runner_at_update``. Requests in flight die with it."""
        at = self.d.kill_runner_at_update
        if not at or self.folder is None:
            return None, None
        first = at * self.batch_size // per_request
        first += -first % runners  # runner 0 serves the requests j with j % runners == 0
        return first // runners, self.marker(f"runner0_after_{at}")
