"""``qrag serve``: the Ray Serve retriever on this machine (local Ray on loopback), in one command."""

from __future__ import annotations

import argparse
from pathlib import Path

from qrag.config import ConfigError, apply_overrides, describe, from_dict, read_yaml
from qrag.serving.service_config import INGRESSES, ServeConfig
from qrag.cli.commands import command

REPO_STATIC = Path(__file__).resolve().parents[1] / "static"  # package data (serve/static links here)


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        metavar="DIR|URI",
        help="checkpoint directory or MLflow URI (runs:/..., models:/...); default: the untrained bundled encoder",
    )
    p.add_argument(
        "--config",
        metavar="YAML",
        help="a Serve config such as serve/config.yaml: its first application's args are the defaults, "
        "its deployments: section sets replicas, autoscaling, GPUs and request limits",
    )
    p.add_argument("--storage", metavar="DIR", help="where corpora are persisted (default qrag_indexes)")
    p.add_argument("--shards", type=int, metavar="N", help="index-shard deployments (default 2)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP host (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument(
        "--ingress",
        choices=INGRESSES,
        default=None,
        help="HTTP ingress: Serve's HAProxy ingress (HAProxy on --port, each Ingress replica serving HTTP "
        "itself behind it; qrag[ray] installs it on Linux) or Serve's Python proxy. Default: HAProxy "
        "where it can start (on a running cluster: nodes started with RAY_SERVE_ENABLE_HA_PROXY=1), else the "
        "proxy, saying why",
    )
    p.add_argument("--static", default=str(REPO_STATIC), help="folder of the web page (default: the one qrag ships)")
    p.add_argument(
        "--log-json",
        action="store_true",
        help="structured logs: every deployment logs JSON lines (Serve's "
        "logging_config encoding JSON; also $QRAG_SERVE_JSON_LOGS=1, "
        "or logging_config: {encoding: JSON} in the --config file's application)",
    )
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="ServeConfig overrides, e.g. state_batch_size=64 max_steps=8"
    )
    width = max(len(k) for k, _, _ in describe(ServeConfig))
    p.epilog = "serve keys:\n" + "\n".join(
        f"  {k.ljust(width)}  {h} [default {d}]" for k, d, h in describe(ServeConfig)
    )
    p.formatter_class = argparse.RawDescriptionHelpFormatter


def serve_config(args: argparse.Namespace) -> ServeConfig:
    data: dict = {}
    if args.config:
        apps = read_yaml(args.config).get("applications") or [{}]
        data = dict(apps[0].get("args") or {})
    overrides = list(args.overrides)
    for key, value in (("checkpoint", args.checkpoint), ("storage", args.storage), ("shards", args.shards)):
        if value is not None:
            overrides.append(f"{key}={value}")
    try:
        return from_dict(ServeConfig, apply_overrides(data, overrides))
    except ConfigError as exc:
        raise ConfigError(f"serve config: {exc}") from None


def serve_deployments(args: argparse.Namespace) -> list[dict]:
    """The ``deployments:`` section of the --config file's first application (Serve's options
    per deployment name), applied as ``serve run`` would."""
    if not args.config:
        return []
    apps = read_yaml(args.config).get("applications") or [{}]
    deployments = apps[0].get("deployments") or []
    if not isinstance(deployments, list):
        raise ConfigError(f"serve config {args.config}: deployments must be a list of {{name: ..., options}}")
    return deployments


def serve_logging_config(args: argparse.Namespace) -> dict | None:
    """The --config file's app-level ``logging_config`` (Serve's LoggingConfig keys), which
    ``serve run`` applies to every deployment of the app."""
    if not args.config:
        return None
    logging_config = (read_yaml(args.config).get("applications") or [{}])[0].get("logging_config")
    if logging_config is not None and not isinstance(logging_config, dict):
        raise ConfigError(f"serve config {args.config}: logging_config must be a mapping of Serve's LoggingConfig keys")
    return logging_config


@command("serve", "serve a retriever over HTTP with Ray Serve (local Ray, loopback)")(_args)
def cmd_serve(args: argparse.Namespace) -> int:
    cfg = serve_config(args)
    deployments = serve_deployments(args)
    from qrag.retrieval.embedder import resolve_source  # noqa: PLC0415

    resolve_source(
        cfg.checkpoint, cfg.encoder, cfg.model_cache, cfg.mlflow_tracking_uri
    )  # a bad checkpoint fails here, before Ray starts
    from qrag.distributed.serve_app import json_logs_asked, with_logging  # noqa: PLC0415 (Ray lives under qrag.distributed)
    from qrag.distributed.serving import serve_locally  # noqa: PLC0415

    deployments = with_logging(
        deployments, cfg.shard_deployments, serve_logging_config(args), args.log_json or json_logs_asked()
    )
    serve_locally(cfg, args.host, args.port, args.static, deployments, ingress=args.ingress)
    return 0
