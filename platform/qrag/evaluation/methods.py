"""What a result's method is called in tables and when seeds are combined: one rule for both."""

from __future__ import annotations

from typing import Any

# What Table 3 calls a run of each learner.objective (pqn: Q-RAG itself).
OBJECTIVE_NAMES = {"pqn": "Q-RAG", "sft": "SFT", "sft_trajectory": "SFT trajectory"}


def method_label(summary: dict[str, Any]) -> str:
    """The row name: the summary's ``label``, else what the paper calls such a run (by the
    checkpoint's ``objective``; summaries written before it was recorded are soft PQN runs)."""
    if summary.get("label"):
        return str(summary["label"])
    if summary.get("checkpoint") in ("none", "none:twin"):
        # Summaries written before model.similarity existed scored the untrained encoder by the
        # mean of two half-vector cosines: only "cosine" is the paper's baseline.
        from qrag.model.checkpoint import baseline_label

        return baseline_label(summary.get("similarity", "twin"))
    name = OBJECTIVE_NAMES.get(summary.get("objective") or "pqn", str(summary.get("objective")))
    beam = (summary.get("search") or {}).get("beam_width", 1) or 1
    return f"Plan {name}" if beam > 1 else name
