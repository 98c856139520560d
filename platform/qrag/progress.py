"""Progress bars with an ETA for long commands (tqdm, on stderr).

A command turns them on with :func:`configure` (``--progress`` / ``--no-progress``; by default on
when stderr is a terminal); library code asks for a bar with :func:`bar` and gets a silent one
unless a command turned them on, so tests, Ray workers and servers print nothing. A bar opened
with a ``kind`` collects the work of every inner bar of the same kind, so a command can show one
ETA over many calls (``qrag sweep-lengths``: every question of every length).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from tqdm import tqdm

_on = False  # off until a command asks: library use prints nothing
_open: ContextVar[dict[str, tqdm] | None] = ContextVar("qrag_progress_open", default=None)


def configure(flag: bool | None) -> bool:
    """Bars on (True), off (False), or on when stderr is a terminal (None); whether they are on."""
    global _on
    _on = sys.stderr.isatty() if flag is None else bool(flag)
    return _on


def enabled() -> bool:
    return _on


@contextmanager
def bar(
    total: int | float | None, desc: str, unit: str = "it", kind: str | None = None, **options: Any
) -> Iterator[tqdm]:
    """A bar to ``update(n)``; inside an open bar of the same ``kind``, that bar (its total
    already counts this work), so nested calls add to one ETA."""
    outer = (_open.get() or {}).get(kind) if kind else None
    if outer is not None:
        yield outer
        return
    inner = tqdm(
        total=total,
        desc=desc,
        unit=unit,
        disable=not _on,
        file=sys.stderr,
        dynamic_ncols=True,
        leave=_open.get() is None,
        **options,
    )
    token = _open.set({**(_open.get() or {}), kind: inner}) if kind else None
    try:
        yield inner
    finally:
        if token is not None:
            _open.reset(token)
        inner.close()


def write(text: str) -> None:
    """A line on stderr that does not break the bars drawn there."""
    if _on:
        tqdm.write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr, flush=True)
