"""The 95% intervals of headline figures (qrag.evaluation.intervals): a two-stage bootstrap over
training seeds, then questions. In simulation the interval covers the true mean most of the time,
it widens with fewer questions, seed-to-seed spread widens it, and a difference is called only
when its interval excludes 0."""

from __future__ import annotations

import numpy as np
import pytest

from qrag.evaluation.intervals import bootstrap_interval, difference_interval, replicate_means


def simulate(rng: np.random.Generator, p: float, seeds: int, questions: int, seed_sd: float) -> list[np.ndarray]:
    """Per-question 0/1 scores of ``seeds`` training seeds whose success rates scatter around ``p``."""
    return [
        rng.binomial(1, float(np.clip(p + rng.normal(0, seed_sd), 0, 1)), size=questions).astype(float)
        for _ in range(seeds)
    ]


@pytest.mark.parametrize("seeds,questions,seed_sd", [(3, 200, 0.03), (3, 100, 0.0), (1, 300, 0.0)])
def test_the_interval_covers_the_true_mean_most_of_the_time(seeds, questions, seed_sd):
    rng = np.random.default_rng(7)
    p, trials = 0.7, 120
    covered = sum(
        bootstrap_interval(simulate(rng, p, seeds, questions, seed_sd), replicates=400, seed=i).excludes(p) is False
        for i in range(trials)
    )
    assert covered / trials >= 0.85


def test_fewer_questions_give_a_wider_interval():
    rng = np.random.default_rng(3)
    many = simulate(rng, 0.8, 3, 500, 0.0)
    few = [s[:50] for s in many]
    wide, narrow = bootstrap_interval(few), bootstrap_interval(many)
    assert (wide.high - wide.low) > 1.5 * (narrow.high - narrow.low)
    assert narrow.low <= narrow.mean <= narrow.high and narrow.seeds == 3 and narrow.questions == 500


def test_spread_between_seeds_widens_the_interval():
    agree = [np.r_[np.ones(70), np.zeros(30)]] * 3
    disagree = [np.r_[np.ones(p), np.zeros(100 - p)] for p in (50, 70, 90)]
    a, d = bootstrap_interval(agree), bootstrap_interval(disagree)
    assert a.mean == pytest.approx(d.mean) == pytest.approx(0.7)
    assert (d.high - d.low) > 1.3 * (a.high - a.low)


def test_replicates_are_means_of_drawn_questions():
    draws = replicate_means([[0.0, 1.0], [1.0, 1.0, 1.0, 1.0]], 500, np.random.default_rng(0))
    assert draws.min() >= 0.0 and draws.max() <= 1.0 and len(draws) == 500
    assert set(np.round(replicate_means([[0.5, 0.5]], 10, np.random.default_rng(0)), 6)) == {0.5}


def test_a_difference_is_called_only_when_its_interval_excludes_zero():
    rng = np.random.default_rng(5)
    strong, weak = simulate(rng, 0.9, 3, 300, 0.0), simulate(rng, 0.6, 3, 300, 0.0)
    gap = difference_interval(strong, weak)
    assert gap.excludes(0.0) and gap.low > 0
    same_a, same_b = simulate(rng, 0.7, 3, 300, 0.0), simulate(rng, 0.7, 3, 300, 0.0)
    assert not difference_interval([s[:40] for s in same_a], [s[:40] for s in same_b]).excludes(0.0)


def test_an_empty_seed_is_an_error():
    with pytest.raises(ValueError):
        bootstrap_interval([[1.0, 0.0], []])


def test_a_paired_difference_sees_a_few_questions_move_one_way():
    """Rows b = rows a with 6 of 300 questions per seed fixed and none broken (a search change on the
    same checkpoints): paired, +2 points is called; each side on its own, the spread of the questions
    both get right or wrong alike hides it. Planted bug caught: ``paired`` ignored (unpaired either way)."""
    rng = np.random.default_rng(7)
    a = [(rng.random(300) < 0.75).astype(float) for _ in range(3)]
    b = []
    for seed in a:
        fixed = seed.copy()
        fixed[np.flatnonzero(seed == 0)[:6]] = 1.0
        b.append(fixed)
    paired = difference_interval(b, a, paired=True)
    alone = difference_interval(b, a)
    assert paired.mean == pytest.approx(alone.mean) == pytest.approx(0.02)
    assert paired.low > 0 and not alone.excludes(0.0)
    same = difference_interval(a, a, paired=True)
    assert (same.low, same.high) == (0.0, 0.0)
    with pytest.raises(ValueError, match="paired"):
        difference_interval(a, a[:2], paired=True)
