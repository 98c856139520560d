"""Benchmark sources -> :class:`Sample` lists (one module per benchmark), their token layout and the credit rule
for support facts."""

from __future__ import annotations

from collections.abc import Callable

from qrag.config import DataConfig
from qrag.data.chunking import TokenCounter
from qrag.data.sample import DataError, Sample

__all__ = ["DataError", "Sample", "load_samples", "register_loader", "LOADERS"]

# name -> fn(cfg, split, count) -> list[Sample]
Loader = Callable[[DataConfig, str, TokenCounter], list[Sample]]
LOADERS: dict[str, Loader] = {}
HUB_DATASETS = ("hotpotqa", "musique", "2wiki", "jsonl")  # the loaders that read data.hub (qrag.data.hf)


def register_loader(name: str) -> Callable[[Loader], Loader]:
    def wrap(fn: Loader) -> Loader:
        LOADERS[name] = fn
        return fn

    return wrap


@register_loader("hotpotqa")
def _hotpotqa(cfg: DataConfig, split: str, count: TokenCounter) -> list[Sample]:
    from qrag.data.hotpotqa import load_hotpotqa

    return load_hotpotqa(
        cfg.path,
        split=split,
        dev_fraction=cfg.dev_fraction,
        budget=cfg.chunk_tokens,
        count=count,
        limit=cfg.limit,
        hub=cfg.hub,
    )


@register_loader("jsonl")
def _jsonl(cfg: DataConfig, split: str, count: TokenCounter) -> list[Sample]:
    from qrag.data.jsonl import load_jsonl

    return load_jsonl(cfg.path, split=split, dev_fraction=cfg.dev_fraction, limit=cfg.limit, hub=cfg.hub)


def load_samples(cfg: DataConfig, split: str, count: TokenCounter) -> list[Sample]:
    """Load ``split`` (train | dev | all) of the configured dataset."""
    _register_optional_loaders()
    if cfg.dataset not in LOADERS:
        raise DataError(f"unknown dataset {cfg.dataset!r} (known: {', '.join(sorted(LOADERS))})")
    # Keys a loader would ignore are errors, not silent no-ops.
    if cfg.sources and cfg.dataset != "mixed":
        raise DataError(f"data.sources is read by data.dataset=mixed only (dataset is {cfg.dataset!r})")
    if cfg.hub and cfg.dataset not in HUB_DATASETS:
        raise DataError(f"data.hub is read by {', '.join(HUB_DATASETS)} only (dataset is {cfg.dataset!r})")
    samples = LOADERS[cfg.dataset](cfg, split, count)
    if not samples:
        raise DataError(f"dataset {cfg.dataset!r} ({cfg.path or 'default path'}) has no records in split {split!r}")
    return samples


def _register_optional_loaders() -> None:
    """Benchmarks in their own modules of this package register with :func:`register_loader`
    when imported; import them all (they are small and import nothing heavy at module level)."""
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
