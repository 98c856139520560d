"""Checkpoints: a directory of safetensors and JSON; loading never unpickles anything.

```
config.yaml                      the resolved run configuration
qrag.json                        format version, positions, width, fingerprint inputs, the
                                 digests of the sources it trained on (trained_sources)
state_encoder/ action_encoder/   Hugging Face layout (config.json + model.safetensors)
target_state_encoder/ target_action_encoder/   (when targets are used)
tokenizer/
trainer/state.json               update, schedule, optimiser param groups, RNG and sampler state
trainer/tensors.safetensors      optimiser moments, torch RNG states
```
A checkpoint is written to ``<dir>.partial`` and renamed into place, so a crash while saving
never leaves a half-written checkpoint where a resume would find it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from qrag.config import ModelConfig, TrainConfig, dump_yaml, from_dict, load_config, to_dict
from qrag.model.encoder import ModelPathError, load_encoder, load_tokenizer, resolve_encoder
from qrag.model.qnet import QNetwork
from qrag.data.tokens import TokenLayout

FORMAT_VERSION = 1
ENCODERS = ("state_encoder", "action_encoder", "target_state_encoder", "target_action_encoder")


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, incomplete or inconsistent."""


# The parts of a checkpoint that inference needs (what MLflow logs as the model and Serve loads).
INFERENCE_PARTS = ("config.yaml", "qrag.json", "state_encoder", "action_encoder", "tokenizer")


def _optimizer_to_files(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = optimizer.state_dict()
    tensors = {}
    for pid, state in sd["state"].items():
        for name, value in state.items():
            tensors[f"optim.{pid}.{name}"] = value if torch.is_tensor(value) else torch.tensor(value)
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups}


def _optimizer_from_files(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, pid, name = key.split(".", 2)
            state.setdefault(int(pid), {})[name] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in meta["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def save_checkpoint(
    directory: str | Path,
    qnet: QNetwork,
    tokenizer,
    cfg: TrainConfig,
    learner=None,
    extra_state: dict[str, Any] | None = None,
    trained_sources: Iterable[str] | None = None,
) -> Path:
    """Write a complete checkpoint; with ``learner`` it is resumable (optimiser, schedule, RNG).
    ``trained_sources``: the source keys of the training samples (``qrag.data.splits.validation_key``),
    recorded as digests so that evaluation can refuse them (:mod:`qrag.evaluation.trained`)."""
    final = Path(directory)
    tmp = final.with_name(final.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    dump_yaml(cfg, tmp / "config.yaml")
    encoders = {"state_encoder": qnet.state_encoder, "action_encoder": qnet.action_encoder}
    if qnet.use_target:
        encoders.update(
            target_state_encoder=qnet.target_state_encoder, target_action_encoder=qnet.target_action_encoder
        )
    for name, model in encoders.items():
        model.save_pretrained(tmp / name, safe_serialization=True)
    tokenizer.save_pretrained(tmp / "tokenizer")
    meta = {
        "format_version": FORMAT_VERSION,
        "model": to_dict(qnet.cfg),
        "use_target": qnet.use_target,
        "dim": qnet.dim,
    }
    if trained_sources is not None:
        from qrag.data.splits import key_digest

        keys = sorted({key_digest(k) for k in trained_sources})
        meta["trained_sources"] = {"digest": "sha1(validation_key)[:16]", "count": len(keys), "keys": keys}
    (tmp / "qrag.json").write_text(json.dumps(meta, indent=2))
    if learner is not None:
        (tmp / "trainer").mkdir()
        tensors, optim_meta = _optimizer_to_files(learner.optimizer)
        tensors["rng.torch"] = torch.get_rng_state()
        tensors["rng.actions"] = learner.generator.get_state()
        if torch.cuda.is_available():
            tensors["rng.cuda"] = torch.cuda.get_rng_state()
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / "trainer" / "tensors.safetensors")
        )
        state = {
            "learner": learner.scalar_state(),
            "optimizer": optim_meta,
            "rng_python": _python_rng_state(),
            "extra": extra_state or {},
        }
        (tmp / "trainer" / "state.json").write_text(json.dumps(state))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final


def _python_rng_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _set_python_rng_state(state: list) -> None:
    random.setstate((state[0], tuple(state[1]), state[2]))


def is_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / "qrag.json").is_file()


