"""Length sweeps: the reuse shortcuts are exact, the scoring rewrite matches the rotation, and a
tiny BabiLong/NIAH training + `qrag sweep-lengths` run writes its table and plot end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from qrag.model.checkpoint import untrained_qnet
from qrag.config import DataConfig, ModelConfig, SearchConfig
from qrag.data.haystack import Measure
from qrag.evaluation.lengths import length_label, parse_length
from qrag.evaluation.longcontext import CachingRetriever, ChunkTokens, canonical_task, generate
from qrag.model.qnet import QNetwork
from qrag.retrieval.search import Retriever
from qrag.data.tokens import tokenize_samples

from test_longctx_data import write_qa1_data

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_qa1_data(tmp_path_factory.mktemp("lengths"))


@pytest.fixture(scope="module")
def model(tiny_encoder):
    return untrained_qnet(ModelConfig(encoder=tiny_encoder, positions="relative"), torch.device("cpu"))


def test_length_parsing():
    assert [parse_length(x) for x in ("4096", "4k", "1m", "10M", "0.5k")] == [4096, 4096, 2**20, 10 * 2**20, 512]
    assert canonical_task("S1") == "niah_single_1" and canonical_task("QA3") == "qa3"
    with pytest.raises(ValueError):
        parse_length("lots")


def test_one_length_label_for_sweeps_and_reports():
    """qrag sweep-lengths and qrag report label lengths with one function: binary multiples
    with K/M, any other size as its number (so no label names two lengths)."""
    from qrag.evaluation import report
    from qrag.data import contexts

    assert report.length_label is length_label is contexts.length_label
    assert parse_length is contexts.parse_length
    labels = {
        1024: "1K",
        4096: "4K",
        32768: "32K",
        131072: "128K",
        2**20: "1M",
        10 * 2**20: "10M",
        2048: "2K",
        1536: "1536",
        1000: "1000",
        10**6: "1000000",
        512: "512",
        2**30: "1024M",
        0: "0",
    }
    assert {n: length_label(n) for n in labels} == labels
    assert all(parse_length(label) == n for n, label in labels.items())
    assert length_label(4096.0) == "4K"  # a float length from JSON


@pytest.mark.parametrize("positions", ["relative", "absolute", "none"])
def test_score_matches_explicit_rotation(model, positions):
    qnet, _, layout = model
    qnet.cfg.positions = positions
    try:
        r = Retriever(qnet, layout, torch.device("cpu"))
        g = torch.Generator().manual_seed(0)
        rows, n, d = 3, 3000, 32
        states, vecs = torch.randn(rows, d, generator=g), torch.randn(n, d, generator=g)
        selected = torch.zeros(rows, n, dtype=torch.bool)
        selected[0, [4, 900]] = selected[1, 2999] = True
        counts = torch.tensor([n, n, 2000])
        pos = qnet.positions(selected, counts)
        ref = QNetwork.twin_scores(states, qnet.place(vecs.expand(rows, -1, -1), pos)).mean(-1)
        for block in (None, 1000):
            assert torch.allclose(r.score(states, vecs, selected, counts, block=block), ref, atol=1e-5)
        per_row = torch.randn(rows, n, d, generator=g)
        ref = QNetwork.twin_scores(states, qnet.place(per_row, pos)).mean(-1)
        assert torch.allclose(r.score(states, per_row, selected, counts, block=700), ref, atol=1e-5)
    finally:
        qnet.cfg.positions = "relative"


def generated(data, measure, task="qa1", length=2048, n=4):
    cfg = DataConfig(
        dataset="babilong" if task.startswith("qa") else "niah",
        path=str(data / "bg") if task.startswith("qa") else None,
        facts_path=str(data / "babi"),
        chunk_tokens=32,
    )
    return list(generate(task, "dev", length, n, measure, cfg))


def test_chunk_tokens_equal_plain_tokenisation(data, model):
    _, tokenizer, layout = model
    items = generated(data, Measure.from_tokenizer(tokenizer), length=3000)
    fast = ChunkTokens(tokenizer, layout, 32, 48)(items)
    slow = tokenize_samples([g.sample for g in items], tokenizer, layout, chunk_tokens=32, question_tokens=48)
    for a, b in zip(fast, slow):
        assert np.array_equal(a.question, b.question) and np.array_equal(a.support, b.support)
        assert len(a.chunks) == len(b.chunks) and all(np.array_equal(x, y) for x, y in zip(a.chunks, b.chunks))


@pytest.mark.parametrize("task", ["qa1", "niah_single_1"])
def test_generated_sentences_are_tokenised_once(data, model, task):
    """The generator measures each fact / needle once to fit the length and keeps the ids;
    ChunkTokens builds the token arrays from them (and from the haystack's segment ids) without
    tokenising any chunk text again, and gets what plain tokenisation gets."""
    _, tokenizer, layout = model
    seen: list[str] = []

    class Recording:  # the tokenizer, recording every text it is asked to tokenise
        def __call__(self, texts, **kw):
            seen.extend(texts)
            return tokenizer(texts, **kw)

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    measure = Measure.from_tokenizer(Recording())
    items = generated(data, measure, task=task, length=4096)
    fresh = [g.sample.chunks[i] for g in items for i in np.flatnonzero(g.refs < 0)]
    assert fresh and all(g.fresh_ids is not None for g in items)
    # Stories share facts and samples share fill text: at most once per sample that holds it.
    assert all(seen.count(t) <= fresh.count(t) for t in set(fresh)), (
        "a fact or needle was tokenised twice in one sample"
    )
    seen.clear()
    fast = ChunkTokens(Recording(), layout, 32, 48)(items)
    assert seen == [g.sample.question for g in items]  # only the questions are tokenised now
    slow = tokenize_samples([g.sample for g in items], tokenizer, layout, chunk_tokens=32, question_tokens=48)
    for a, b in zip(fast, slow):
        assert len(a.chunks) == len(b.chunks) and all(np.array_equal(x, y) for x, y in zip(a.chunks, b.chunks))


def test_caching_retriever_is_exact_and_reuses_book_chunks(data, model):
    qnet, tokenizer, layout = model
    items = generated(data, Measure.from_tokenizer(tokenizer), length=6000, n=6)
    tokens = ChunkTokens(tokenizer, layout, 32, 48)
    tok = tokens(items)
    plain = Retriever(qnet, layout, torch.device("cpu")).retrieve(tok, SearchConfig(max_steps=3))
    caching = CachingRetriever(qnet, layout, torch.device("cpu"), shared=tokens.shared)
    first = caching.retrieve(tok[:3], SearchConfig(max_steps=3))
    rest = caching.retrieve(tok[3:], SearchConfig(max_steps=3))
    assert [r.selected for r in first + rest] == [r.selected for r in plain]
    assert caching.cached > 0 and caching.hits > 0  # the 800-sentence book wraps: chunks repeat


def test_niah_val_draw_builds_only_the_contexts_it_keeps(model, monkeypatch):
    """The NIAH val split is train samples held out by their id: the draw yields what building
    every train sample and filtering yields, but assembles only the contexts it keeps (at 1M
    tokens each skipped one would cost a whole context)."""
    from itertools import islice

    from qrag.data import niah
    from qrag.data.splits import in_validation
    from qrag.evaluation.lengths import generate_split

    _, tokenizer, _ = model
    measure = Measure.from_tokenizer(tokenizer)
    cfg = DataConfig(dataset="niah", chunk_tokens=32, val_fraction=0.2)
    task, length, n = "niah_single_1", 1024, 3
    everything = generate(task, "train", length, 200, measure, cfg)
    expected = [g.sample for g in islice((g for g in everything if in_validation(g.sample.id, 0.2)), n)]
    assert int(expected[-1].id.rsplit("-", 1)[1]) >= n  # the draw passes over train samples

    real, built = niah.assemble, []

    def counting(hay, window, texts, rng):
        built.append(len(texts))
        return real(hay, window, texts, rng)

    monkeypatch.setattr(niah, "assemble", counting)
    drawn = [g.sample for g in generate_split(task, "val", length, n, measure, cfg)]
    assert [(s.id, s.question, s.support, s.chunks) for s in drawn] == [
        (s.id, s.question, s.support, s.chunks) for s in expected
    ]
    assert len(built) == n


def test_train_then_sweep_lengths_end_to_end(data, tiny_encoder, tmp_path, monkeypatch):
    from qrag.cli import main

    monkeypatch.chdir(tmp_path)
    common = [
        f"model.encoder={tiny_encoder}",
        f"data.path={data / 'bg'}",
        f"data.facts_path={data / 'babi'}",
        "data.chunk_tokens=32",
    ]
    assert (
        main(
            [
                "train",
                "--config",
                str(ROOT / "configs" / "babilong-qa1.yaml"),
                "--no-progress",
                *common,
                f"out_dir={tmp_path / 'runs'}",
                "updates=2",
                "data.context_tokens=512",
                "data.samples_per_task=8",
                "data.dev_samples_per_task=2",
                "learner.episodes_per_update=4",
                "learner.micro_batch=4",
                "learner.warmup_updates=1",
                "eval_every=0",
                "checkpoint_every=0",
                "data.val_fraction=0.5",
            ]
        )
        == 0
    )
    ckpt = tmp_path / "runs" / "babilong-qa1" / "final"
    out = tmp_path / "sweep.json"
    assert (
        main(
            [
                "sweep-lengths",
                "--config",
                str(ROOT / "configs" / "babilong-qa1.yaml"),
                "--checkpoint",
                f"Q-RAG={ckpt}",
                "--checkpoint",
                "none",
                "--tasks",
                "qa1,S1",
                "--lengths",
                "512,4k",
                "--samples",
                "3",
                "--samples-at",
                "4k=2",
                "--val-samples",
                "2",
                "--out",
                str(out),
                *common,
                "data.context_tokens=512",
                "data.val_fraction=0.5",
            ]
        )
        == 0
    )
    table = json.loads(out.read_text())
    assert table["schema"] == "qrag.length_sweep/1" and table["memory"] == "rss_peak"
    rows = table["rows"]
    assert len(rows) == 2 * 2 * 2
    assert {(r["model"], r["task"], r["length"]) for r in rows} == {
        (m, t, n) for m in ("Q-RAG", "untrained") for t in ("qa1", "niah_single_1") for n in (512, 4096)
    }
    for r in rows:
        assert r["num_samples"] == (3 if r["length"] == 512 else 2)
        assert 0.0 <= r["fact_em"] <= 1.0 and 0.0 <= r["fact_f1"] <= 1.0
        # T = 4 (the preset's search.max_steps, the paper's protocol), never the answer key's T
        assert r["steps"] == 4
        # stopping at complete support keeps EM and can only raise F1
        assert r["oracle_fact_em"] == r["fact_em"] and r["oracle_fact_f1"] >= r["fact_f1"] - 1e-9
        assert r["credit"] == "chunk"
        assert "threshold" in r and 0.0 <= r["threshold_fact_f1"] <= 1.0 and r["threshold_steps"] <= 4
        # the stop's own score on the validation questions it was chosen on, beside the oracle's there
        assert 0.0 <= r["threshold_val_fact_f1"] <= 1.0 and 0.0 <= r["oracle_val_fact_f1"] <= 1.0
        assert r["threshold_val_questions"] == 2  # --val-samples
    for model, task in {(r["model"], r["task"]) for r in rows}:  # a property of the val split, not of a length
        assert len({r["threshold_val_fact_f1"] for r in rows if (r["model"], r["task"]) == (model, task)}) == 1
        assert r["peak_memory_mb"] > 0 and r["seconds_per_question"] > 0
        assert abs(r["context_tokens"] - r["length"]) <= 0.02 * r["length"]
    assert {r["positions"] for r in rows if r["model"] == "untrained"} == {"none"}
    assert {r["positions"] for r in rows if r["model"] == "Q-RAG"} == {"relative"}
    assert out.with_suffix(".png").stat().st_size > 1000
    merged = tmp_path / "merged.json"
    assert main(["sweep-lengths", "--plot-only", str(out), "--out", str(merged)]) == 0
    assert json.loads(merged.read_text())["rows"] == rows
    # Settings are chosen on the val split at long lengths: held-out train questions, never dev's.
    val_out = tmp_path / "val.json"
    assert (
        main(
            [
                "sweep-lengths",
                "--config",
                str(ROOT / "configs" / "babilong-qa1.yaml"),
                "--checkpoint",
                f"Q-RAG={ckpt}",
                "--tasks",
                "qa1",
                "--lengths",
                "4k",
                "--samples",
                "2",
                "--split",
                "val",
                "--out",
                str(val_out),
                *common,
                "data.val_fraction=0.5",
            ]
        )
        == 0
    )
    val_rows = json.loads(val_out.read_text())["rows"]
    assert len(val_rows) == 1 and val_rows[0]["num_samples"] == 2


def test_job_task_flag_becomes_an_override():
    sys.path.insert(0, str(ROOT / "jobs"))
    from train_babilong import tasks_to_overrides

    assert tasks_to_overrides(["--tasks", "qa1, qa2", "updates=5"]) == ["data.tasks=[qa1,qa2]", "updates=5"]
    assert tasks_to_overrides(["--tasks=S1", "--base-dir", "/x"]) == ["data.tasks=[S1]", "--base-dir", "/x"]


def test_printed_table_names_each_protocol_headline_first():
    """Issue 11: every table says its protocol, T and credit rule; Fact EM (no oracle) first."""
    from qrag.evaluation.lengths import format_table

    row = {
        "model": "Q-RAG",
        "task": "qa3",
        "length": 4096,
        "steps": 4,
        "credit": "text",
        "fact_em": 0.5,
        "fact_f1": 0.25,
        "oracle_fact_em": 0.5,
        "oracle_fact_f1": 0.75,
        "threshold_fact_f1": 0.6,
    }
    text = format_table({"rows": [row, {**row, "length": 1 << 20, "fact_em": 0.4}]})
    blocks = text.split("\n\n")
    assert [b.splitlines()[0].split(":")[0] for b in blocks] == [
        "Fact EM (%)",
        "Fact F1 (%)",
        "Fact F1 (%)",
        "Fact F1 (%)",
    ]
    assert all("T = 4; credit: text" in b.splitlines()[0] for b in blocks)
    assert (
        "no oracle" in blocks[0]
        and "oracle stop" in blocks[1]
        and "learned stop" in blocks[2]
        and "no stop" in blocks[3]
    )
    assert (
        blocks[0].splitlines()[2].split()[-2:] == ["50.0", "40.0"] and blocks[1].splitlines()[2].split()[-1] == "75.0"
    )
    no_threshold = {k: v for k, v in row.items() if k != "threshold_fact_f1"}
    assert "learned stop" not in format_table({"rows": [no_threshold]})
