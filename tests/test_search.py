import numpy as np
import pytest
import torch

from qrag.model.checkpoint import untrained_qnet
from qrag.config import ModelConfig, SearchConfig
from qrag.data.sample import Sample
from qrag.retrieval.search import Retriever
from qrag.data.tokens import tokenize_samples


@pytest.fixture(scope="module")
def setup(tiny_encoder):
    qnet, tok, layout = untrained_qnet(ModelConfig(encoder=tiny_encoder, positions="relative"), torch.device("cpu"))
    samples = [
        Sample(f"s{i}", f"who wrote book {i}", [f"paragraph {j} about topic {i * j}" for j in range(5 + i)], [0])
        for i in range(4)
    ]
    tok_samples = tokenize_samples(samples, tok, layout, chunk_tokens=32, question_tokens=16)
    return Retriever(qnet, layout, torch.device("cpu")), tok_samples


def manual_greedy(retriever, sample, steps):
    chunks = retriever.embed_chunks(sample.chunks)
    chosen = []
    for _ in range(steps):
        state = retriever.embed_states(
            [retriever.layout.state(sample.question, [sample.chunks[i] for i in sorted(chosen)])]
        )
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


RULES = {"min": lambda qs: min(qs), "last": lambda qs: qs[-1]}


@pytest.mark.parametrize("rule", list(RULES))
def test_beam_search_never_scores_below_greedy(setup, rule):
    """For T = 2 greedy's path is among beam search's final candidates, so under any rule the
    returned path scores at least as high. Planted bug caught: the beam keeps the worst paths."""
    retriever, samples = setup
    greedy = retriever.retrieve(samples, SearchConfig(max_steps=2))
    beam = retriever.retrieve(samples, SearchConfig(max_steps=2, beam_width=4, beam_score=rule))
    score = RULES[rule]
    for g, b in zip(greedy, beam):
        assert len(b.selected) == 2
        assert score([st.q for st in b.steps]) >= score([st.q for st in g.steps]) - 1e-6


def scripted(retriever, monkeypatch, levels):
    """Q of chunk i after k selections = levels[k] - 0.01·i: the search logic alone, on real shapes."""

    def score(states, chunk_vecs, selected, n_chunks, block=None, positions=None):
        n = selected.shape[1]
        k = selected.sum(1).clamp(max=len(levels) - 1)
        return (
            torch.tensor(levels, dtype=torch.float32)[k][:, None] - 0.01 * torch.arange(n, dtype=torch.float32)[None, :]
        )

    monkeypatch.setattr(retriever, "score", score)


def test_min_rule_follows_greedy_when_later_steps_are_capped(setup, monkeypatch):
    """Every second-step Q exceeds every first-step Q: all paths are capped by their first step, and
    the tie goes to the child with the higher Q, i.e. greedy's path. Planted bug caught: ties
    resolved against the last step's Q (or by the worst parent)."""
    retriever, samples = setup
    scripted(retriever, monkeypatch, [0.5, 0.9])
    greedy = retriever.retrieve(samples[:1], SearchConfig(max_steps=2))[0]
    beam = retriever.retrieve(samples[:1], SearchConfig(max_steps=2, beam_width=4, beam_score="min"))[0]
    assert greedy.selected == [0, 1]
    assert beam.selected == greedy.selected
    with pytest.raises(ValueError, match="beam_score"):
        retriever.retrieve(samples[:1], SearchConfig(max_steps=2, beam_width=2, beam_score="mean"))


def scripted_by_path(retriever, monkeypatch, table):
    """Q of every chunk given the chunks already chosen: ``table[frozenset(chosen)]``."""

    def score(states, chunk_vecs, selected, n_chunks, block=None, positions=None):
        rows = [table[frozenset(np.flatnonzero(row.numpy()).tolist())] for row in selected]
        return torch.tensor(rows, dtype=torch.float32)

    monkeypatch.setattr(retriever, "score", score)


LOW = -50.0  # a chunk no path should take


