"""``qrag sweep``: hyperparameter sweeps with Ray Tune (``--local``: without Ray), what
``tune/sweep.py`` runs (:mod:`qrag.distributed.sweep.driver`)."""

from __future__ import annotations

import argparse

from qrag.cli.commands import command, distributed
from qrag.distributed.options import add_sweep_arguments


@command("sweep", "sweep training settings with Ray Tune, every trial an MLflow run; resumable (--local: without Ray)")(
    add_sweep_arguments
)
def cmd_sweep(args: argparse.Namespace) -> int:
    return distributed("sweep.driver", needs_ray=not args.local).run(args, "qrag sweep")
