"""2WikiMultihopQA, official JSON(L) layout (``data.dataset=2wiki``).

Records use HotpotQA's fields (``_id, question, answer, context [[title, [sentences]]],
supporting_facts [[title, sent_idx]]``, plus ``type`` and ``evidences``), so they are parsed like
HotpotQA: one chunk per paragraph, support = the paragraphs that hold a supporting fact.
Files may be a JSON list or JSON lines.

The one rule that skips records: a record with **no ``context`` at all** (the shipped MIGRES copy
replaced it with ``explanation``/``qa_pairs`` in 36 of 200 records) has nothing to retrieve from,
so it is left out, and a warning names how many were skipped and their ids. Any other bad record
(an empty or malformed context, a supporting fact that points nowhere) stops loading with an error
naming the file and the record, as everywhere else.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from qrag.config import DataConfig
from qrag.data import register_loader
from qrag.data.chunking import TokenCounter
from qrag.data.hf import hotpot_layout, record_pairs
from qrag.data.hotpotqa import parse_record
from qrag.data.paths import data_root, read_json, read_jsonl
from qrag.data.sample import DataError, Sample
from qrag.data.splits import records_in_split

log = logging.getLogger(__name__)

DEFAULT_FILE = "2wikimultihopqa/AdelWang_MIGRES_2wikimultihopqa_wikihop200.jsonl.gz"


def default_path() -> Path:
    return data_root() / DEFAULT_FILE


def _records(file: Path) -> list[tuple[str, Any]]:
    """(where, record) pairs from a JSON list or a JSON-lines file."""
    name = file.name.removesuffix(".gz")
    if name.endswith(".jsonl"):
        return [(f"{file}: line {lineno}", rec) for lineno, rec in read_jsonl(file)]
    records = read_json(file)
    if not isinstance(records, list):
        raise DataError(f"{file}: expected a JSON list of 2WikiMultihopQA records (or a .jsonl file)")
    return [(f"{file}: record {i}", rec) for i, rec in enumerate(records)]


def load_2wiki(
    path: str | Path | None,
    *,
    split: str,
    dev_fraction: float,
    budget: int,
    count: TokenCounter,
    limit: int | None = None,
    hub: str | None = None,
) -> list[Sample]:
    samples: list[Sample] = []
    skipped: list[str] = []
    pairs, by_hash = record_pairs(path or default_path, hub, split, _records, hotpot_layout)
    for where, record in records_in_split(pairs, "_id", split, dev_fraction, by_hash=by_hash):
        if limit is not None and len(samples) >= limit:
            break
        if isinstance(record, dict) and "context" not in record:
            skipped.append(str(record.get("_id")))
            continue
        sample = parse_record(record, where, budget, count)
        sample.meta["evidences"] = record.get("evidences")
        samples.append(sample)
    if skipped:
        log.warning(
            "2wiki: skipped %d record(s) without a 'context' field (nothing to retrieve from): %s",
            len(skipped),
            ", ".join(skipped),
        )
    return samples


@register_loader("2wiki")
def _2wiki(cfg: DataConfig, split: str, count: TokenCounter) -> list[Sample]:
    return load_2wiki(
        cfg.path,
        split=split,
        dev_fraction=cfg.dev_fraction,
        budget=cfg.chunk_tokens,
        count=count,
        limit=cfg.limit,
        hub=cfg.hub,
    )
