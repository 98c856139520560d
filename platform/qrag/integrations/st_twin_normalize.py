"""TwinNormalize: a sentence-transformers module that makes each half of the pooled embedding
unit-length, the vector a Q-RAG checkpoint (``model.similarity: twin``) scores with.

Self-contained (torch + sentence_transformers only): ``qrag export --format sentence-transformers``
copies this file into the exported model, where ``SentenceTransformer(path, trust_remote_code=True)``
finds it, so the export loads without qrag installed.
"""

from __future__ import annotations

import torch.nn.functional as F
from sentence_transformers.base.modules.module import Module
from torch import Tensor


class TwinNormalize(Module):
    """``sentence_embedding`` [.., d] -> both halves [.., d/2] L2-normalised; the dot product of two
    such vectors is the sum of the two half cosines (Q1 + Q2 of Q-RAG's twin critics)."""

    config_keys: list[str] = []

    def forward(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        x = features["sentence_embedding"]
        halves = x.float().reshape(*x.shape[:-1], 2, x.shape[-1] // 2)
        features["sentence_embedding"] = F.normalize(halves, p=2, dim=-1).reshape(x.shape)
        return features

    def save(self, output_path: str, *args, safe_serialization: bool = True, **kwargs) -> None:
        self.save_config(output_path)

    @classmethod
    def load(cls, model_name_or_path: str = "", **kwargs) -> TwinNormalize:
        return cls()
