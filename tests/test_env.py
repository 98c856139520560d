import numpy as np
import pytest

from qrag.config import EnvConfig
from qrag.rl.env import RetrievalEnv
from qrag.data.tokens import TokenizedSample, TokenLayout

LAYOUT = TokenLayout(cls_id=101, sep_id=102, pad_id=0, max_state_tokens=64)


def sample(n=5, support=(1, 3)):
    chunks = [LAYOUT.wrap([1000 + i, 2000 + i]) for i in range(n)]
    return TokenizedSample("s", LAYOUT.wrap([7, 8]), chunks, np.array(support))


def test_reward_once_at_success_and_termination():
    env = RetrievalEnv([sample(), sample()], EnvConfig(max_steps=3), LAYOUT)
    r, d = env.step(np.array([0, 1]), np.array([1, 0]))
    assert r.tolist() == [0, 0] and d.tolist() == [False, False]
    r, d = env.step(np.array([0, 1]), np.array([3, 2]))
    assert r.tolist() == [1, 0] and d.tolist() == [True, False]
    assert env.active.tolist() == [1]
    r, d = env.step(np.array([1]), np.array([4]))
    assert r.tolist() == [0] and d.tolist() == [True]  # T reached without success
    assert env.succeeded.tolist() == [True, False]


def test_penalize_extra_steps():
    env = RetrievalEnv([sample()], EnvConfig(max_steps=4, penalize_extra_steps=True), LAYOUT)
    for a in (0, 1, 2):
        r, _ = env.step(np.array([0]), np.array([a]))
    r, d = env.step(np.array([0]), np.array([3]))
    assert r[0] == pytest.approx(0.5 + 0.5 * 2 / 4) and d[0]


def test_never_terminate_keeps_stepping_with_zero_reward():
    env = RetrievalEnv([sample()], EnvConfig(max_steps=3, never_terminate=True), LAYOUT)
    env.step(np.array([0]), np.array([1]))
    r, d = env.step(np.array([0]), np.array([3]))
    assert r[0] == 1 and not d[0]
    r, d = env.step(np.array([0]), np.array([0]))
    assert r[0] == 0 and d[0] and env.episode_return[0] == 1


def test_states_are_in_document_order_and_unavailable_actions_rejected():
    env = RetrievalEnv([sample()], EnvConfig(max_steps=3), LAYOUT)
    assert env.states(np.array([0]))[0].tolist() == [101, 7, 8, 102]
    env.step(np.array([0]), np.array([4]))
    env.step(np.array([0]), np.array([2]))
    assert env.states(np.array([0]))[0].tolist() == [101, 7, 8, 102, 1002, 2002, 102, 1004, 2004, 102]
    with pytest.raises(ValueError, match="unavailable"):
        env.step(np.array([0]), np.array([2]))


def test_short_context_ends_when_chunks_run_out():
    env = RetrievalEnv([sample(n=2, support=(0, 1))], EnvConfig(max_steps=5), LAYOUT)
    env.step(np.array([0]), np.array([0]))
    _, d = env.step(np.array([0]), np.array([1]))
    assert d[0]


def test_state_truncation_keeps_every_selected_chunk():
    layout = TokenLayout(cls_id=101, sep_id=102, pad_id=0, max_state_tokens=12)
    q = layout.wrap([7, 8])
    chunks = [layout.wrap(list(range(100 + 10 * i, 108 + 10 * i))) for i in range(2)]
    state = layout.state(q, chunks)
    assert len(state) <= 12 and 100 in state and 110 in state and state[-1] == 102


def test_per_fact_reward_pays_each_new_fact_once():
    """env.reward=per_fact: 1/|F| at each step that finds a support fact not found before; a
    success's rewards sum to 1 as the terminal rule's single 1 does."""
    three = sample(n=6, support=(0, 2, 4))
    env = RetrievalEnv([three], EnvConfig(max_steps=4, reward="per_fact"), LAYOUT)
    got = [env.step(np.array([0]), np.array([a]))[0][0] for a in (2, 1, 0)]
    assert got == pytest.approx([1 / 3, 0.0, 1 / 3])
    r, d = env.step(np.array([0]), np.array([4]))
    assert r[0] == pytest.approx(1 / 3) and d[0] and env.episode_return[0] == pytest.approx(1.0)


def test_per_fact_reward_under_text_credit_counts_a_repeated_fact_once():
    chunks = [LAYOUT.wrap([1000 + i, 2000 + i]) for i in range(4)]
    chunks[3] = chunks[1]  # the same text as the support chunk 1
    s = TokenizedSample("s", LAYOUT.wrap([7, 8]), chunks, np.array([1, 2]))
    env = RetrievalEnv([s], EnvConfig(max_steps=4, reward="per_fact", credit="text"), LAYOUT)
    assert env.step(np.array([0]), np.array([3]))[0][0] == pytest.approx(0.5)
    assert env.step(np.array([0]), np.array([1]))[0][0] == 0.0  # fact 1 again, by its twin
    r, d = env.step(np.array([0]), np.array([2]))
    assert r[0] == pytest.approx(0.5) and d[0]


def test_unknown_reward_rule_and_per_fact_with_penalty_are_rejected():
    with pytest.raises(ValueError, match="env.reward"):
        RetrievalEnv([sample()], EnvConfig(reward="dense"), LAYOUT)
    with pytest.raises(ValueError, match="penalize_extra_steps"):
        RetrievalEnv([sample()], EnvConfig(reward="per_fact", penalize_extra_steps=True), LAYOUT)
