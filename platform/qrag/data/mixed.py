"""Several datasets trained as one (``data.dataset=mixed``, ``data.sources=[...]``).

Each source is a mapping ``{dataset, path?, hub?, train?, dev?, max_support?}`` read by that
dataset's own loader (same parsing and strict validation, same chunk budget):

* ``train``: which of the source's own splits goes into the mixed train split: ``train``
  (default; e.g. the id-hash train part of the HotpotQA dev subset, or MuSiQue's train file),
  ``all`` (every record, e.g. the HotpotQA train subset) or ``none``;
* ``dev``: which goes into the mixed dev split: ``dev`` (default) or ``none``. Keeping one
  source's dev keeps the dev figures comparable with that dataset's own preset;
* ``path``: relative paths are under the data root (``$QRAG_DATA_DIR``), so a preset works
  wherever the data lives; ``hub``: as ``data.hub``;
* ``max_support``: records with more support chunks are left out (a warning names how many):
  with T = 2 a 3- or 4-hop question can never succeed and only teaches that its support is worth 0.

Samples keep their loader's ``meta`` plus ``meta["source"]`` (the source's dataset name). Ids
must be unique across sources: the validation part of train is drawn by a hash of the id.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qrag.config import ConfigError, DataConfig
from qrag.data import LOADERS, register_loader
from qrag.data.chunking import TokenCounter
from qrag.data.paths import data_root
from qrag.data.sample import DataError, Sample

log = logging.getLogger(__name__)

TRAIN_PARTS = ("train", "all", "none")
DEV_PARTS = ("dev", "none")
KEYS = ("dataset", "path", "hub", "train", "dev", "max_support")


@dataclass(frozen=True)
class Source:
    dataset: str
    path: str | None = None
    hub: str | None = None
    train: str = "train"
    dev: str = "dev"
    max_support: int | None = None

    @property
    def name(self) -> str:
        return self.dataset + (f"[{self.hub or self.path}]" if self.hub or self.path else "")

    def parts(self, split: str) -> list[str]:
        """The source's own splits that make up the mixed ``split``."""
        if split == "train":
            wanted = [self.train]
        elif split == "dev":
            wanted = [self.dev]
        elif split == "all":
            wanted = ["all"] if "all" in (self.train, self.dev) else [self.train, self.dev]
        else:
            raise DataError(f"unknown split {split!r} (choose from train, dev, all)")
        return [p for p in dict.fromkeys(wanted) if p != "none"]


def parse_sources(raw: list[dict[str, Any]]) -> list[Source]:
    if not raw:
        raise ConfigError(
            "data.dataset=mixed needs data.sources, e.g. [{dataset: hotpotqa}, {dataset: musique, dev: none}]"
        )
    sources = []
    for i, spec in enumerate(raw):
        key = f"data.sources[{i}]"
        if not isinstance(spec, dict):
            raise ConfigError(f"{key}: expected a mapping such as {{dataset: hotpotqa}}, got {spec!r}")
        unknown = sorted(set(spec) - set(KEYS))
        if unknown:
            raise ConfigError(f"{key}: unknown key {unknown[0]!r} (known: {', '.join(KEYS)})")
        dataset = spec.get("dataset")
        if dataset == "mixed" or not isinstance(dataset, str):
            raise ConfigError(f"{key}.dataset: expected a dataset name other than 'mixed', got {dataset!r}")
        for field, allowed in (("train", TRAIN_PARTS), ("dev", DEV_PARTS)):
            if spec.get(field, allowed[0]) not in allowed:
                raise ConfigError(f"{key}.{field}: expected one of {' | '.join(allowed)}, got {spec[field]!r}")
        for field in ("path", "hub"):
            if spec.get(field) is not None and not isinstance(spec[field], str):
                raise ConfigError(f"{key}.{field}: expected a string, got {spec[field]!r}")
        limit = spec.get("max_support")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ConfigError(f"{key}.max_support: expected a positive integer, got {limit!r}")
        sources.append(Source(**spec))
    return sources


def _resolve(path: str | None) -> str | None:
    if path is None or Path(path).is_absolute():
        return path
    return str(data_root() / path)


def load_mixed(cfg: DataConfig, split: str, count: TokenCounter) -> list[Sample]:
    samples: list[Sample] = []
    owner: dict[str, str] = {}
    for source in parse_sources(cfg.sources):
        if source.dataset not in LOADERS:
            raise DataError(f"data.sources: unknown dataset {source.dataset!r} (known: {', '.join(sorted(LOADERS))})")
        sub = dataclasses.replace(cfg, dataset=source.dataset, path=_resolve(source.path), hub=source.hub, sources=[])
        for part in source.parts(split):
            dropped: list[str] = []
            for sample in LOADERS[source.dataset](sub, part, count):
                if source.max_support is not None and len(sample.support) > source.max_support:
                    dropped.append(sample.id)
                    continue
                if sample.id in owner:
                    raise DataError(
                        f"record id {sample.id!r} is in both {owner[sample.id]} and {source.name}: "
                        "ids must be unique across data.sources"
                    )
                owner[sample.id] = source.name
                sample.meta["source"] = source.dataset
                samples.append(sample)
            if dropped:
                log.warning(
                    "%s (%s split): left out %d record(s) with more than %d support chunks (max_support): %s",
                    source.name,
                    part,
                    len(dropped),
                    source.max_support,
                    ", ".join(dropped[:20]) + (" ..." if len(dropped) > 20 else ""),
                )
    return list(itertools.islice(samples, cfg.limit))


@register_loader("mixed")
def _mixed(cfg: DataConfig, split: str, count: TokenCounter) -> list[Sample]:
    return load_mixed(cfg, split, count)
