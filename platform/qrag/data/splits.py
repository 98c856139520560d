"""Deterministic train/dev split by a hash of the record id.

The split of a record never depends on which other records are loaded, on their order, or on
the Python hash seed: ``sha1(id)`` mapped to [0, 1) is compared with ``dev_fraction``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TypeVar

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


def take_split(items: Sequence[T], ids: Sequence[str], split: str, dev_fraction: float) -> list[T]:
    return [item for item, rid in zip(items, ids) if in_split(rid, split, dev_fraction)]


def in_validation(record_id: str, val_fraction: float) -> bool:
    """Validation part of the train split: a second, independent hash of the id."""
    return val_fraction > 0 and dev_score("val:" + record_id) < val_fraction
