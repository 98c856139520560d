"""Deterministic train/dev/validation splits by a hash of the record id (or its source).

The split of a record never depends on which other records are loaded, on their order, or on
the Python hash seed: ``sha1(id)`` mapped to [0, 1) is compared with ``dev_fraction``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

SPLITS = ("train", "dev", "all")


def dev_score(record_id: str) -> float:
    digest = hashlib.sha1(record_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def in_split(record_id: str, split: str, dev_fraction: float) -> bool:
    if split == "all":
        return True
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} (choose from {', '.join(SPLITS)})")
    is_dev = dev_score(record_id) < dev_fraction
    return is_dev if split == "dev" else not is_dev


def records_in_split(
    pairs: Iterable[tuple[str, Any]], id_key: str, split: str, dev_fraction: float, *, by_hash: bool = True
) -> Iterator[tuple[str, Any]]:
    """The (where, record) pairs of ``split``, ``where`` extended with the record's id. A record
    without a string id is kept, so that its parser stops with an error naming it."""
    for where, record in pairs:
        rid = record.get(id_key) if isinstance(record, dict) else None
        if rid:
            where = f"{where} ({id_key}={rid})"
        if by_hash and isinstance(rid, str) and not in_split(rid, split, dev_fraction):
            continue
        yield where, record


def take_split(items: Sequence[T], ids: Sequence[str], split: str, dev_fraction: float) -> list[T]:
    return [item for item, rid in zip(items, ids) if in_split(rid, split, dev_fraction)]


def in_validation(record_id: str, val_fraction: float) -> bool:
    """Validation part of the train split: a second, independent hash of the id."""
    return val_fraction > 0 and dev_score("val:" + record_id) < val_fraction


def validation_key(sample: Any) -> str:
    """What decides a sample's side: its source, never its own id when it has one. A generated
    BabiLong sample's bAbI **story** (``meta["story_id"]``: a story's questions share every fact,
    so holding out a question whose story is trained on holds out nothing), else its source
    record (``meta["source_id"]``, e.g. a bAbI question that reappears with other background),
    else its own id (a HotpotQA or MuSiQue question). So no validation question, nor its story,
    is ever trained on."""
    meta = getattr(sample, "meta", None) or {}
    return str(meta.get("story_id") or meta.get("source_id") or sample.id)


def key_digest(key: str) -> str:
    """A short, stable digest of a source key (checkpoints record what they trained on as these)."""
    return hashlib.sha1(key.encode("utf-8")).hexdigest()[:16]


def split_validation(samples: Sequence[T], val_fraction: float) -> tuple[list[T], list[T]]:
    """(train, validation) parts of the train split's samples (by :func:`in_validation` of
    :func:`validation_key`). The learner evaluates on the second; training, local or in Ray
    runners, sees only the first."""
    train: list[T] = []
    val: list[T] = []
    for s in samples:
        (val if in_validation(validation_key(s), val_fraction) else train).append(s)
    return train, val
