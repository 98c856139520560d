"""Edge cases of the retrieval metrics (qrag.metrics), named with the planted bug each catches
(seen failing with it)."""

from __future__ import annotations

from qrag.metrics import fact_em, fact_f1


def test_fact_scores_of_an_empty_support():
    """Planted bug caught: Fact F1 of no gold and no picks scored 0 (it retrieved all, and only, the support)."""
    assert fact_f1([], []) == 1.0 and fact_em([], []) == 1.0
    assert fact_f1([], [3]) == 0.0 and fact_f1([1], []) == 0.0
