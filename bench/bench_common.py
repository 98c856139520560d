"""What every benchmark result records: machine, GPU, commit, date (from the library, which
records the same in the tables it writes)."""

from __future__ import annotations

from pathlib import Path

from qrag.integrations.provenance import git_commit, machine_info
from qrag.integrations.provenance import write_json as write_result

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ROOT", "git_commit", "machine_info", "write_result"]
