"""Q-threshold early stopping, analysed from one full-length run."""

from __future__ import annotations

import numpy as np
import pytest

from qrag.evaluation.early_stopping import analyse, analyse_threshold, roc_auc, traces_from_records


def rec(id, gold, picks, q, **kw):
    return {"id": id, "gold": gold, "retrieved": picks, "q_values": q, **kw}


RECORDS = [
    rec("a", [1, 2], [1, 2, 5, 6], [0.9, 0.8, 0.05, -0.2]),  # gold complete after 2 picks
    rec("b", [3], [4, 3, 7], [0.5, 0.4, 0.3]),  # complete after 2
    rec("c", [9], [1, 2, 3], [0.2, 0.1, 0.0]),  # never complete
]


def test_shares_lengths_and_fact_scores_by_hand():
    traces = traces_from_records(RECORDS)
    assert [t.t_earliest for t in traces] == [2, 2, None]
    row = analyse_threshold(traces, 0.1)
    # a stops after 2 (perfect), b after 3 (late), c after 2 (not in the shares: never complete).
    assert (row["early"], row["perfect"], row["late"]) == (0.0, 0.5, 0.5)
    assert row["episode_len"] == pytest.approx(7 / 3)
    assert row["fact_em"] == pytest.approx(2 / 3)
    assert row["fact_f1"] == pytest.approx((1.0 + 0.5 + 0.0) / 3)
    # Per step: should take a_t while the gold set is incomplete before it (always, for c).
    assert row["tpr"] == pytest.approx(6 / 7) and row["fpr"] == pytest.approx(1 / 3)
    high = analyse_threshold(traces, 0.85)
    assert (high["early"], high["perfect"], high["late"]) == (1.0, 0.0, 0.0)
    assert high["episode_len"] == pytest.approx(1 / 3) and high["fact_em"] == 0.0
    low = analyse_threshold(traces, -1.0)
    assert (
        low["late"] == 1.0 and low["episode_len"] == pytest.approx(10 / 3) and low["tpr"] == 1.0 and low["fpr"] == 1.0
    )
    assert roc_auc(traces) == pytest.approx(17 / 21)


def test_analyse_table_and_oracle():
    table = analyse(RECORDS, [0.5, -0.1, 0.1])
    assert [r["threshold"] for r in table["rows"]] == [-0.1, 0.1, 0.5]
    assert table["episodes"] == 3 and table["collected_gold"] == 2 and table["max_steps"] == 4
    assert table["oracle"]["episode_len"] == pytest.approx((2 + 2 + 3) / 3)
    assert table["oracle"]["fact_em"] == pytest.approx(2 / 3)
    assert len(analyse(RECORDS)["rows"]) == 13  # the paper's -0.1 .. 1.1


def test_refuses_thresholded_or_incomplete_records():
    with pytest.raises(ValueError, match="stopped on a Q threshold"):
        analyse([rec("x", [1], [1], [0.5], stopped_early=True)])
    with pytest.raises(ValueError, match="no list field 'q_values'"):
        analyse([{"id": "x", "gold": [1], "retrieved": [1]}])
    with pytest.raises(ValueError, match="2 picks but 1 Q values"):
        analyse([rec("x", [1], [1, 2], [0.5])])


def test_offline_analysis_equals_rerunning_the_search(tiny_encoder, hotpot_file):
    """Thresholding the full-length run's Q values gives what a search with that threshold gives."""
    from qrag.config import ModelConfig, SearchConfig, load_config
    from qrag.model.checkpoint import untrained_qnet
    from qrag.data import load_samples
    from qrag.data.chunking import tokenizer_counter
    from qrag.evaluation.evaluate import evaluate
    from qrag.retrieval.search import Retriever
    from qrag.data.tokens import tokenize_samples
    import torch

    cfg = load_config(None, [f"model.encoder={tiny_encoder}", f"data.path={hotpot_file}", "data.chunk_tokens=48"])
    qnet, tok, layout = untrained_qnet(ModelConfig(encoder=tiny_encoder), torch.device("cpu"))
    samples = load_samples(cfg.data, "all", tokenizer_counter(tok))[:16]
    tokenized = tokenize_samples(samples, tok, layout, chunk_tokens=48, question_tokens=64)
    retriever = Retriever(qnet, layout, torch.device("cpu"))
    full = evaluate(retriever, samples, tokenized, SearchConfig(max_steps=5))
    qs = np.array([q for r in full.records for q in r["q_values"]])
    thresholds = [float(np.quantile(qs, p)) + 1e-6 for p in (0.2, 0.5, 0.8)]
    table = analyse(full.records, thresholds)
    for row, th in zip(table["rows"], thresholds):
        rerun = evaluate(retriever, samples, tokenized, SearchConfig(max_steps=5, stop_threshold=th))
        assert row["fact_em"] == pytest.approx(rerun.summary["fact_em"])
        assert row["fact_f1"] == pytest.approx(rerun.summary["fact_f1"])
        assert row["episode_len"] == pytest.approx(rerun.summary["avg_steps"])
