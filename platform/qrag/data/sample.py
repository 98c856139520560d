"""The unit every benchmark loader produces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class DataError(ValueError):
    """Input data that cannot be used; the message names the file and the record."""


@dataclass
class Sample:
    """One question over one context.

    ``chunks`` are in document order; ``support`` holds the indices of the chunks that together
    answer the question. ``meta`` keeps what a benchmark needs later (answer aliases, titles,
    document ids of chunks, the task name).
    """

    id: str
    question: str
    chunks: list[str]
    support: list[int]
    answer: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def validate(self, where: str) -> None:
        if not self.question.strip():
            raise DataError(f"{where}: empty question")
        if not self.chunks:
            raise DataError(f"{where}: no context chunks")
        if not self.support:
            # With no support chunk the episode is a success before any action, so every first
            # pick would be rewarded and every retrieval would score Fact EM 1.
            raise DataError(f"{where}: empty support (at least one chunk index must answer the question)")
        bad = [i for i in self.support if not 0 <= i < len(self.chunks)]
        if bad:
            raise DataError(f"{where}: support index {bad[0]} points outside the {len(self.chunks)} chunks")
        if len(set(self.support)) != len(self.support):
            raise DataError(f"{where}: repeated support index in {self.support}")
