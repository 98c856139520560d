"""The training loop's own rules (qrag.rl.train), each named with the planted bug it catches (seen
failing with it): periodic evaluation and keep_best look at the validation split whenever there
is one, never dev; every epoch is a fresh shuffle; the reported checkpoint is the one evaluated."""

from __future__ import annotations

import pytest
import torch

from qrag.model.checkpoint import load_qnet
from qrag.rl.train import EpochSampler, TrainingRun


def test_every_epoch_is_a_new_permutation_and_resumes_exactly():
    """Planted bug caught: the sampler repeating the first epoch's order forever."""
    sampler = EpochSampler(12, seed=3)
    epochs = [sampler.take(12) for _ in range(4)]
    assert all(sorted(e) == list(range(12)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 4
    state = sampler.state()
    ahead = sampler.take(30)
    again = EpochSampler(12, seed=99)
    again.load_state(state)
    assert again.take(30) == ahead


@pytest.fixture()
def run_cfg(tiny_cfg):
    tiny_cfg.data.val_fraction = 0.3
    tiny_cfg.eval_every, tiny_cfg.keep_best, tiny_cfg.updates = 1, True, 3
    return tiny_cfg


def test_periodic_evaluation_and_keep_best_use_the_validation_split(run_cfg, monkeypatch):
    """Planted bug caught: periodic evaluation (and keep_best's choice) on dev while a validation
    split exists; only the final evaluation may look at dev."""
    run = TrainingRun(run_cfg)
    assert run.val_tok and run.periodic_split == "val"
    splits: list[str] = []
    real = TrainingRun.evaluate

    def spy(self, limit=None, search=None, split="dev", credit=None):
        splits.append(split)
        return real(self, limit, search, split, credit)

    monkeypatch.setattr(TrainingRun, "evaluate", spy)
    run.run(report=lambda step, metrics: None)
    assert splits == ["val", "val", "val", "dev"]


def test_the_reported_checkpoint_is_the_one_whose_weights_are_evaluated(run_cfg, monkeypatch):
    """Planted bug caught: keep_best reporting ``best`` while the final evaluation keeps (some of)
    the final weights. The first periodic evaluation is made the best, so best != final."""
    run = TrainingRun(run_cfg)
    scores = iter([0.9, 0.1, 0.2])
    real = TrainingRun.evaluate

    def fake(self, limit=None, search=None, split="dev", credit=None):
        result = real(self, limit, search, split, credit)
        if split == "val":
            result.summary["fact_f1"] = next(scores)
        return result

    monkeypatch.setattr(TrainingRun, "evaluate", fake)
    out = run.run(report=lambda step, metrics: None)
    assert out["checkpoint"].endswith("best")
    best, *_ = load_qnet(out["checkpoint"], torch.device("cpu"), with_targets=False)
    final, *_ = load_qnet(out["final_checkpoint"], torch.device("cpu"), with_targets=False)
    for name in ("state_encoder", "action_encoder"):
        live = getattr(run.qnet, name).state_dict()
        assert all(torch.equal(v, getattr(best, name).state_dict()[k]) for k, v in live.items()), name
        assert not all(torch.equal(v, getattr(final, name).state_dict()[k]) for k, v in live.items()), name


def test_keep_best_breaks_a_fact_f1_tie_by_fact_em_and_resumes_with_it(run_cfg, monkeypatch, tmp_path):
    """Updates 1 and 2 tie on val Fact F1; update 2 has the higher Fact EM and is kept; update 3 ties
    update 2 on both and leaves it. The key comes back with a resumable checkpoint. Planted bugs
    caught: selection on Fact F1 alone (update 1 kept), a tie on both taking the later checkpoint,
    the key not saved (a resumed run would choose again from nothing)."""
    run_cfg.checkpoint_every = 1
    run = TrainingRun(run_cfg)
    scores = iter([(0.5, 0.4), (0.5, 0.5), (0.5, 0.5)])
    real = TrainingRun.evaluate

    def fake(self, limit=None, search=None, split="dev", credit=None):
        result = real(self, limit, search, split, credit)
        if split == "val":
            result.summary["fact_f1"], result.summary["fact_em"] = next(scores)
        return result

    monkeypatch.setattr(TrainingRun, "evaluate", fake)
    chosen: list[int] = []
    run.run(report=lambda step, metrics: chosen.append(step) if "eval/best_fact_f1" in metrics else None)
    assert chosen == [1, 2] and run.best == (0.5, 0.5)
    resumed = TrainingRun(run_cfg, resume=run.checkpoint_dir(2))
    assert resumed.best == (0.5, 0.5)
