"""Evaluating a checkpoint on what it trained on is refused unless asked for.

A checkpoint records the sources of its training samples (``qrag.json``: ``trained_sources``, the
digests of :func:`qrag.data.splits.validation_key`: a bAbI story, a HotpotQA or MuSiQue question, a
generated sample's own id). Before anything is scored, the evaluated samples' sources are looked up
there: a sample whose source was trained on is an error unless the caller allows it, and a result
records how many there were.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from qrag.data.sample import DataError, Sample
from qrag.data.splits import key_digest, validation_key


class TrainedQuestionsError(DataError):
    """Evaluation samples whose source the checkpoint trained on."""


def trained_sources(checkpoint: str) -> frozenset[str] | None:
    """The checkpoint's recorded training-source digests, or None where it records none (the
    untrained encoder, a checkpoint saved before this was recorded, or training fed by Ray runners)."""
    from qrag.model.checkpoint import is_untrained, read_meta

    if is_untrained(checkpoint):
        return frozenset()
    recorded = read_meta(checkpoint).get("trained_sources")
    return None if recorded is None else frozenset(recorded["keys"])


def trained_ids(samples: Iterable[Sample], trained: frozenset[str]) -> list[str]:
    """Ids of the samples whose source is among ``trained``."""
    return [s.id for s in samples if key_digest(validation_key(s)) in trained]


class Guard:
    """Checks evaluation samples against one checkpoint's training sources, batch by batch."""

    def __init__(self, checkpoint: str, allow: bool = False):
        self.checkpoint = checkpoint
        self.allow = allow
        self.trained = trained_sources(checkpoint)
        self.hits = 0

    def check(self, samples: Sequence[Sample]) -> None:
        if not self.trained:
            return
        hits = trained_ids(samples, self.trained)
        if hits and not self.allow:
            raise TrainedQuestionsError(
                f"{len(hits)} of these {len(samples)} questions (e.g. {hits[0]}) "
                f"come from sources {self.checkpoint} was trained "
                "on; evaluate on held-out data (e.g. --split dev), or pass --allow-train-questions to score them anyway"
            )
        self.hits += len(hits)

    def record(self) -> dict[str, Any]:
        """What a result records about the check."""
        return {"checked": self.trained is not None, "allowed": self.allow, "trained_on": self.hits}
