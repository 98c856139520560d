"""Answer metrics per benchmark: HotpotQA's official normalisation, MuSiQue aliases, BabiLong accuracy."""

import pytest

from qrag.metrics import answer_em, answer_f1, babilong_accuracy, best_over_aliases, contains_all, score_answer


# Worked examples computed by hand with the definitions of the official hotpot_evaluate_v1.py:
# normalize = lower -> drop punctuation -> drop a/an/the -> collapse spaces; F1 over token multisets;
# yes/no/noanswer must match exactly.
@pytest.mark.parametrize(
    "pred,gold,em,f1",
    [
        ("The Beatles", "Beatles", 1.0, 1.0),
        ("the the a an", "", 1.0, 0.0),  # both normalise to "": EM 1, F1 0 (no tokens in common)
        ("Barack Obama", "Obama", 0.0, 2 / 3),
        ("New York New York", "New York", 0.0, 2 * 0.5 * 1 / 1.5),  # token multisets: 2 of 4 predicted tokens match
        ("no", "No.", 1.0, 1.0),
        ("no way", "no", 0.0, 0.0),
        ("noanswer", "noanswer", 1.0, 1.0),
        ("U.S. Army", "US Army", 1.0, 1.0),
        ("Hey Pa! There's a Goat on the Roof", "Hey Pa! There's a Goat on the Roof", 1.0, 1.0),
        ("a Goat on the Roof", "Hey Pa! There's a Goat on the Roof", 0.0, 2 * 1.0 * 0.5 / 1.5),
    ],
)
def test_official_hotpot_examples(pred, gold, em, f1):
    assert answer_em(pred, gold) == em
    assert answer_f1(pred, gold) == pytest.approx(f1)


def test_musique_aliases_take_the_best_score():
    golds = ["New York City", "NYC", "the Big Apple"]
    assert score_answer("musique", "nyc", golds) == (1.0, 1.0)
    em, f1 = score_answer("musique", "New York", golds)
    assert em == 0.0 and f1 == pytest.approx(0.8)
    assert score_answer("musique", "Big Apple", golds) == (1.0, 1.0)
    assert score_answer("musique", "Boston", golds) == (0.0, 0.0)
    assert best_over_aliases(answer_em, "x", []) == 0.0


@pytest.mark.parametrize(
    "output,gold,question,task,expected",
    [
        ("The apple is in the kitchen.", "kitchen", "Where is the apple?", "qa2", 1.0),
        ("The most recent location of Mary is Kitchen", "kitchen", "Where is Mary?", "qa1", 1.0),
        ("kitchen or garden", "kitchen", "Where is the apple?", "qa2", 0.0),  # two places named: not an answer
        (
            "Before the kitchen the apple was in the bedroom.",
            "bedroom",
            "Where was the apple before the kitchen?",
            "qa3",
            1.0,
        ),
        (
            "Mary gave the apple to Fred.",
            "Fred",
            "Who did Mary give the apple to?",
            "qa5",
            1.0,
        ),  # question's labels ignored
        ("Bill", "Fred", "Who did Mary give the apple to?", "qa5", 0.0),
        ("Garden. Actually it is the kitchen.", "kitchen", "Where is John?", "qa1", 0.0),  # first sentence only
        ("kitchenette", "kitchen", "Where is John?", None, 0.0),  # whole words
        ("KITCHEN!", "kitchen", "Where is John?", None, 1.0),  # no labels: the gold word appears, any case
        ("apple, milk", "apple,milk", "What is Daniel carrying?", None, 1.0),
        ("apple", "apple,milk", "What is Daniel carrying?", None, 0.0),
    ],
)
def test_babilong_accuracy(output, gold, question, task, expected):
    from qrag.metrics import BABILONG_LABELS

    labels = BABILONG_LABELS.get(task) if task else None
    assert babilong_accuracy(output, gold, question, labels) == expected
    if task:
        assert score_answer("babilong", output, [gold], question, task) == (expected, expected)


def test_ruler_values_found():
    assert contains_all("the numbers are 1234567 and 7654321", ["1234567", "7654321"]) == 1.0
    assert contains_all("only 1234567", ["1234567", "7654321"]) == 0.5
    assert score_answer("niah", "only 1234567", ["1234567", "7654321"]) == (0.0, 0.5)
    assert score_answer("niah", "1234567, 7654321", ["1234567", "7654321"]) == (1.0, 1.0)
