"""Command-line options of Ray training jobs and sweeps, shared by ``qrag train --ray``,
``qrag sweep``, ``jobs/`` and ``tune/``. argparse only: ``qrag --help`` builds them without Ray."""

from __future__ import annotations

import argparse

SWEEP_DESCRIPTION = (
    "Sweep hyperparameters of Q-RAG training with Ray Tune (ASHA on the validation metric), "
    "every trial an MLflow run under one parent. Starting a sweep again resumes it."
)


def add_cluster_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup, when: str = "") -> None:
    """``--address`` and ``--base-dir``; ``when`` prefixes their help (e.g. "with --ray: ")."""
    p.add_argument(
        "--address",
        metavar="HOST:PORT",
        help=f"{when}Ray cluster to use (default $RAY_ADDRESS, else start a local one on 127.0.0.1)",
    )
    p.add_argument(
        "--base-dir",
        metavar="DIR",
        help=f"{when}resolve relative paths (out_dir, data.path, ...) against DIR (default: "
        "inputs against the current directory; out_dir against it with a local Ray, against $RAY_STORAGE or "
        "~/ray_results when joining a cluster, e.g. under `ray job submit`)",
    )


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="YAML", help="sweep file, e.g. tune/hotpot_alpha_lambda_tau.yaml")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="training config overrides for every trial, e.g. model.encoder=DIR",
    )
    p.add_argument("--name", help="sweep name (default: the file's `name`, else its file name)")
    p.add_argument("--trials", type=int, metavar="N", help="draws from the space (default: the file's `trials`)")
    p.add_argument(
        "--max-concurrent", type=int, metavar="N", help="trials at once (default: the file's `max_concurrent`)"
    )
    add_cluster_arguments(p)
    p.add_argument(
        "--local",
        action="store_true",
        help="no Ray: run the trials one after another in this process (the same stopping rule; no MLflow)",
    )