def test_logprob_rule_ranks_paths_by_the_policys_probability(setup, monkeypatch):
    """After chunk 0 the next pick is a coin toss among four; after chunk 1 it is near certain, at a
    lower level of Q. min follows the higher first-step Q and its higher (but flat) later Qs to
    {0, 1}; logprob takes the path the policy is surest of, {1, 2}. Planted bugs caught: each step
    normalised over the chosen chunk alone (every log-probability 0: ties go to greedy), the
    normaliser left out (logprob becomes the sum of Qs: {0, 1} again)."""
    retriever, samples = setup  # samples[0] has 5 chunks
    scripted_by_path(
        retriever,
        monkeypatch,
        {
            frozenset(): [1.0, 0.9, LOW, LOW, LOW],
            frozenset({0}): [LOW, 0.0, 0.0, 0.0, 0.0],
            frozenset({1}): [LOW, LOW, -5.0, -12.0, -12.0],
        },
    )
    by_rule = {
        rule: retriever.retrieve(
            samples[:1], SearchConfig(max_steps=2, beam_width=2, beam_score=rule, beam_temperature=1.0)
        )[0].selected
        for rule in ("min", "logprob")
    }
    assert by_rule == {"min": [0, 1], "logprob": [1, 2]}
    with pytest.raises(ValueError, match="beam_temperature"):
        retriever.retrieve(
            samples[:1], SearchConfig(max_steps=2, beam_width=2, beam_score="logprob", beam_temperature=0)
        )


def test_logprob_rule_charges_a_stopped_path_its_stop(setup, monkeypatch):
    """With a threshold the stop is one more option (Q = the threshold). {0} stops at step 2, where
    its stop has probability 1/(1 + 4/e) ≈ 0.40; {1, 0} goes on at probability ≈ 0.52: the longer path
    is more probable. Planted bug caught: a stopped path keeps its parent's score (then {0} wins)."""
    retriever, samples = setup
    scripted_by_path(
        retriever,
        monkeypatch,
        {
            frozenset(): [1.0, 0.9, LOW, LOW, LOW],
            frozenset({0}): [LOW, -1.0, -1.0, -1.0, -1.0],
            frozenset({1}): [0.1, LOW, LOW, LOW, LOW],
        },
    )
    cfg = SearchConfig(max_steps=2, beam_width=2, beam_score="logprob", beam_temperature=1.0, stop_threshold=0.0)
    [r] = retriever.retrieve(samples[:1], cfg)
    assert r.selected == [1, 0] and not r.stopped_early


@pytest.mark.parametrize("beam_width", [1, 3])
def test_stop_threshold(setup, monkeypatch, beam_width):
    """Scripted Qs that fall step by step (0.9, 0.5, 0.2): every threshold case runs, whatever the
    encoder's weights. Planted bugs caught: the threshold never checked after the first step, a
    stop that drops the last chunk, stopped_early not set."""
    retriever, samples = setup
    cfg = lambda t: SearchConfig(max_steps=3, stop_threshold=t, beam_width=beam_width)  # noqa: E731
    never = retriever.retrieve(samples, cfg(-10.0))
    assert all(len(r.selected) == 3 and not r.stopped_early for r in never)
    always = retriever.retrieve(samples, cfg(10.0))
    assert all(r.selected == [] and r.stopped_early for r in always)
    scripted(retriever, monkeypatch, [0.9, 0.5, 0.2, 0.1])
    after = {0.7: 1, 0.3: 2}
    for threshold, steps in after.items():
        [r] = retriever.retrieve(samples[:1], cfg(threshold))
        assert sorted(r.selected) == list(range(steps)) and r.stopped_early, (threshold, r.selected)
    [r] = retriever.retrieve(samples[:1], cfg(0.15))
    assert sorted(r.selected) == [0, 1, 2] and not r.stopped_early


def test_chunk_batch_does_not_change_embeddings(setup):
    retriever, samples = setup
    a = retriever.embed_chunks(samples[3].chunks, chunk_batch=2)
    b = retriever.embed_chunks(samples[3].chunks, chunk_batch=1000)
    assert torch.allclose(a, b, atol=1e-5)
    assert np.isfinite(a.numpy()).all()
