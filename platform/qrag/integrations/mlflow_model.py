"""A checkpoint as an MLflow pyfunc model: questions + chunks in, retrieved steps out.

The model directory holds the inference checkpoint as the artifact ``checkpoint`` (online
encoders, tokenizer, config: what ``qrag eval`` and ``qrag serve`` load), so the same MLflow
model serves two ways:

* ``mlflow.pyfunc.load_model("models:/<name>@<alias>").predict([{"question": ..., "chunks": [...]}])``
  runs ``qrag.retrieval.search.Retriever`` over each row's chunks (params ``max_steps``, ``beam_width``,
  ``beam_score``);
* ``qrag serve --checkpoint models:/<name>@<alias>`` downloads it and finds the checkpoint inside
  (``qrag.retrieval.embedder.resolve_source``).

The model is portable: qrag's source goes with it (``code_paths``: MLflow puts it on ``sys.path``
at load) and its pip requirements are the packages that code imports, pinned to this
environment's versions, so ``mlflow models serve -m models:/<name>@<alias>`` restores an
environment that needs no qrag install (qrag is on no package index).

mlflow (skinny is enough) is imported by this module only.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import pandas as pd
from mlflow.models import ModelSignature
from mlflow.types.schema import Array, ColSpec, Object, ParamSchema, ParamSpec, Property, Schema

ARTIFACT = "checkpoint"
MODEL_PATH = "model"  # where a run keeps its model (runs:/<run_id>/model)
ENTRY = Path(__file__).with_name("mlflow_pyfunc_entry.py")  # models from code: nothing pickled
PACKAGE = Path(__file__).resolve().parents[1]  # the qrag package, logged with the model
# What the pyfunc and the qrag modules it loads import (tests/test_mlflow_portable.py runs it
# in a virtualenv holding only these).
RUNTIME_PACKAGES = (
    "mlflow-skinny",
    "pandas",
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "pyyaml",
    "tqdm",
)


def pip_requirements() -> list[str]:
    """The model's requirements, pinned to the versions here; a local label (torch's +cpu) is
    dropped, since the index holds the plain release (the CUDA build, on Linux)."""
    return [f"{name}=={version(name).split('+')[0]}" for name in RUNTIME_PACKAGES]


def signature(max_steps: int, beam_width: int, beam_score: str) -> ModelSignature:
    step = Object([Property("chunk", "long"), Property("text", "string"), Property("q", "double")])
    return ModelSignature(
        inputs=Schema([ColSpec("string", "question"), ColSpec(Array("string"), "chunks")]),
        outputs=Schema([ColSpec(Array(step), "steps"), ColSpec("boolean", "stopped_early")]),
        params=ParamSchema(
            [
                ParamSpec("max_steps", "long", max_steps),
                ParamSpec("beam_width", "long", beam_width),
                ParamSpec("beam_score", "string", beam_score),  # min | last | logprob (qrag.retrieval.multistep)
            ]
        ),
    )


def _rows(model_input: Any) -> list[dict[str, Any]]:
    """A DataFrame (what pyfunc makes of most inputs), a list of dicts or one dict -> rows."""
    if hasattr(model_input, "to_dict"):
        return model_input.to_dict(orient="records")
    if isinstance(model_input, dict):
        return [model_input]
    return list(model_input)


class RetrieverModel(mlflow.pyfunc.PythonModel):
    """Multi-step retrieval over the chunks given with each question (document order)."""

    def load_context(self, context) -> None:
        from qrag.model.checkpoint import load_qnet
        from qrag.model.encoder import pick_device
        from qrag.retrieval.search import Retriever

        device = pick_device("auto")
        qnet, self.tokenizer, self.layout, self.cfg = load_qnet(context.artifacts[ARTIFACT], device, with_targets=False)
        self.retriever = Retriever(qnet, self.layout, device, self.cfg.learner.encode_tokens)

    # A DataFrame hint: what pyfunc hands over after checking the signature (and no second,
    # type-hint-inferred schema).
    def predict(self, context, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        import dataclasses

        from qrag.data.sample import Sample
        from qrag.data.tokens import tokenize_samples

        params = params or {}
        search = dataclasses.replace(
            self.cfg.search,
            max_steps=int(params.get("max_steps", self.cfg.search.max_steps)),
            beam_width=int(params.get("beam_width", self.cfg.search.beam_width)),
            beam_score=str(params.get("beam_score", self.cfg.search.beam_score)),
        )
        rows = _rows(model_input)
        samples = [Sample(str(i), str(r["question"]), [str(c) for c in r["chunks"]], []) for i, r in enumerate(rows)]
        d = self.cfg.data
        tokenized = tokenize_samples(
            samples, self.tokenizer, self.layout, chunk_tokens=d.chunk_tokens, question_tokens=d.question_tokens
        )
        out = []
        for sample, found in zip(samples, self.retriever.retrieve(tokenized, search)):
            steps = [{"chunk": s.chunk, "text": sample.chunks[s.chunk], "q": float(s.q)} for s in found.steps]
            out.append({"steps": steps, "stopped_early": bool(found.stopped_early)})
        return out


def save_model(checkpoint: str | Path, path: str | Path) -> Path:
    """Write the pyfunc model of ``checkpoint`` to ``path``; of a full checkpoint only the
    inference part goes in (no targets, no optimiser)."""
    from qrag.model.checkpoint import load_run_config
    from qrag.model.checkpoint import INFERENCE_PARTS

    cfg = load_run_config(checkpoint)
    with (
        tempfile.TemporaryDirectory(prefix="qrag-inference-") as tmp,
        tempfile.TemporaryDirectory(prefix="qrag-code-") as code,
    ):
        for name in INFERENCE_PARTS:
            part = Path(checkpoint) / name
            if part.is_dir():
                shutil.copytree(part, Path(tmp) / name)
            elif part.is_file():
                shutil.copy2(part, Path(tmp) / name)
        shutil.copytree(PACKAGE, Path(code) / PACKAGE.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a job log is no terminal
        with warnings.catch_warnings():
            # The signature is given (no input example to run) and predict's rows are dicts, not typed.
            warnings.filterwarnings("ignore", message=".*(input_example|type hints).*")
            mlflow.pyfunc.save_model(
                path=str(path),
                python_model=str(ENTRY),
                artifacts={ARTIFACT: tmp},
                code_paths=[str(Path(code) / PACKAGE.name)],
                signature=signature(cfg.search.max_steps, cfg.search.beam_width, cfg.search.beam_score),
                # Explicit: inferring them would import and time the model in a subprocess.
                pip_requirements=pip_requirements(),
            )
    return Path(path)


def log_model(client, run_id: str, checkpoint: str | Path) -> str:
    """Log ``checkpoint`` as the run's pyfunc model; its ``runs:/`` URI."""
    with tempfile.TemporaryDirectory(prefix="qrag-mlflow-model-") as tmp:
        save_model(checkpoint, Path(tmp) / MODEL_PATH)
        client.log_artifacts(run_id, str(Path(tmp) / MODEL_PATH), MODEL_PATH)
    return f"runs:/{run_id}/{MODEL_PATH}"


def register(client, run_id: str, name: str, alias: str | None = None) -> str:
    """Register the run's model under ``name`` (creating it if new), point ``alias`` at the new
    version; the version number."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if "RESOURCE_ALREADY_EXISTS" not in str(exc.error_code):
            raise
    source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{MODEL_PATH}"
    version = client.create_model_version(name, source, run_id=run_id).version
    if alias:
        client.set_registered_model_alias(name, alias, version)
    return str(version)
