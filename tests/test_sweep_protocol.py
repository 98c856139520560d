"""What a length sweep's rows record under the headline protocol (issue 33): per-question scores
(for intervals over seeds), the background a context really holds (distinct tokens, less than its
length once it wraps around the corpus), NIAH searched with T = each task's asked needles and
scored by a reader beside retrieval, and the provenance and selection of the table."""

from __future__ import annotations

import pytest
import torch

from qrag.config import load_config
from qrag.evaluation.lengths import NEEDLES, run_sweep, sweep_model, task_steps
from test_longctx_data import write_qa1_data

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def cfg(tiny_encoder, tmp_path_factory):
    data = write_qa1_data(tmp_path_factory.mktemp("protocol"))
    return load_config(
        None,
        [
            f"model.encoder={tiny_encoder}",
            "data.dataset=babilong",
            f"data.path={data / 'bg'}",
            f"data.facts_path={data / 'babi'}",
            "data.chunk_tokens=32",
            "search.max_steps=4",
        ],
    )


def test_niah_is_searched_with_its_asked_needles_and_answered_beside(cfg):
    calls = []

    def reader(records, samples, dataset):
        calls.append(dataset)
        for rec, sample in zip(records, samples):
            rec["ans_em"], rec["ans_f1"] = 1.0, 0.5  # what a reader scores, by RULER's rule for NIAH
        return {"answer_errors": 0, "reader_model": "fake"}

    rows = sweep_model(
        "untrained", "none", cfg, ["S1", "MV"], [4096], lambda n: 2, steps=NEEDLES, device=CPU, answer=reader
    )
    assert {r["task"]: r["steps"] for r in rows} == {"niah_single_1": 1, "niah_multivalue": 4}
    assert set(calls) == {"niah"}
    for r in rows:
        assert r["ans_em"] == 1.0 and r["ans_f1"] == 0.5 and r["reader_model"] == "fake"
        assert r["per_question"]["ans_f1"] == [0.5, 0.5] and len(r["per_question"]["id"]) == 2
    with pytest.raises(Exception, match="NIAH"):
        task_steps("qa1", NEEDLES)


def test_rows_record_per_question_scores_and_the_distinct_background(cfg):
    table = run_sweep([("untrained", "none")], cfg, ["qa1"], [1024, 40000], lambda n: 2, device=CPU)
    short, wrapped = sorted(table["rows"], key=lambda r: r["length"])
    for r in (short, wrapped):
        assert r["per_question"]["id"] and len(r["per_question"]["fact_em"]) == r["num_samples"] == 2
        assert r["hard_negatives"] == 0 and r["train_questions"]["checked"]
    assert short["distinct_background_tokens"] <= short["context_tokens"]
    # 40K tokens wrap around the ~25K-token dev book: the context holds no more than the corpus
    assert wrapped["haystack_tokens"] < wrapped["context_tokens"]
    assert wrapped["distinct_background_tokens"] <= wrapped["haystack_tokens"]
    assert table["dev_draw"]["name"] and table["selected_on"].startswith("nothing")
    assert {"git_commit", "git_dirty", "git_diff_sha256"} <= set(table)
