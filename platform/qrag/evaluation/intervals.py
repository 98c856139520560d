"""95% intervals for headline figures: a two-stage bootstrap over training seeds, then questions.

A headline figure is the mean of a per-question score (Fact EM, Fact F1, ...) over every question
of every training seed. Two draws make it uncertain: which seeds were trained (a run's outcome
varies with its seed) and which questions were asked. The interval resamples both, in the order
they were drawn: a replicate takes S seeds with replacement from the S measured, then, for each
seed it took, that seed's questions with replacement; the replicate's figure is the mean over all
the questions it drew. The interval is the central ``level`` range of the replicates (percentile
bootstrap). With one seed only the questions are resampled, and the interval says nothing about
seed-to-seed variation: result files record the number of seeds beside every interval.

A difference between two figures is called a difference only when the bootstrap of the
difference puts 0 outside its interval. Rows scored on the same questions with as many seeds are
**paired**: the two-stage bootstrap runs over the per-question differences, seed i of one row
against seed i of the other (the same checkpoint where the rows are two searches of it), so a
change that moves a few questions one way is not drowned by the spread of the questions both rows
get right or wrong alike. Otherwise each side is resampled on its own (wider wherever the two rows
agree on most questions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

LEVEL = 0.95
REPLICATES = 2000
# Draws of one seed's questions are made in blocks of at most this many scores (memory bound).
BLOCK = 1 << 22

ScoresBySeed = Sequence[Sequence[float]]


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    level: float
    seeds: int
    questions: int  # questions per seed (the most of any seed)

    def excludes(self, value: float = 0.0) -> bool:
        return value < self.low or value > self.high

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _arrays(scores_by_seed: ScoresBySeed) -> list[np.ndarray]:
    arrays = [np.asarray(s, dtype=np.float64) for s in scores_by_seed]
    if not arrays or any(a.ndim != 1 or len(a) == 0 for a in arrays):
        raise ValueError("an interval needs at least one seed, each with at least one question score")
    return arrays


def replicate_means(scores_by_seed: ScoresBySeed, replicates: int, rng: np.random.Generator) -> np.ndarray:
    """``replicates`` bootstrap figures: seeds with replacement, then each drawn seed's questions."""
    arrays = _arrays(scores_by_seed)
    picks = rng.integers(len(arrays), size=(replicates, len(arrays)))
    sums = np.zeros(replicates)
    counts = np.zeros(replicates)
    for k, scores in enumerate(arrays):
        rows = np.nonzero(picks == k)[0]  # one entry per (replicate, slot) that drew seed k
        n = len(scores)
        step = max(1, BLOCK // n)
        for lo in range(0, len(rows), step):
            part = rows[lo : lo + step]
            drawn = scores[rng.integers(n, size=(len(part), n))].sum(1)
            np.add.at(sums, part, drawn)
            np.add.at(counts, part, n)
    return sums / counts


def _pooled_mean(arrays: list[np.ndarray]) -> float:
    return float(np.concatenate(arrays).mean())


def _interval(mean: float, draws: np.ndarray, level: float, arrays: list[np.ndarray]) -> Interval:
    tail = (1.0 - level) / 2
    low, high = np.quantile(draws, [tail, 1.0 - tail])
    return Interval(mean, float(low), float(high), level, len(arrays), max(len(a) for a in arrays))


def bootstrap_interval(
    scores_by_seed: ScoresBySeed, level: float = LEVEL, replicates: int = REPLICATES, seed: int = 0
) -> Interval:
    """The mean over all questions of all seeds and its ``level`` interval (module docstring)."""
    arrays = _arrays(scores_by_seed)
    draws = replicate_means(arrays, replicates, np.random.default_rng(seed))
    return _interval(_pooled_mean(arrays), draws, level, arrays)


def difference_interval(
    a_by_seed: ScoresBySeed,
    b_by_seed: ScoresBySeed,
    level: float = LEVEL,
    replicates: int = REPLICATES,
    seed: int = 0,
    paired: bool = False,
) -> Interval:
    """Figure a minus figure b. ``paired``: seed i of a and seed i of b scored the same questions in
    the same order, and the bootstrap resamples their per-question differences (module docstring);
    else each side is bootstrapped on its own. ``seeds``/``questions`` are a's."""
    a, b = _arrays(a_by_seed), _arrays(b_by_seed)
    rng = np.random.default_rng(seed)
    if paired:
        if [len(x) for x in a] != [len(y) for y in b]:
            raise ValueError("a paired difference needs as many seeds on each side, each with as many questions")
        d = [x - y for x, y in zip(a, b)]
        return _interval(_pooled_mean(d), replicate_means(d, replicates, rng), level, a)
    draws = replicate_means(a, replicates, rng) - replicate_means(b, replicates, rng)
    return _interval(_pooled_mean(a) - _pooled_mean(b), draws, level, a)