def read_meta(directory: str | Path) -> dict[str, Any]:
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {path}")
    if not (path / "qrag.json").is_file():
        raise CheckpointError(f"{path} is not a qrag checkpoint (no qrag.json)")
    meta = json.loads((path / "qrag.json").read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unsupported checkpoint format {meta.get('format_version')!r}")
    return meta


def load_run_config(directory: str | Path) -> TrainConfig:
    return load_config(Path(directory) / "config.yaml", check=False)  # what the run was, not a new run


def load_qnet(
    directory: str | Path, device: torch.device, with_targets: bool = True
) -> tuple[QNetwork, Any, TokenLayout, TrainConfig]:
    """(Q-network, tokenizer, token layout, run config) from a checkpoint directory."""
    path = Path(directory)
    meta = read_meta(path)
    cfg = load_run_config(path)
    model_cfg = from_dict(ModelConfig, meta["model"])
    missing = [n for n in ENCODERS[:2] if not (path / n / "config.json").is_file()]
    if missing:
        raise CheckpointError(f"{path}: missing {missing[0]}/")
    state = load_encoder(str(path / "state_encoder"), model_cfg.dropout)
    action = load_encoder(str(path / "action_encoder"), model_cfg.dropout)
    use_target = bool(meta["use_target"]) and with_targets
    qnet = QNetwork(state, action, model_cfg, use_target=False)
    if use_target:
        qnet.use_target = True
        qnet.target_state_encoder = load_encoder(str(path / "target_state_encoder"), 0.0).requires_grad_(False)
        qnet.target_action_encoder = load_encoder(str(path / "target_action_encoder"), 0.0).requires_grad_(False)
    tokenizer = load_tokenizer(str(path / "tokenizer"))
    layout = TokenLayout.from_tokenizer(tokenizer, model_cfg.max_state_tokens)
    return qnet.to(device), tokenizer, layout, cfg


def untrained_qnet(
    model_cfg: ModelConfig, device: torch.device, use_target: bool = False
) -> tuple[QNetwork, Any, TokenLayout]:
    """Both encoders start as the pretrained encoder (where training starts). To evaluate the
    untrained encoder as a baseline use :func:`baseline_qnet`, which scores the way the paper does."""
    path = resolve_encoder(model_cfg.encoder)
    tokenizer = load_tokenizer(path)
    encoder = load_encoder(path, model_cfg.dropout)
    qnet = QNetwork.from_pretrained(encoder, model_cfg, use_target=use_target)
    return qnet.to(device), tokenizer, TokenLayout.from_tokenizer(tokenizer, model_cfg.max_state_tokens)


# The untrained rows: "none" is the paper's "multi-step RAG w/o FT" (the pretrained encoder's own
# similarity, the full-vector cosine of its pooled embeddings); "none:twin" is a labelled extra,
# the mean of the two half-vector cosines (what an untrained Q-network computes before training).
UNTRAINED_SPECS = {"none": "cosine", "none:twin": "twin"}


def is_untrained(spec: str) -> bool:
    return spec in UNTRAINED_SPECS


def baseline_model_cfg(model_cfg: ModelConfig, similarity: str = "cosine") -> ModelConfig:
    """The untrained encoder's scoring: no positions (a pretrained encoder knows nothing of the
    rotation), normalised pooled vectors, ``similarity`` 'cosine' (the paper's) or 'twin'."""
    return dataclasses.replace(model_cfg, positions="none", normalize=True, similarity=similarity)


def baseline_qnet(
    model_cfg: ModelConfig, device: torch.device, spec: str = "none"
) -> tuple[QNetwork, Any, TokenLayout]:
    """The untrained encoder as a baseline row; ``spec`` is "none" (the paper's full-vector cosine)
    or "none:twin" (the half-vector variant, an extra that must be labelled as such)."""
    if spec not in UNTRAINED_SPECS:
        raise CheckpointError(f"untrained baseline must be one of {', '.join(UNTRAINED_SPECS)}, got {spec!r}")
    return untrained_qnet(baseline_model_cfg(model_cfg, UNTRAINED_SPECS[spec]), device)


def baseline_label(similarity: str) -> str:
    """The row name of an untrained-encoder figure."""
    return (
        "Multi-step RAG w/o FT"
        if similarity == "cosine"
        else "Multi-step RAG w/o FT (half-vector cosines, not the paper's)"
    )


def load_training_state(directory: str | Path, learner) -> dict[str, Any]:
    """Restore optimiser, schedule position and RNG; returns the saved ``extra`` state."""
    path = Path(directory) / "trainer"
    if not (path / "state.json").is_file():
        raise CheckpointError(f"{directory} has no trainer state: it cannot be resumed (only evaluated)")
    state = json.loads((path / "state.json").read_text())
    tensors = load_file(str(path / "tensors.safetensors"))
    _optimizer_from_files(
        learner.optimizer,
        {k: v.to(learner.device) if k.startswith("optim.") and v.dim() > 0 else v for k, v in tensors.items()},
        state["optimizer"],
    )
    learner.load_scalar_state(state["learner"])
    torch.set_rng_state(tensors["rng.torch"])
    learner.generator.set_state(tensors["rng.actions"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    _set_python_rng_state(state["rng_python"])
    return state.get("extra", {})


def fingerprint(directory: str | Path) -> str:
    """A hash of the online encoders' weights and the positions config: what an index depends on."""
    path = Path(directory)
    digest = hashlib.sha256()
    digest.update(json.dumps(read_meta(path)["model"], sort_keys=True).encode())
    for name in ENCODERS[:2]:
        for file in sorted((path / name).glob("*.safetensors")):
            with open(file, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()[:16]


def numpy_state(rng: np.random.Generator) -> dict[str, Any]:
    return rng.bit_generator.state


def set_numpy_state(rng: np.random.Generator, state: dict[str, Any]) -> None:
    rng.bit_generator.state = state


__all__ = [
    "CheckpointError",
    "ModelPathError",
    "save_checkpoint",
    "load_qnet",
    "untrained_qnet",
    "load_training_state",
    "UNTRAINED_SPECS",
    "is_untrained",
    "baseline_model_cfg",
    "baseline_qnet",
    "baseline_label",
    "is_checkpoint",
    "read_meta",
    "fingerprint",
    "load_run_config",
    "numpy_state",
    "set_numpy_state",
]
