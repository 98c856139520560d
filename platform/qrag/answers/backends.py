"""Building the configured reader backend (kept apart from :mod:`qrag.answers.reader`, which the
backends themselves import for the shared types)."""

from __future__ import annotations

from qrag.config import AnswerConfig
from qrag.answers.reader import BACKENDS, Answerer, AnswerSetupError


def make_answerer(cfg: AnswerConfig, backend: str | None = None) -> Answerer | None:
    """The configured reader (``backend`` overrides ``cfg.backend``); None for ``none``."""
    backend = backend or cfg.backend
    if backend not in BACKENDS:
        raise AnswerSetupError(f"unknown answer backend {backend!r} (choose from {', '.join(BACKENDS)})")
    if backend == "none":
        return None
    if backend == "openai":
        from qrag.answers.openai_compat import OpenAIAnswerer

        return OpenAIAnswerer.from_config(cfg)
    from qrag.answers.local import LocalAnswerer

    return LocalAnswerer.from_config(cfg)
