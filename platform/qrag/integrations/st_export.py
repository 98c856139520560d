"""A checkpoint without positions as a sentence-transformers model, for existing retrieval stacks.

The export is one ``SentenceTransformer`` whose ``Router`` sends queries through the state
encoder and documents through the action (chunk) encoder, each followed by mean pooling and the
checkpoint's normalisation, so ``encode_query`` / ``encode_document`` give the vectors
``qrag.retrieval.search.Retriever`` scores with (``similarity_fn_name: dot``): a one-step retrieval.
Multi-step retrieval (states that hold the chunks picked so far) and RoPE positions need qrag.

* ``model.normalize: false``: Transformer -> mean Pooling.
* ``model.similarity: cosine``: ... -> Normalize -> Dense(sqrt(2) I) (our vectors have length sqrt(2)).
* ``model.similarity: twin`` (Q-RAG's default): ... -> ``TwinNormalize`` (each half unit-length),
  a module shipped as code inside the export: load with ``trust_remote_code=True``.

Token budgets are the run's: queries ``data.question_tokens``, documents ``data.chunk_tokens``
(plus the special tokens), as the learner tokenised them. README.md is a model card with the
training config and the run's evaluation.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import yaml

from qrag.model.checkpoint import CheckpointError, load_run_config, read_meta
from qrag.config import ModelConfig, from_dict, to_dict

TWIN_MODULE = "qrag_twin_normalize"  # the file name of st_twin_normalize.py inside an export


def _twin_module_class():
    """TwinNormalize imported under the name it has inside an export (ST records class paths)."""
    import importlib.util
    import sys

    if TWIN_MODULE not in sys.modules:
        spec = importlib.util.spec_from_file_location(TWIN_MODULE, Path(__file__).with_name("st_twin_normalize.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[TWIN_MODULE] = module
        spec.loader.exec_module(module)
    return sys.modules[TWIN_MODULE].TwinNormalize


def _route(encoder_dir: Path, tokenizer_dir: Path, max_tokens: int, model_cfg: ModelConfig) -> list:
    import torch
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    transformer = Transformer(str(encoder_dir), tokenizer_name_or_path=str(tokenizer_dir), max_seq_length=max_tokens)
    dim = transformer.auto_model.config.hidden_size
    modules = [transformer, Pooling(dim, "mean")]
    if model_cfg.normalize and model_cfg.similarity == "cosine":
        scale = Dense(dim, dim, bias=False, activation_function=None, init_weight=torch.eye(dim) * math.sqrt(2.0))
        modules += [Normalize(), scale]
    elif model_cfg.normalize:
        modules.append(_twin_module_class()())
    return modules


def find_eval(checkpoint: Path) -> dict[str, Any] | None:
    """The run's final evaluation: eval.json in the checkpoint (Ray runs) or beside it (qrag train)."""
    for path in (checkpoint / "eval.json", checkpoint.parent / "eval.json"):
        if path.is_file():
            return json.loads(path.read_text())
    return None


def model_card(
    checkpoint: Path,
    cfg_dict: dict[str, Any],
    model_cfg: ModelConfig,
    evaluation: dict[str, Any] | None,
    question_tokens: int,
    chunk_tokens: int,
) -> str:
    needs_code = model_cfg.normalize and model_cfg.similarity == "twin"
    load = "SentenceTransformer(path, trust_remote_code=True)" if needs_code else "SentenceTransformer(path)"
    metrics = ""
    if evaluation:
        shown = {
            k: evaluation[k]
            for k in ("fact_em", "fact_f1", "num_samples", "avg_steps", "split", "update")
            if k in evaluation
        }
        metrics = "\n".join(f"| {k} | {v} |" for k, v in shown.items())
        metrics = (
            "## Evaluation (the run's final, multi-step, from eval.json)\n\n"
            f"| metric | value |\n| --- | --- |\n{metrics}\n"
        )
    return f"""---
library_name: sentence-transformers
pipeline_tag: sentence-similarity
tags: [sentence-transformers, retrieval, q-rag]
---

# Q-RAG retriever encoders ({cfg_dict.get("name", "qrag")})

Exported by `qrag export --format sentence-transformers` from the checkpoint `{checkpoint}`.
A Router sends queries through the trained **state encoder** and documents through the trained
**chunk encoder** (each: {model_cfg.encoder} architecture, mean pooling, then
{
        "each half of the vector unit-length (Q-RAG's twin critics; the module ships as code here)"
        if needs_code
        else "normalisation"
        if model_cfg.normalize
        else "no normalisation"
    }). Score with the dot product:
it is Q(s0, a) of the trained agent for the first retrieval step. Later steps (the state holds
the chunks picked so far) and chunk positions need qrag itself.

```python
from sentence_transformers import SentenceTransformer

model = {load}
q = model.encode_query(["Which river flows through the capital of France?"])
d = model.encode_document(["Paris is the capital of France.", "The Seine flows through Paris."])
scores = q @ d.T
```

Queries are cut at {question_tokens} tokens and documents at {chunk_tokens} (plus special tokens),
as in training.

{metrics}
## Training config

```yaml
{yaml.safe_dump(cfg_dict, sort_keys=False).rstrip()}
```
"""


def export_sentence_transformers(checkpoint: str | Path, out: str | Path) -> Path:
    """Write the export of ``checkpoint`` to ``out`` (a new or empty directory); returns ``out``."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Router

    checkpoint, out = Path(checkpoint), Path(out)
    meta = read_meta(checkpoint)
    model_cfg = from_dict(ModelConfig, meta["model"])
    if model_cfg.positions != "none":
        raise CheckpointError(
            f"{checkpoint}: model.positions={model_cfg.positions}: a sentence-transformers model has no "
            "chunk positions; export checkpoints trained with model.positions=none"
        )
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} exists and is not empty")
    cfg = load_run_config(checkpoint)
    q_tokens, c_tokens = cfg.data.question_tokens + 2, cfg.data.chunk_tokens + 2
    tokenizer = checkpoint / "tokenizer"
    router = Router.for_query_document(
        query_modules=_route(checkpoint / "state_encoder", tokenizer, q_tokens, model_cfg),
        document_modules=_route(checkpoint / "action_encoder", tokenizer, c_tokens, model_cfg),
    )
    model = SentenceTransformer(modules=[router], similarity_fn_name="dot", device="cpu")
    model.save(str(out), create_model_card=False)
    if model_cfg.normalize and model_cfg.similarity == "twin":
        shutil.copy(Path(__file__).with_name("st_twin_normalize.py"), out / f"{TWIN_MODULE}.py")
    card = model_card(
        checkpoint, to_dict(cfg), model_cfg, find_eval(checkpoint), cfg.data.question_tokens, cfg.data.chunk_tokens
    )
    (out / "README.md").write_text(card, encoding="utf-8")
    return out
