"""The Ray Serve retrieval app, for `serve run serve/config.yaml` and `serve deploy`.

Thin on purpose: the config's `args` (keys of qrag.serving.service_config.ServeConfig) go to
qrag.distributed.serving.build_app together with the web page's files beside this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qrag.distributed.serving import build_app_from_args

STATIC_DIR = Path(__file__).resolve().parent / "static"


def build(args: dict[str, Any]):
    return build_app_from_args(args, STATIC_DIR)
