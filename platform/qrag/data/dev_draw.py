"""The frozen BabiLong dev draw: which bAbI test questions, in which backgrounds, a dev figure is
measured on.

It is fixed and documented so that every training seed, every model and every re-run scores the
same questions, and it depends on nothing a run can change (not ``data.seed``):

* for task ``t`` at length ``L`` the bAbI test questions are taken in the order of the permutation
  drawn by ``rng_for("babilong-order", DRAW, t, "dev", L)``: a different seeded draw per length,
  so that lengths are independent samples of the test set;
* the first :func:`questions_at` ``(L)`` of them whose supporting facts fit in ``L`` tokens are
  asked (:data:`QUESTIONS`, and :data:`QUESTIONS_LONG` from :data:`LONG` tokens on, where one
  context costs seconds);
* the background of the i-th draw is ``rng_for("babilong", DRAW, t, "dev", L, i)``'s window of
  the dev books (``qrag.data.babilong``).
"""

from __future__ import annotations

from typing import Any

DRAW = "qrag-dev-draw/1"  # part of every seed of the draw: a new draw must get a new name
QUESTIONS = 500
QUESTIONS_LONG = 100
LONG = 10 * 2**20  # 10M tokens


def questions_at(length: int) -> int:
    """Questions per task asked at ``length`` tokens in the frozen draw."""
    return QUESTIONS_LONG if length >= LONG else QUESTIONS


def describe() -> dict[str, Any]:
    """What a result file records about the draw it was measured on."""
    return {
        "name": DRAW,
        "questions": QUESTIONS,
        "questions_from_10m": QUESTIONS_LONG,
        "order": "bAbI test questions permuted by rng_for('babilong-order', name, task, 'dev', length); "
        "the first that fit are asked",
        "background": "rng_for('babilong', name, task, 'dev', length, draw) in the dev books",
    }
