"""Which data ``qrag eval`` reads: ``--data`` and ``--dataset`` mean what they say for every
checkpoint, whatever it was trained on.

Without either, the evaluation reads the run's own data settings (a ``mixed`` run: its sources).
``--dataset NAME`` reads that loader's data: the run's path, hub and sources belong to another
dataset and are dropped (its default file, unless ``--data`` names one). ``--data FILE`` reads that
file with the run's loader; for a ``mixed`` run, whose loader reads sources rather than a file, with
the loader of the source whose path is FILE, else ``--dataset`` must say which.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from qrag.config import ConfigError, DataConfig

# Keys that say where one dataset's records are: they do not carry over to another dataset.
_WHERE = {"path": None, "hub": None, "sources": [], "tasks": []}


def _same_file(a: str, b: str) -> bool:
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except OSError:
        return a == b


def _source_dataset(base: DataConfig, data: str) -> str:
    from qrag.data.mixed import _resolve, parse_sources

    hits = {s.dataset for s in parse_sources(base.sources) if s.path and _same_file(_resolve(s.path), data)}
    if len(hits) != 1:
        raise ConfigError(
            "this checkpoint trained on mixed sources "
            f"({', '.join(sorted({s.get('dataset', '?') for s in base.sources}))}); "
            f"say which loader reads {data} with --dataset (e.g. --dataset hotpotqa)"
        )
    return hits.pop()


def eval_data_config(base: DataConfig, data: str | None = None, dataset: str | None = None) -> DataConfig:
    """``base`` (the run's or the config's data settings) with ``--data``/``--dataset`` applied."""
    if data is None and dataset is None:
        return base
    if dataset == "mixed" and data is not None:
        raise ConfigError(
            "--dataset mixed reads data.sources, not a file: leave out --data, or name the file's own loader"
        )
    target = dataset or (_source_dataset(base, data) if base.dataset == "mixed" else base.dataset)
    if target != base.dataset:
        base = dataclasses.replace(base, dataset=target, **_WHERE)
    if data is not None:
        base = dataclasses.replace(base, path=data, hub=None)
    return base
