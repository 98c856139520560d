"""The id-hash splits (qrag.data.splits): the validation draw is independent of the dev draw
(named with the planted bug it catches, seen failing with it)."""

from __future__ import annotations

from qrag.data.splits import dev_score, in_split, in_validation


def test_the_validation_draw_is_independent_of_the_dev_draw():
    """Planted bug caught: validation drawn with the dev split's own hash, so that the validation
    part of train is empty (or all of it dev)."""
    ids = [f"q{i:05d}" for i in range(4000)]
    train = [i for i in ids if in_split(i, "train", 0.2)]
    val = [i for i in train if in_validation(i, 0.1)]
    assert 0.07 < len(val) / len(train) < 0.13
    dev = [i for i in ids if in_split(i, "dev", 0.2)]
    assert 0.07 < sum(in_validation(i, 0.1) for i in dev) / len(dev) < 0.13
    assert not in_validation("q00001", 0.0) and 0.0 <= dev_score("x") < 1.0
