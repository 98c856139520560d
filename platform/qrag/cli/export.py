"""``qrag export``: a checkpoint as a sentence-transformers model or an MLflow pyfunc model."""

from __future__ import annotations

import argparse
import json

from qrag.cli.commands import command

FORMATS = ("sentence-transformers", "mlflow")


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a checkpoint directory (final/, best/, ...)")
    p.add_argument(
        "--format",
        required=True,
        choices=FORMATS,
        help="sentence-transformers: query (state) and document (chunk) encoders with pooling and a model "
        "card, for checkpoints without positions | mlflow: the pyfunc model that runs log (mlflow.pyfunc.load_model)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="a new or empty directory")


@command("export", "export a checkpoint for other tools (sentence-transformers, MLflow)")(_export_args)
def cmd_export(args: argparse.Namespace) -> int:
    if args.format == "sentence-transformers":
        try:
            from qrag.integrations.st_export import export_sentence_transformers
        except ImportError as exc:
            raise FileNotFoundError(
                f"--format sentence-transformers needs sentence-transformers (pip install 'qrag[st]'): {exc}"
            ) from None
        out = export_sentence_transformers(args.checkpoint, args.out)
    else:
        from qrag.model.checkpoint import read_meta
        from qrag.integrations.mlflow_model import save_model

        read_meta(args.checkpoint)  # a clear error when it is not a checkpoint
        out = save_model(args.checkpoint, args.out)
    print(json.dumps({"format": args.format, "out": str(out)}))
    return 0
