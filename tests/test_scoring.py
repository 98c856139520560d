"""Per-question scoring of retrievals under each protocol (qrag.evaluation.evaluate.score_retrievals).

Planted bug this catches (issue 33; seen failing with it): the oracle stop cutting the picks one
step late (the pick after the one that completes the support counted too).
"""

from __future__ import annotations

import pytest

from qrag.data.sample import Sample
from qrag.evaluation.evaluate import score_retrievals
from qrag.evaluation.seeds import per_question
from qrag.retrieval.multistep import Retrieval, Step

CHUNKS = [f"chunk {i}" for i in range(8)]


def retrieval(picks: list[int]) -> Retrieval:
    return Retrieval("s", [Step(chunk=c, q=0.5, position=None, alternatives=[]) for c in picks])


@pytest.mark.parametrize(
    "picks,complete,em,f1,oracle_f1",
    [
        ([2, 5, 1, 7], 2, 1.0, 2 / 3, 1.0),  # support complete at the 2nd pick: the oracle keeps exactly 2
        ([1, 2, 5, 7], 3, 1.0, 2 / 3, 0.8),  # ... at the 3rd pick: 2 of 3 oracle picks are support
        ([2, 1, 3, 7], None, 0.0, 1 / 3, 1 / 3),  # never complete: the oracle keeps every pick
        ([5, 2, 0, 1], 2, 1.0, 2 / 3, 1.0),
    ],
)
def test_oracle_stop_keeps_the_picks_up_to_the_one_that_completes_the_support(picks, complete, em, f1, oracle_f1):
    sample = Sample("s", "q?", CHUNKS, [2, 5])
    rec = score_retrievals([sample], [retrieval(picks)])[0]
    assert rec["complete_at"] == complete
    assert rec["fact_em"] == em and rec["fact_f1"] == pytest.approx(f1)
    assert rec["oracle_fact_em"] == em and rec["oracle_fact_f1"] == pytest.approx(oracle_f1)


def test_per_question_columns_keep_each_questions_scores_in_order():
    samples = [Sample(f"s{i}", "q?", CHUNKS, [i]) for i in range(3)]
    records = score_retrievals(samples, [retrieval([0, 1]), retrieval([3, 1]), retrieval([5, 6])])
    cols = per_question(records)
    assert cols["id"] == ["s0", "s1", "s2"]
    assert cols["fact_em"] == [1.0, 1.0, 0.0] and cols["oracle_fact_f1"] == [1.0, pytest.approx(2 / 3), 0.0]
