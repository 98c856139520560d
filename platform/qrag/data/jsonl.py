"""Users' own data: one JSON object per line.

``{"id": "q1", "question": "...", "chunks": ["...", ...], "support": [0, 3], "answer": "..."}``
``chunks`` are in document order; ``support`` are chunk indices; ``answer`` is optional.
The same columns in parquet, a ``save_to_disk`` folder or ``data.hub`` are read through
``datasets`` (:mod:`qrag.data.hf`).
"""

from __future__ import annotations

from pathlib import Path

from qrag.data.hf import record_pairs
from qrag.data.paths import read_jsonl
from qrag.data.sample import DataError, Sample
from qrag.data.splits import in_split


def _lines(file: Path):
    return ((f"{file}: line {lineno}", record) for lineno, record in read_jsonl(file))


def load_jsonl(
    path: str | Path | None, *, split: str, dev_fraction: float, limit: int | None = None, hub: str | None = None
) -> list[Sample]:
    if path is None and hub is None:
        raise DataError("data.path (or data.hub) is required for dataset 'jsonl'")
    samples: list[Sample] = []
    pairs, by_hash = record_pairs(path or "", hub, split, _lines)
    for where, record in pairs:
        if not isinstance(record, dict):
            raise DataError(f"{where}: a record must be a JSON object")
        rid = record.get("id")
        if not isinstance(rid, (str, int)) or str(rid) == "":
            raise DataError(f"{where}: missing field 'id'")
        where += f" (id={rid})"
        chunks, support = record.get("chunks"), record.get("support")
        if not isinstance(chunks, list) or not all(isinstance(c, str) for c in chunks):
            raise DataError(f"{where}: 'chunks' must be a list of strings")
        if not isinstance(support, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in support):
            raise DataError(f"{where}: 'support' must be a list of chunk indices")
        if not isinstance(record.get("question"), str):
            raise DataError(f"{where}: missing field 'question'")
        sample = Sample(
            id=str(rid),
            question=record["question"].strip(),
            chunks=chunks,
            support=sorted(support),
            answer=str(record.get("answer", "")),
            meta={k: v for k, v in record.items() if k not in {"id", "question", "chunks", "support", "answer"}},
        )
        sample.validate(where)  # every record, whatever its split: a bad dev record stops training too
        if by_hash and not in_split(str(rid), split, dev_fraction):
            continue
        samples.append(sample)
        if limit is not None and len(samples) >= limit:
            return samples
    return samples
