"""Where qrag keeps what it derives once and reuses (dequantised readers, unpacked encoders)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str | None = None) -> Path:
    """``cache_dir``, else ``$QRAG_CACHE_DIR``, else ``~/.cache/qrag``."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("QRAG_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "qrag"
