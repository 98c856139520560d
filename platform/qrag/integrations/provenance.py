"""What a measured result records about where it was measured: machine, GPU, commit, date, and
whether the code that ran was the commit's (the dirty flag and a hash of the difference).

On a machine whose copy of the checkout has no ``.git`` the state comes from the environment,
as ``python -m qrag.integrations.provenance --env`` prints it where the ``.git`` is::

    PYTHONPATH=platform python -m qrag.integrations.provenance --env > .carry/provenance.env   # here
    set -a; . .carry/provenance.env; set +a                                                      # there
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import hashlib
import json
import os
import sys
import platform as _platform
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]  # platform/qrag/integrations/provenance.py -> the checkout


def git_commit() -> str | None:
    """``$QRAG_COMMIT`` (set it where the checkout has no .git, e.g. a copied working tree), else
    the checkout's HEAD, else None. Whether the tree differs from it: :func:`git_state`."""
    return git_state()["commit"]


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, timeout=30, check=True).stdout


@functools.lru_cache(maxsize=1)
def _checkout_state() -> tuple[str | None, bool | None, str | None]:
    """(HEAD, dirty, diff hash) of the checkout, read once per process (what this process runs)."""
    try:
        commit = _git("rev-parse", "HEAD").decode().strip() or None
        diff = _git("diff", "HEAD", "--binary")
        untracked = sorted(
            p for p in _git("ls-files", "--others", "--exclude-standard", "-z").decode().split("\0") if p
        )
    except (OSError, subprocess.SubprocessError):
        return None, None, None
    if not diff and not untracked:
        return commit, False, None
    # Tracked changes and every untracked file that would travel with the tree: the same commit
    # and hash ran the same code.
    digest = hashlib.sha256(diff)
    for rel in untracked:
        try:
            digest.update(b"\0" + rel.encode() + b"\0" + (REPO / rel).read_bytes())
        except OSError:
            digest.update(b"\0" + rel.encode() + b"\0<unreadable>")
    return commit, True, digest.hexdigest()


def git_state() -> dict[str, Any]:
    """``{"commit", "dirty", "diff_sha256"}``: HEAD; whether tracked files differ from it or
    untracked (not ignored) files exist; a SHA-256 of that difference (None when clean). From
    ``$QRAG_COMMIT``, ``$QRAG_DIRTY`` (1/0) and ``$QRAG_DIFF_SHA256`` when ``$QRAG_COMMIT`` is set
    (dirty unknown, None, when ``$QRAG_DIRTY`` is not)."""
    env = os.environ.get("QRAG_COMMIT")
    if env:
        flag = os.environ.get("QRAG_DIRTY")
        return {
            "commit": env,
            "dirty": None if flag is None else flag.strip() not in ("", "0", "false"),
            "diff_sha256": os.environ.get("QRAG_DIFF_SHA256") or None,
        }
    commit, dirty, diff = _checkout_state()
    return {"commit": commit, "dirty": dirty, "diff_sha256": diff}


def git_fields() -> dict[str, Any]:
    """:func:`git_state` as a result file's ``git_commit``, ``git_dirty`` and ``git_diff_sha256``."""
    return {f"git_{key}": value for key, value in git_state().items()}


def env_lines() -> str:
    """The checkout's state as ``KEY=value`` lines for a machine whose copy has no .git."""
    state = git_state()
    dirty = {True: "1", False: "0", None: ""}[state["dirty"]]
    return f"QRAG_COMMIT={state['commit'] or ''}\nQRAG_DIRTY={dirty}\nQRAG_DIFF_SHA256={state['diff_sha256'] or ''}\n"


def machine_info() -> dict[str, Any]:
    import torch

    info = {
        "machine": _platform.node() or "unknown",
        "cpu_count": os.cpu_count(),
        "python": _platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "commit": git_commit() or "unknown",
        "dirty": git_state()["dirty"],
        "diff_sha256": git_state()["diff_sha256"],
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        # Whether this process may cache compiled imports: where it may not (PYTHONDONTWRITEBYTECODE),
        # every start compiles torch's and transformers' modules again, and start-up figures read slow.
        "bytecode_cache": "off" if sys.dont_write_bytecode else (sys.pycache_prefix or "beside the sources"),
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The checkout's commit, dirty flag and diff hash.")
    p.add_argument(
        "--env", action="store_true", help="print KEY=value lines (QRAG_COMMIT, QRAG_DIRTY, QRAG_DIFF_SHA256)"
    )
    args = p.parse_args(argv)
    print(env_lines() if args.env else json.dumps(git_state()), end="" if args.env else "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
