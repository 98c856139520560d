"""Training from the answer alone (data.supervision=answer): the answer-bearing chunks become a
training question's support, any one of them a success; validation and dev keep their support."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from qrag.config import EnvConfig
from qrag.data.answer_support import answer_chunks, answer_supervised, training_part
from qrag.data.credit import support_classes
from qrag.data.sample import DataError, Sample
from qrag.data.tokens import TokenizedSample, TokenLayout
from qrag.rl.env import RetrievalEnv


def sample(answer: str, chunks: list[str], **meta) -> Sample:
    return Sample(id="q", question="?", chunks=chunks, support=[0], answer=answer, meta=meta)


def test_answer_chunks_are_whole_word_case_insensitive_matches_of_the_answer_or_an_alias():
    chunks = ["Paris is large.", "He left parisian cafes.", "The PARIS accord.", "Lutetia was old.", "none"]
    assert answer_chunks(sample("Paris", chunks)) == [0, 2]  # not "parisian"
    assert answer_chunks(sample("Paris", chunks, answer_aliases=["Lutetia"])) == [0, 2, 3]
    assert answer_chunks(sample("yes", ["yes it is", "no"])) == []  # yes/no cannot be located


def tokenized(s: Sample) -> TokenizedSample:
    return TokenizedSample(s.id, np.array([1, 2]), [np.array([1, i + 10]) for i in range(len(s.chunks))], np.array([0]))


def test_questions_without_an_answer_bearing_chunk_are_left_out_and_counted():
    kept = sample("garden", ["Mary went to the garden.", "John left.", "The garden is green."])
    lost = sample("yes", ["Is it?", "It is."])
    samples, toks, left_out = answer_supervised([kept, lost], [tokenized(kept), tokenized(lost)])
    assert left_out == 1 and len(samples) == len(toks) == 1
    assert samples[0].support == [0, 2] and toks[0].support.tolist() == [0, 2]
    with pytest.raises(DataError, match="data.supervision=answer"):
        answer_supervised([lost], [tokenized(lost)])
    assert training_part("support", [lost], [tokenized(lost)])[2] == 0  # labels kept as they are


def test_any_credit_makes_one_fact_found_by_any_of_its_chunks():
    classes, n = support_classes(["a", "b", "c", "d"], [1, 3], "any")
    assert n == 1 and classes.tolist() == [-1, 0, -1, 0]
    layout = TokenLayout(cls_id=1, sep_id=2, pad_id=0, max_state_tokens=64)
    tok = TokenizedSample("q", np.array([1, 2]), [np.array([1, 5 + i, 2]) for i in range(4)], np.array([1, 3]))
    env = RetrievalEnv([tok, tok], EnvConfig(max_steps=3, credit="any"), layout)
    rewards, dones = env.step(np.array([0, 1]), np.array([3, 0]))
    assert rewards.tolist() == [1.0, 0.0] and dones.tolist() == [True, False]


@pytest.mark.parametrize("objective", ["pqn", "sft", "sft_trajectory"])
def test_a_run_trains_on_answer_chunks_and_evaluates_on_support_facts(tiny_cfg, objective):
    from qrag.rl.train import TrainingRun

    tiny_cfg.data.supervision = "answer"
    tiny_cfg.learner.objective = objective
    tiny_cfg.data.val_fraction = 0.3
    tiny_cfg.updates = 1
    run = TrainingRun(tiny_cfg)
    assert run.learner.env_cfg.credit == "any" and tiny_cfg.env.credit == "chunk"
    for s, tok in zip(run.train_samples, run.train_tok):
        assert s.support == answer_chunks(s) and tok.support.tolist() == s.support
    labelled_cfg = copy.deepcopy(tiny_cfg)
    labelled_cfg.data.supervision = "support"
    labelled = TrainingRun(labelled_cfg)
    assert [s.support for s in run.val_samples] == [s.support for s in labelled.val_samples]
    assert [s.support for s in run.dev_samples] == [s.support for s in labelled.dev_samples]
    assert len(run.train_samples) + run.left_out == len(labelled.train_samples)
    run.run(report=lambda step, metrics: None)


def test_episode_feeders_serve_the_answer_chunks_too(tiny_cfg):
    """The Ray path's EpisodeFeeder actors build their episodes as the in-process run does."""
    from qrag.distributed.feeder import EpisodeFeeder
    from qrag.model.encoder import load_tokenizer
    from qrag.rl.train import TrainingRun

    tiny_cfg.data.supervision = "answer"
    layout = TokenLayout.from_tokenizer(load_tokenizer(tiny_cfg.model.encoder), tiny_cfg.model.max_state_tokens)
    served = {
        e.id: e.support.tolist() for e in EpisodeFeeder(tiny_cfg, 0, 1, tiny_cfg.model.encoder, layout, 4).episodes
    }
    local = TrainingRun(tiny_cfg)
    assert served == {s.id: s.support for s in local.train_samples}
