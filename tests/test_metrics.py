import pytest

from qrag.metrics import answer_em, answer_f1, best_over_aliases, fact_em, fact_f1, normalize_answer


def test_fact_em_is_subset_and_f1_is_set_f1():
    assert fact_em([1, 4], [4, 1]) == 1.0
    assert fact_em([1, 4], [4, 1, 7]) == 1.0  # extra chunks allowed (paper's definition)
    assert fact_em([1, 4], [4, 7]) == 0.0
    assert fact_f1([1, 4], [4, 7]) == pytest.approx(0.5)
    assert fact_f1([1, 4], [1, 4, 7, 8]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert fact_f1([1], [2]) == 0.0


# Worked examples checked against the official hotpot_evaluate_v1.py definitions.
@pytest.mark.parametrize(
    "pred,gold,em,f1",
    [
        ("The Eiffel Tower", "eiffel tower", 1.0, 1.0),
        ("an apple, a pear!", "apple pear", 1.0, 1.0),
        ("Barack Obama", "Obama", 0.0, 2 * 0.5 * 1 / 1.5),
        ("yes", "no", 0.0, 0.0),
        ("yes it is", "yes", 0.0, 0.0),  # yes/no must match exactly
        ("1,000 people", "1000 people", 1.0, 1.0),
        ("", "Paris", 0.0, 0.0),
    ],
)
def test_answer_metrics_hotpot_normalisation(pred, gold, em, f1):
    assert answer_em(pred, gold) == em
    assert answer_f1(pred, gold) == pytest.approx(f1)


def test_normalize_answer():
    assert normalize_answer("  The  Quick, brown fox. ") == "quick brown fox"


def test_best_over_aliases():
    assert best_over_aliases(answer_em, "NYC", ["New York City", "nyc"]) == 1.0
