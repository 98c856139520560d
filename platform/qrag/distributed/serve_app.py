"""The Ray Serve application as an installed import path, for ``serve run`` and ``serve deploy``:

    serve run qrag.distributed.serve_app:build                          # defaults, loopback
    serve run qrag.distributed.serve_app:build checkpoint=runs/hotpot/final shards=4
    serve run serve/config.yaml                                         # its import_path is this builder

``args`` are keys of :class:`qrag.serving.service_config.ServeConfig`; the web page comes from
the package's ``qrag/static/``, so a pip install needs no checkout.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any

import yaml

from qrag.config import choices
from qrag.distributed.serving import build_app_from_args
from qrag.serving.service_config import ServeConfig

STATIC_DIR = Path(__file__).resolve().parents[1] / "static"


def typed_args(args: dict[str, Any] | None) -> dict[str, Any]:
    """``serve run ... key=value`` hands every value over as a string: those of fields that are not
    strings are read as YAML scalars, as ``qrag`` reads its key=value overrides."""
    hints = typing.get_type_hints(ServeConfig)

    def takes_text(hint: Any) -> bool:
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            return any(takes_text(arg) for arg in typing.get_args(hint))
        return hint is str or bool(choices(hint))

    return {k: yaml.safe_load(v) if isinstance(v, str) and k in hints and not takes_text(hints[k]) else v
            for k, v in (args or {}).items()}


def build(args: dict[str, Any] | None = None) -> Any:
    """Serve's application builder: the config's ``args`` (or ``serve run``'s key=value) -> the app."""
    return build_app_from_args(typed_args(args), STATIC_DIR)
