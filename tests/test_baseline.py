"""The untrained row ("multi-step RAG w/o FT") scores with the pretrained encoder's own
similarity: the full-vector cosine of its mean-pooled embeddings, as in the paper."""

import pytest
import torch
import torch.nn.functional as F

from qrag.model.checkpoint import baseline_label, baseline_qnet, untrained_qnet
from qrag.config import ModelConfig, SearchConfig
from qrag.data.sample import Sample
from qrag.model.encoder import encode
from qrag.retrieval.search import Retriever
from qrag.data.tokens import tokenize_samples

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def sample_and_pooled(tiny_encoder):
    # A trained-like config (relative positions, twin halves): the baseline must ignore both.
    qnet, tok, layout = untrained_qnet(ModelConfig(encoder=tiny_encoder, positions="relative"), CPU)
    samples = [
        Sample(
            "s",
            "who painted the castle",
            [f"the {w} was painted by someone" for w in ("castle", "river", "ship", "king")],
            [0],
        )
    ]
    [ts] = tokenize_samples(samples, tok, layout, chunk_tokens=32, question_tokens=16)
    raw = qnet.state_encoder.eval()
    pooled_q = encode(raw, [layout.state(ts.question, [])], pad_id=layout.pad_id, device=CPU)
    pooled_c = encode(qnet.action_encoder.eval(), ts.chunks, pad_id=layout.pad_id, device=CPU)
    return ts, layout, pooled_q, pooled_c


def _first_step_scores(qnet, layout, ts):
    r = Retriever(qnet, layout, CPU)
    state = r.embed_states([layout.state(ts.question, [])])
    chunks = r.embed_chunks(ts.chunks)
    return r.score(state, chunks, torch.zeros(1, ts.n_chunks, dtype=torch.bool), torch.tensor([ts.n_chunks]))[0]


def test_untrained_baseline_is_the_full_vector_cosine(tiny_encoder, sample_and_pooled):
    # Planted bug it catches: "none" mapped to the twin-half scoring (mean of two half cosines).
    ts, layout, pq, pc = sample_and_pooled
    qnet, _, _ = baseline_qnet(ModelConfig(encoder=tiny_encoder, positions="relative"), CPU, "none")
    assert (qnet.cfg.positions, qnet.cfg.similarity) == ("none", "cosine")
    expected = F.cosine_similarity(pq, pc, dim=-1)
    assert _first_step_scores(qnet, layout, ts) == pytest.approx(expected.tolist(), abs=1e-5)
    # and the search reports that same Q for the chunk it picks
    [ret] = Retriever(qnet, layout, CPU).retrieve([ts], SearchConfig(max_steps=1))
    assert ret.steps[0].q == pytest.approx(float(expected.max()), abs=1e-5)
    assert ret.selected == [int(expected.argmax())]


def test_half_vector_variant_is_kept_apart_and_labelled(tiny_encoder, sample_and_pooled):
    ts, layout, pq, pc = sample_and_pooled
    qnet, _, _ = baseline_qnet(ModelConfig(encoder=tiny_encoder), CPU, "none:twin")
    h = pq.shape[-1] // 2
    expected = 0.5 * (
        F.cosine_similarity(pq[:, :h], pc[:, :h], dim=-1) + F.cosine_similarity(pq[:, h:], pc[:, h:], dim=-1)
    )
    assert _first_step_scores(qnet, layout, ts) == pytest.approx(expected.tolist(), abs=1e-5)
    full = F.cosine_similarity(pq, pc, dim=-1)
    assert not torch.allclose(expected, full, atol=1e-3)  # the two rules really differ here
    assert baseline_label("cosine") == "Multi-step RAG w/o FT"
    assert "half-vector" in baseline_label("twin")


def test_eval_of_none_records_the_paper_baseline(tiny_cfg):
    from qrag.evaluation.evaluate import evaluate_checkpoint
    from qrag.evaluation.report import method_label

    paper = evaluate_checkpoint("none", tiny_cfg, split="dev", limit=4)
    extra = evaluate_checkpoint("none:twin", tiny_cfg, split="dev", limit=4)
    assert (paper["similarity"], extra["similarity"]) == ("cosine", "twin")
    assert method_label(paper) == "Multi-step RAG w/o FT"
    assert "half-vector" in method_label(extra)
    # summaries written before the option existed were the half-vector variant
    assert "half-vector" in method_label({"checkpoint": "none", "dataset": "hotpotqa"})


def test_a_run_is_named_by_its_objective():
    from qrag.evaluation.methods import method_label

    assert method_label({"checkpoint": "runs/a/best", "objective": "sft"}) == "SFT"
    assert method_label({"objective": "sft_trajectory", "search": {"beam_width": 1}}) == "SFT trajectory"
    assert method_label({"objective": "sft", "search": {"beam_width": 4}}) == "Plan SFT"
    assert method_label({"checkpoint": "runs/a/best"}) == "Q-RAG"  # written before objectives were recorded
    assert method_label({"objective": "sft", "label": "ours"}) == "ours"
