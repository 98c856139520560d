"""HotpotQA (distractor setting), official JSON layout.

A record is ``{"_id", "question", "answer", "supporting_facts": [[title, sent_idx], ...],
"context": [[title, [sentence, ...]], ...]}``. One chunk = one context paragraph (title and
sentences), capped at the chunk budget; the support chunks are the paragraphs that hold a
supporting fact. A bad record stops loading with an error naming the file and the record.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qrag.data.chunking import TokenCounter, cap_paragraphs
from qrag.data.hf import hotpot_layout, record_pairs
from qrag.data.paths import data_root, read_json
from qrag.data.sample import DataError, Sample
from qrag.data.splits import records_in_split

DEFAULT_FILE = "hotpotqa/hotpot_dev_distractor_v1.subset1368.json.gz"


def default_path() -> Path:
    return data_root() / DEFAULT_FILE


def _paragraphs(record: dict[str, Any], where: str) -> list[tuple[str, list[str]]]:
    context = record.get("context")
    if not isinstance(context, list) or not context:
        raise DataError(f"{where}: no context paragraphs")
    paragraphs = []
    for j, para in enumerate(context):
        if (
            not isinstance(para, (list, tuple))
            or len(para) != 2
            or not isinstance(para[0], str)
            or not isinstance(para[1], list)
            or not all(isinstance(s, str) for s in para[1])
        ):
            raise DataError(f"{where}: context[{j}] is not [title, [sentence, ...]]")
        paragraphs.append((para[0], para[1]))
    return paragraphs


def _support(record: dict[str, Any], paragraphs: list[tuple[str, list[str]]], where: str) -> list[int]:
    facts = record.get("supporting_facts")
    if not isinstance(facts, list) or not facts:
        raise DataError(f"{where}: no supporting_facts")
    support: set[int] = set()
    for fact in facts:
        if not isinstance(fact, (list, tuple)) or len(fact) != 2 or not isinstance(fact[1], int):
            raise DataError(f"{where}: supporting fact {fact!r} is not [title, sentence_index]")
        title, sent = fact
        hits = [j for j, (t, sents) in enumerate(paragraphs) if t == title and 0 <= sent < len(sents)]
        if not hits:
            raise DataError(f"{where}: supporting fact [{title!r}, {sent}] points to no context sentence")
        support.update(hits)
    return sorted(support)


@functools.lru_cache(maxsize=4)
def _read_cached(file: Path, mtime_ns: int, size: int) -> Any:
    return read_json(file)


def _read_records(file: Path) -> Any:
    """Parsed once per process: train and dev splits come from the same file."""
    st = file.stat()
    return _read_cached(file.resolve(), st.st_mtime_ns, st.st_size)


def parse_record(record: Any, where: str, budget: int, count: TokenCounter) -> Sample:
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object")
    for key in ("_id", "question"):
        if not isinstance(record.get(key), str) or not record[key].strip():
            raise DataError(f"{where}: missing or empty field {key!r}")
    paragraphs = _paragraphs(record, where)
    support = _support(record, paragraphs, where)
    sample = Sample(
        id=record["_id"],
        question=record["question"].strip(),
        chunks=cap_paragraphs(paragraphs, budget, count),
        support=support,
        answer=str(record.get("answer", "")),
        meta={"titles": [t for t, _ in paragraphs], "type": record.get("type")},
    )
    sample.validate(where)
    return sample


def load_hotpotqa(
    path: str | Path | None,
    *,
    split: str,
    dev_fraction: float,
    budget: int,
    count: TokenCounter,
    limit: int | None = None,
    hub: str | None = None,
) -> list[Sample]:
    pairs, by_hash = record_pairs(path or default_path, hub, split, _numbered_records, hotpot_layout)
    in_split = records_in_split(pairs, "_id", split, dev_fraction, by_hash=by_hash)
    samples = (parse_record(record, where, budget, count) for where, record in in_split)
    return list(itertools.islice(samples, limit))


def _numbered_records(file: Path) -> Iterator[tuple[str, Any]]:
    records = _read_records(file)
    if not isinstance(records, list):
        raise DataError(f"{file}: expected a JSON list of HotpotQA records")
    return ((f"{file}: record {i}", record) for i, record in enumerate(records))
