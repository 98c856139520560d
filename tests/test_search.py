import numpy as np
import pytest
import torch

from qrag.checkpoint import untrained_qnet
from qrag.config import ModelConfig, SearchConfig
from qrag.data.sample import Sample
from qrag.search import Retriever
from qrag.tokens import tokenize_samples


@pytest.fixture(scope="module")
def setup(tiny_encoder):
    qnet, tok, layout = untrained_qnet(ModelConfig(encoder=tiny_encoder, positions="relative"), torch.device("cpu"))
    samples = [Sample(f"s{i}", f"who wrote book {i}", [f"paragraph {j} about topic {i * j}" for j in range(5 + i)], [0]) for i in range(4)]
    tok_samples = tokenize_samples(samples, tok, layout, chunk_tokens=32, question_tokens=16)
    return Retriever(qnet, layout, torch.device("cpu")), tok_samples


def manual_greedy(retriever, sample, steps):
    chunks = retriever.embed_chunks(sample.chunks)
    chosen = []
    for _ in range(steps):
        state = retriever.embed_states([retriever.layout.state(sample.question, [sample.chunks[i] for i in sorted(chosen)])])
        selected = torch.zeros(1, sample.n_chunks, dtype=torch.bool)
        selected[0, chosen] = True
        q = retriever.score(state, chunks, selected, torch.tensor([sample.n_chunks]))[0]
        q[selected[0]] = float("-inf")
        chosen.append(int(q.argmax()))
    return chosen


def test_greedy_matches_step_by_step_argmax_and_batching_changes_nothing(setup):
    retriever, samples = setup
    batched = retriever.retrieve(samples, SearchConfig(max_steps=3))
    alone = [retriever.retrieve([s], SearchConfig(max_steps=3))[0] for s in samples]
    for s, b, a in zip(samples, batched, alone):
        assert b.selected == manual_greedy(retriever, s, 3)
        assert b.selected == a.selected
        assert len(set(b.selected)) == 3
        assert [st.q for st in b.steps] == pytest.approx([st.q for st in a.steps], abs=1e-5)


def test_beam_search_finds_at_least_the_greedy_value(setup):
    retriever, samples = setup
    greedy = retriever.retrieve(samples, SearchConfig(max_steps=2))
    beam = retriever.retrieve(samples, SearchConfig(max_steps=2, beam_width=4))
    for g, b in zip(greedy, beam):
        assert len(b.selected) == 2
        assert b.steps[-1].q >= g.steps[-1].q - 1e-6


def test_stop_threshold(setup):
    retriever, samples = setup
    never = retriever.retrieve(samples, SearchConfig(max_steps=3, stop_threshold=-10.0))
    assert all(len(r.selected) == 3 and not r.stopped_early for r in never)
    always = retriever.retrieve(samples, SearchConfig(max_steps=3, stop_threshold=10.0))
    assert all(r.selected == [] and r.stopped_early for r in always)
    # a threshold between the first and second step's Q stops after one step
    full = retriever.retrieve(samples[:1], SearchConfig(max_steps=3))[0]
    qs = [s.q for s in full.steps]
    if qs[1] < qs[0]:
        mid = retriever.retrieve(samples[:1], SearchConfig(max_steps=3, stop_threshold=(qs[0] + qs[1]) / 2))[0]
        assert mid.selected == full.selected[:1] and mid.stopped_early


def test_chunk_batch_does_not_change_embeddings(setup):
    retriever, samples = setup
    a = retriever.embed_chunks(samples[3].chunks, chunk_batch=2)
    b = retriever.embed_chunks(samples[3].chunks, chunk_batch=1000)
    assert torch.allclose(a, b, atol=1e-5)
    assert np.isfinite(a.numpy()).all()
