"""Locating and reading data files: plain, gzip, or a glob of either."""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from qrag.data.sample import DataError

_HERE = Path(__file__).resolve()

# The files a load reads, for the fingerprint of a cached split (qrag.data.prepared).
_SOURCES: ContextVar[set[str] | None] = ContextVar("qrag_data_sources", default=None)


@contextmanager
def recording_sources() -> Iterator[set[str]]:
    """Collect the absolute paths of every data file read inside the block."""
    seen: set[str] = set()
    token = _SOURCES.set(seen)
    try:
        yield seen
    finally:
        _SOURCES.reset(token)


def note_source(path: str | os.PathLike[str]) -> None:
    seen = _SOURCES.get()
    if seen is not None:
        seen.add(str(Path(path).resolve()))


# Where the benchmarks we ship subsets of are on the Hugging Face hub: data.hub reads them
# with datasets.load_dataset (or from a folder written by its save_to_disk), no data folder needed.
HUB_NAMES = {"hotpotqa": "hotpotqa/hotpot_qa:distractor", "musique": "dgslibisey/MuSiQue"}


def no_data_help() -> str:
    """The ways to give a run its data, for errors of a machine without the data folder."""
    hub = "; ".join(f"data.dataset={name} data.hub={spec}" for name, spec in HUB_NAMES.items())
    return (
        "export QRAG_DATA_DIR=<a folder of the benchmark files> (the layout of the repository's ../shared/data), "
        "or give a file or folder: data.path=<JSON/JSONL, .parquet or a datasets save_to_disk folder> "
        "(qrag eval: --data), "
        f"or read the full dataset from the Hugging Face hub with `datasets`: {hub} "
        "(data.hub also takes a local folder of data files or of save_to_disk)"
    )


def data_root() -> Path:
    """``$QRAG_DATA_DIR``, else the first ``shared/data`` found beside the checkout or the cwd."""
    env = os.environ.get("QRAG_DATA_DIR")
    if env:
        if not Path(env).is_dir():
            raise DataError(f"QRAG_DATA_DIR={env} is not a folder: {no_data_help()}")
        return Path(env)
    candidates = [Path.cwd() / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    candidates += [parent / "shared" / "data" for parent in _HERE.parents]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    raise DataError(
        f"no data directory (no $QRAG_DATA_DIR, no shared/data beside the working directory or the checkout: looked in "
        f"{', '.join(str(c) for c in candidates[:3])}, ...): {no_data_help()}"
    )


def resolve_files(path: str | os.PathLike[str]) -> list[Path]:
    """A file, or every file a glob matches (sorted). A missing path is an error naming it."""
    text = str(path)
    if any(ch in text for ch in "*?["):
        matches = sorted(Path(p) for p in glob.glob(text))
        if not matches:
            raise DataError(f"{text}: the glob matches no file")
        for match in matches:
            note_source(match)
        return matches
    p = Path(text)
    if not p.is_file():
        raise DataError(f"{p}: no such file")
    note_source(p)
    return [p]


def open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def read_json(path: Path) -> Any:
    try:
        with open_text(path) as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise DataError(f"{path}: cannot read: {exc}") from None


def read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, record) for every non-blank line."""
    try:
        with open_text(path) as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}: line {lineno}: malformed JSON: {exc.msg}") from None
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise DataError(f"{path}: cannot read: {exc}") from None
