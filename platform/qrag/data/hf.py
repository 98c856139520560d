"""Records through Hugging Face ``datasets``: hub names, local parquet files, ``save_to_disk`` folders.

Every loader reads its records through :func:`record_pairs`, which yields ``(where, record)``
pairs for the loader's own strict parser, so a bad row stops loading with an error naming the
source and the row, wherever it came from:

* ``data.hub = "name[:config]"`` -> ``datasets.load_dataset(name, config)`` (the hub, the local
  Hugging Face cache when ``HF_HUB_OFFLINE=1``, or a local folder of data files). Its ``train``
  split feeds our train split, its ``validation`` (else ``dev``, else ``test``) split our dev
  split; a dataset with a train split only is split by id hash like a file;
* ``data.path`` = ``*.parquet`` file(s) or a ``save_to_disk`` folder -> read with ``datasets``;
* any other file (official JSON / JSONL, gzip or not) -> the loader's own reader, which names
  the line of a malformed record (Arrow's JSON reader cannot).

Rows in the Hugging Face column layout of HotpotQA-like data (``id``,
``context = {title: [...], sentences: [[...]]}``, ``supporting_facts = {title: [...], sent_id: [...]}``)
are turned into the official layout by :func:`hotpot_layout` before parsing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from qrag.data.paths import note_source, resolve_files
from qrag.data.sample import DataError

Pairs = Iterable[tuple[str, Any]]
DEV_SPLITS = ("validation", "dev", "test")
TABLE_SUFFIXES = (".parquet",)


def parse_hub(spec: str) -> tuple[str, str | None]:
    """``"hotpotqa/hotpot_qa:distractor"`` -> ("hotpotqa/hotpot_qa", "distractor")."""
    name, _, config = spec.partition(":")
    if not name.strip():
        raise DataError(f"data.hub={spec!r}: expected 'name[:config]', e.g. hotpotqa/hotpot_qa:distractor")
    return name.strip(), config.strip() or None


@functools.lru_cache(maxsize=4)
def _load_hub(spec: str) -> Any:
    """The DatasetDict of a hub name (cached per process: train and dev come from one load)."""
    import datasets

    name, config = parse_hub(spec)
    try:
        loaded = datasets.load_dataset(name, config)
    except Exception as exc:  # network, unknown name, missing config: one line that names the source
        raise DataError(
            f"data.hub={spec!r}: cannot load it with datasets.load_dataset({name!r}, {config!r}): "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(loaded, datasets.DatasetDict):
        loaded = datasets.DatasetDict({"train": loaded})
    return loaded


def _rows(dataset: Any, where: str, normalize: Callable[[Any, str], Any] | None) -> Iterator[tuple[str, Any]]:
    for cache in getattr(dataset, "cache_files", None) or []:
        note_source(cache["filename"])  # the Arrow files behind it fingerprint the source
    for i, row in enumerate(dataset):
        at = f"{where}: row {i}"
        yield at, normalize(row, at) if normalize else row


def hub_pairs(spec: str, split: str, normalize: Callable[[Any, str], Any] | None = None) -> tuple[Pairs, bool]:
    """(pairs, by_hash): the rows of our ``split`` and whether they still need the id-hash split."""
    splits = _load_hub(spec)
    folder = Path(parse_hub(spec)[0])
    if folder.is_dir():  # a local folder of data files: its files fingerprint it, not only datasets' copy
        for file in sorted(folder.rglob("*")):
            if file.is_file():
                note_source(file)
    if "train" not in splits:
        raise DataError(f"data.hub={spec!r}: no train split (it has {', '.join(splits)})")
    dev = next((name for name in DEV_SPLITS if name in splits), None)
    if dev is None:
        return _rows(splits["train"], f"hub {spec} [train]", normalize), True
    names = {"train": ["train"], "dev": [dev], "all": ["train", dev]}.get(split)
    if names is None:
        raise DataError(f"unknown split {split!r} (choose from train, dev, all)")
    return (pair for name in names for pair in _rows(splits[name], f"hub {spec} [{name}]", normalize)), False


def is_table_path(path: str | Path) -> bool:
    """Read through ``datasets``: a ``save_to_disk`` folder or parquet file(s)."""
    text = str(path)
    return bool(text) and (Path(text).is_dir() or text.endswith(TABLE_SUFFIXES))


def table_pairs(path: str | Path, normalize: Callable[[Any, str], Any] | None = None) -> Pairs:
    import datasets

    if Path(path).is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as exc:
            raise DataError(f"{path}: not a folder written by datasets' save_to_disk: {exc}") from None
        parts = loaded.items() if isinstance(loaded, datasets.DatasetDict) else [(None, loaded)]
        return (pair for name, ds in parts for pair in _rows(ds, f"{path}" + (f" [{name}]" if name else ""), normalize))
    files = resolve_files(path)

    def read(file: Path) -> Pairs:
        try:
            ds = datasets.Dataset.from_parquet(str(file))
        except Exception as exc:  # pyarrow's errors name no file
            raise DataError(f"{file}: cannot read parquet: {type(exc).__name__}: {exc}") from None
        return _rows(ds, str(file), normalize)

    return (pair for file in files for pair in read(file))


def record_pairs(
    path: str | Path | Callable[[], Path],
    hub: str | None,
    split: str,
    read_file: Callable[[Path], Pairs],
    normalize: Callable[[Any, str], Any] | None = None,
) -> tuple[Pairs, bool]:
    """(where, record) pairs of a loader's source and whether they still need the id-hash split.
    ``path`` may be the loader's default-file function: it is called only without ``hub``, so the
    hub path needs no data folder."""
    if hub:
        return hub_pairs(hub, split, normalize)
    if callable(path):
        path = path()
    if is_table_path(path):
        return table_pairs(path, normalize), True
    return (pair for file in resolve_files(path) for pair in read_file(file)), True


def hotpot_layout(record: Any, where: str) -> Any:
    """A HotpotQA/2Wiki row in the Hugging Face column layout -> the official layout (others pass)."""
    if not isinstance(record, dict):
        return record
    record = {k: v for k, v in record.items() if v is not None}  # Arrow fills absent fields with None
    if "_id" not in record and "id" in record:
        record["_id"] = record.pop("id")
    context = record.get("context")
    if isinstance(context, dict):
        sentences = context.get("sentences", context.get("content"))
        record["context"] = _zip(context.get("title"), sentences, "context.title", "context.sentences", where)
    facts = record.get("supporting_facts")
    if isinstance(facts, dict):
        record["supporting_facts"] = _zip(
            facts.get("title"), facts.get("sent_id"), "supporting_facts.title", "supporting_facts.sent_id", where
        )
    return record


def _zip(left: Any, right: Any, left_name: str, right_name: str, where: str) -> list[list[Any]]:
    if not isinstance(left, list) or not isinstance(right, list) or len(left) != len(right):
        raise DataError(f"{where}: {left_name} and {right_name} must be lists of the same length")
    return [[a, b] for a, b in zip(left, right)]
