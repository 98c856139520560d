"""What the service knows of the model it serves: its fingerprint (corpora are checked against
it), its settings, and how many tokens a chunk may hold."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qrag.config import ModelConfig
from qrag.retrieval.embedder import Tokenization

# The encoders' position embeddings of these model types start after the padding index.
_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert", "longformer", "mpnet", "data2vec-text", "xmod")


def encoder_positions(encoder) -> int | None:
    """How many token positions a Hugging Face encoder can embed (None: no such limit)."""
    config = getattr(encoder, "config", None)
    n = getattr(config, "max_position_embeddings", None)
    if not isinstance(n, int) or n <= 0:
        return None
    if getattr(config, "model_type", "") in _OFFSET_POSITIONS and isinstance(
        getattr(config, "pad_token_id", None), int
    ):
        n -= config.pad_token_id + 1
    return n


def chunk_token_limit(max_positions: int | None, tok: Tokenization) -> int:
    """The largest chunk_tokens a chunk can have: the model's positions (and the tokenizer's
    max length) minus the special tokens wrapped around every chunk."""
    lengths = (max_positions, getattr(tok.tokenizer, "model_max_length", None))
    limits = [n for n in lengths if isinstance(n, int) and 0 < n < 1_000_000]
    special = len(tok.layout.wrap([]))
    return (min(limits) if limits else 512) - special


def public_source(spec: str) -> str:
    """A model source without the server's directories: URIs stay, a path keeps its last parts."""
    if "://" in spec or spec.startswith(("runs:/", "models:/")) or "/" not in spec:
        return spec
    parts = [p for p in spec.split("/") if p]
    return ".../" + "/".join(parts[-2:]) if len(parts) > 2 else spec


@dataclass
class ModelIdentity:
    fingerprint: str
    model_cfg: ModelConfig
    dim: int
    source: str
    trained: bool
    max_positions: int | None = None  # token positions the encoders embed (bounds chunk_tokens)

    def describe(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "source": public_source(self.source),
            "trained": self.trained,
            "positions": self.model_cfg.positions,
            "dim": self.dim,
            "encoder": public_source(self.model_cfg.encoder),
        }

    @classmethod
    def of(cls, model) -> ModelIdentity:
        """The identity of an :class:`~qrag.retrieval.embedder.EmbeddingModel` held in this process."""
        return cls(
            model.fingerprint,
            model.model_cfg,
            model.dim,
            model.source.describe(),
            model.source.trained,
            encoder_positions(model.qnet.action_encoder),
        )
