"""What the service reports while it works (Ray Serve exports it to Prometheus; tests count it)."""

from __future__ import annotations

from typing import Protocol


class Metrics(Protocol):
    def stage(self, stage: str, seconds: float) -> None: ...
    def chunks_indexed(self, n: int) -> None: ...
