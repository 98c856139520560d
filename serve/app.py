"""The Ray Serve retrieval app as a file of this checkout (``serve run serve.app:build``): a thin
wrapper of the installed builder, ``qrag.distributed.serve_app:build``, which serve/config.yaml names."""

from __future__ import annotations

from qrag.distributed.serve_app import STATIC_DIR, build

__all__ = ["STATIC_DIR", "build"]
