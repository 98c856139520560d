"""The Ray Serve application as an installed import path, for ``serve run`` and ``serve deploy``:

    serve run qrag.distributed.serve_app:build                          # defaults, loopback
    serve run qrag.distributed.serve_app:build checkpoint=runs/hotpot/final shards=4
    serve run serve/config.yaml                                         # its import_path is this builder

``args`` are keys of :class:`qrag.serving.service_config.ServeConfig`; the web page comes from
the package's ``qrag/static/``, so a pip install needs no checkout. With ``QRAG_SERVE_JSON_LOGS=1``
every deployment logs JSON (Serve's ``LoggingConfig(encoding="JSON")``), as ``qrag serve --log-json`` does.
"""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from qrag.config import choices, from_dict
from qrag.distributed.serving import build_app, deployment_names
from qrag.serving.http_api import static_files
from qrag.serving.service_config import ServeConfig

STATIC_DIR = Path(__file__).resolve().parents[1] / "static"
JSON_LOGS_ENV = "QRAG_SERVE_JSON_LOGS"


def typed_args(args: dict[str, Any] | None) -> dict[str, Any]:
    """``serve run ... key=value`` hands every value over as a string: those of fields that are not
    strings are read as YAML scalars, as ``qrag`` reads its key=value overrides."""
    hints = typing.get_type_hints(ServeConfig)

    def takes_text(hint: Any) -> bool:
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            return any(takes_text(arg) for arg in typing.get_args(hint))
        return hint is str or bool(choices(hint))

    return {
        k: yaml.safe_load(v) if isinstance(v, str) and k in hints and not takes_text(hints[k]) else v
        for k, v in (args or {}).items()
    }


def json_logs_asked() -> bool:
    return os.environ.get(JSON_LOGS_ENV, "").strip().lower() in ("1", "true", "yes", "json")


def with_logging(
    deployments: Sequence[Mapping[str, Any]],
    shard_deployments: int,
    logging_config: Mapping[str, Any] | None,
    json_logs: bool = False,
) -> list[dict[str, Any]]:
    """A ``deployments:`` list in which every deployment of the app gets ``logging_config`` (a
    Serve config's app-level key), with ``encoding: JSON`` when ``json_logs``; an entry's own
    ``logging_config`` wins, as in Serve."""
    app_level = {**(logging_config or {}), **({"encoding": "JSON"} if json_logs else {})}
    entries = {str(d.get("name")): dict(d) for d in deployments}
    if app_level:
        for name in deployment_names(shard_deployments):
            entry = entries.setdefault(name, {"name": name})
            entry["logging_config"] = {**app_level, **(entry.get("logging_config") or {})}
    return list(entries.values())


def build(args: dict[str, Any] | None = None) -> Any:
    """Serve's application builder: the config's ``args`` (or ``serve run``'s key=value) -> the app."""
    cfg = from_dict(ServeConfig, typed_args(args))
    return build_app(cfg, static_files(STATIC_DIR), with_logging([], cfg.shard_deployments, None, json_logs_asked()))
