"""What a measured result records about where it was measured: machine, GPU, commit, date."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform as _platform
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]  # platform/qrag/integrations/provenance.py -> the checkout


def git_commit() -> str | None:
    """``$QRAG_COMMIT`` (set it where the checkout has no .git, e.g. a copied working tree), else
    the checkout's HEAD, else None."""
    env = os.environ.get("QRAG_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5, check=True)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict[str, Any]:
    import torch

    info = {
        "machine": _platform.node() or "unknown",
        "cpu_count": os.cpu_count(),
        "python": _platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "commit": git_commit() or "unknown",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def write_json(path: str | os.PathLike, result: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
