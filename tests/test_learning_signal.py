"""Does soft PQN learn from a rare terminal reward? A CPU toy task (issue: QA3 did not learn).

Each question names three key words; every key is in one support chunk and in two decoys that
share its words but not the support's wording, beside filler chunks. The reward is 1 only when
all three support chunks are picked within T = 4 steps; the untrained encoder (token embeddings
mean-pooled: a word-overlap prior, as a pretrained encoder has) succeeds in ~10% of episodes and
greedy search finds ~10% of the facts. The learner runs with the long-context presets' RL
settings (configs/babilong-qa3.yaml: α, the value's top-k, λ, γ, τ); Fact F1 on held-out
questions must rise clearly above the untrained policy within a fixed number of updates.

The cause of the QA3 collapse (bench/results/longctx_select_qa3_h100.json): with α = 0.05 and
V over the top 32, the soft value carries an entropy bonus of up to α·ln 32 = 0.17 while the
returns of rare successes are ~0.01, and the Boltzmann policy at that temperature samples
near-uniformly among facts whose pretrained scores differ by a few hundredths: success drops to
zero, Q flattens towards the bonus and the encoders lose their prior. The presets now keep the
bonus below the scale of a rare return (second test).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from qrag.config import EnvConfig, ModelConfig, SearchConfig, load_config
from qrag.data.sample import Sample

ROOT = Path(__file__).resolve().parents[1]
KEYS = "apple banana cherry grape lemon mango melon olive peach pear plum berry".split()
FILLER = "river castle forest tower bridge garden island valley harbor desert canyon meadow".split()


def toy_samples(n: int, seed: int, facts: int = 3, decoys: int = 2, filler: int = 3) -> list[Sample]:
    """The question names three key words. Each key is in one support chunk ("the KEY is in the
    box") and in ``decoys`` distractors ("the KEY was not here"); ``filler`` chunks name no key.
    Word overlap finds the key chunks but cannot tell support from decoy, so an untrained encoder
    succeeds (all three within T = 4 of 12 chunks) in ~5% of episodes; the learnable cue is the
    wording of the support chunks."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        keys = rng.sample(KEYS, facts)
        texts = [f"the {k} is in the box" for k in keys]
        texts += [f"the {k} was not here" for k in keys for _ in range(decoys)]
        texts += [f"the {w} is far away" for w in rng.sample(FILLER, filler)]
        order = list(range(len(texts)))
        rng.shuffle(order)
        support = sorted(order.index(j) for j in range(facts))
        out.append(Sample(f"toy-{seed}-{i}", f"where are the {', '.join(keys)}?", [texts[j] for j in order], support))
    return out


def _fact_f1(qnet, layout, samples, tokenized) -> float:
    from qrag.evaluation.evaluate import evaluate
    from qrag.retrieval.search import Retriever

    retriever = Retriever(qnet, layout, torch.device("cpu"))
    return evaluate(retriever, samples, tokenized, SearchConfig(max_steps=3)).summary["fact_f1"]


def test_preset_soft_value_bonus_is_below_a_rare_return():
    """V over flat Q exceeds max Q by α·ln k: that bonus must stay small against the ~1% returns
    of a task whose successes are rare, or it, not the reward, is what Q learns."""
    from qrag.rl.learner import soft_value

    for name in ("babilong-qa1", "babilong-qa2", "babilong-qa3", "babilong-qa4", "babilong-qa5", "niah"):
        cfg = load_config(ROOT / "configs" / f"{name}.yaml").learner
        k = cfg.value_top_k or cfg.top_k
        flat = torch.zeros(1, 64)
        bonus = float(soft_value(flat, torch.ones(1, 64, dtype=torch.bool), cfg.alpha, k, cfg.soft_q))
        assert bonus == pytest.approx(cfg.alpha * np.log(min(k, 64)), rel=1e-4)
        assert bonus < 0.01, f"{name}: entropy bonus {bonus:.3f} of V swamps rare returns"


@pytest.mark.slow
def test_rare_terminal_reward_is_learned(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one reduction order: the same trajectory on every machine
    try:
        _train_toy(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _train_toy(tmp_path) -> None:
    from conftest import build_tiny_encoder
    from qrag.model.checkpoint import untrained_qnet
    from qrag.rl.learner import SoftPQNLearner
    from qrag.data.tokens import tokenize_samples

    torch.manual_seed(0)
    # No transformer layer: mean-pooled token embeddings, i.e. a word-overlap prior to start from.
    encoder = build_tiny_encoder(tmp_path / "enc", hidden=64, layers=0, seed=1)
    preset = load_config(ROOT / "configs" / "babilong-qa3.yaml").learner
    updates = 120
    learner_cfg = type(preset)(
        **{
            **preset.__dict__,
            "lr": 3e-3,
            "warmup_updates": 5,
            "episodes_per_update": 32,
            "micro_batch": 32,
            "weight_decay": 0.0,
        }
    )
    qnet, tokenizer, layout = untrained_qnet(ModelConfig(encoder=str(encoder), positions="none"), torch.device("cpu"))
    train = toy_samples(256, seed=1)
    test = toy_samples(64, seed=2)
    tok_train = tokenize_samples(train, tokenizer, layout, chunk_tokens=16, question_tokens=24)
    tok_test = tokenize_samples(test, tokenizer, layout, chunk_tokens=16, question_tokens=24)
    before = _fact_f1(qnet, layout, test, tok_test)
    learner = SoftPQNLearner(
        qnet, layout, EnvConfig(max_steps=4), learner_cfg, total_updates=updates, device=torch.device("cpu"), seed=0
    )
    rng = np.random.default_rng(0)
    history = []
    for _ in range(updates):
        history.append(learner.train_update([tok_train[i] for i in rng.choice(len(tok_train), 32, replace=False)]))
    after = _fact_f1(qnet, layout, test, tok_test)
    assert history[0].success < 0.3  # rare at first
    assert before < 0.4, before
    assert after > max(0.8, before + 0.4), (before, after, history[-1].as_dict())
    assert np.mean([m.success for m in history[-10:]]) > 0.8


@pytest.mark.parametrize(
    "objective,gain",
    [
        ("sft", 0.4),  # ours: teacher forcing on the support facts
        ("sft_trajectory", 0.3),  # the paper's description of its SFT row: Beam Retriever's trajectory supervision
    ],
)
def test_supervised_baselines_learn_the_toy(tmp_path, objective, gain):
    """learner.objective=sft and sft_trajectory (Table 3's "Multi-step RAG w. SFT", ours and the
    paper's) train the same encoders; each must find the support of held-out toy questions."""
    from conftest import build_tiny_encoder
    from qrag.model.checkpoint import untrained_qnet
    from qrag.config import LearnerConfig
    from qrag.rl.train import learner_class
    from qrag.data.tokens import tokenize_samples

    torch.manual_seed(0)
    encoder = build_tiny_encoder(tmp_path / "enc", hidden=64, layers=0, seed=1)
    qnet, tokenizer, layout = untrained_qnet(
        ModelConfig(encoder=str(encoder), positions="relative"), torch.device("cpu")
    )
    train, test = toy_samples(128, seed=3), toy_samples(32, seed=4)
    tok_train = tokenize_samples(train, tokenizer, layout, chunk_tokens=16, question_tokens=24)
    tok_test = tokenize_samples(test, tokenizer, layout, chunk_tokens=16, question_tokens=24)
    before = _fact_f1(qnet, layout, test, tok_test)
    cfg = LearnerConfig(
        objective=objective, lr=3e-3, warmup_updates=2, episodes_per_update=32, micro_batch=16, weight_decay=0.0
    )
    learner = learner_class(cfg)(
        qnet, layout, EnvConfig(max_steps=4), cfg, total_updates=25, device=torch.device("cpu")
    )
    assert (
        type(learner).__name__
        == {"sft": "SupervisedLearner", "sft_trajectory": "TrajectorySupervisedLearner"}[objective]
    )
    rng = np.random.default_rng(0)
    losses = [
        learner.train_update([tok_train[i] for i in rng.choice(len(tok_train), 32, replace=False)]).loss
        for _ in range(25)
    ]
    after = _fact_f1(qnet, layout, test, tok_test)
    assert losses[-1] < losses[0]
    assert after > before + gain, (before, after)


def _sft_learner(encoder: str, **overrides):
    """A supervised (or warm-started) learner on the tiny encoder, as ``qrag train`` would build it."""
    from qrag.config import LearnerConfig
    from qrag.model.checkpoint import untrained_qnet
    from qrag.rl.train import learner_class

    cfg = LearnerConfig(**{"objective": "sft", **overrides})
    qnet, _, layout = untrained_qnet(ModelConfig(encoder=encoder, positions="relative"), torch.device("cpu"))
    return learner_class(cfg)(qnet, layout, EnvConfig(max_steps=4), cfg, total_updates=1, device=torch.device("cpu"))


# One step's input: chunks 1 and 2 are facts still to take, chunk 1 the next in the given order.
AVAILABLE = torch.tensor([[True, True, True, True]])
MISSING = torch.tensor([[False, True, True, False]])
FOLLOWING = torch.tensor([[False, True, False, False]])


def test_the_two_sft_objectives_differ_where_the_code_says(tiny_encoder):
    """Ours: any still-missing fact is right, random order, softmax. The paper's: only the next fact
    in document order is right, every other chunk (facts to come included) a BCE negative."""
    from qrag.rl.sft import OURS, PAPERS

    ours, papers = _sft_learner(tiny_encoder), _sft_learner(tiny_encoder, objective="sft_trajectory")
    assert (type(ours).__name__, ours.choices) == ("SupervisedLearner", OURS)
    assert (type(papers).__name__, papers.choices) == ("TrajectorySupervisedLearner", PAPERS)
    facts = np.array([2, 5, 9, 11, 14, 17, 20, 23])
    assert papers.fact_order(facts).tolist() == facts.tolist()
    shuffled = ours.fact_order(facts)
    assert sorted(shuffled.tolist()) == facts.tolist() and shuffled.tolist() != facts.tolist()
    assert ours.positives(MISSING, FOLLOWING).tolist() == MISSING.tolist()
    assert papers.positives(MISSING, FOLLOWING).tolist() == FOLLOWING.tolist()

    # The later fact scored as high as the next one: no cost to ours, a cost to the paper's.
    both_high, later_low = torch.tensor([[-5.0, 5.0, 5.0, -5.0]]), torch.tensor([[-5.0, 5.0, -5.0, -5.0]])
    our_losses = [ours.step_loss(x, AVAILABLE, MISSING).item() for x in (both_high, later_low)]
    paper_losses = [papers.step_loss(x, AVAILABLE, FOLLOWING).item() for x in (both_high, later_low)]
    assert our_losses[0] < our_losses[1]  # ours prefers both facts high
    assert paper_losses[0] > paper_losses[1] + 1.0  # the paper's pushes the later fact down
    # A BCE per chunk, averaged over the available ones only.
    bce = torch.nn.functional.binary_cross_entropy_with_logits(later_low[0, :3], torch.tensor([0.0, 1.0, 0.0]))
    partly = torch.tensor([[True, True, True, False]])
    assert papers.step_loss(later_low, partly, FOLLOWING).item() == pytest.approx(bce.item())


def _aspects(learner) -> tuple[list[int], list[list[bool]], float]:
    """What each learner.sft_* switch decides, on fixed inputs: the order of eight facts, the
    positives of one step, the loss of fixed logits with two positives (the generator is fresh)."""
    logits = torch.tensor([[0.3, 2.0, -1.0, 0.5, 1.5]])
    available = torch.tensor([[True, True, True, True, False]])
    positive = torch.tensor([[False, True, True, False, False]])
    return (
        learner.fact_order(np.arange(8) * 3).tolist(),
        learner.positives(MISSING, FOLLOWING).tolist(),
        learner.step_loss(logits, available, positive).item(),
    )


@pytest.mark.parametrize("objective", ["sft", "sft_trajectory"])
@pytest.mark.parametrize("aspect,switch", [(0, "sft_order"), (1, "sft_positives"), (2, "sft_loss")])
def test_each_sft_switch_changes_only_its_part(tiny_encoder, objective, aspect, switch):
    """learner.sft_order, sft_positives and sft_loss: one flipped away from the objective's own choice
    changes what it names (the order, the positives, the loss) and nothing else; set to the
    objective's own choice it changes nothing."""
    from qrag.rl.sft import OURS, PAPERS

    own = {"sft": OURS, "sft_trajectory": PAPERS}[objective]
    field = {"sft_order": "order", "sft_positives": "positives", "sft_loss": "loss"}[switch]
    other = {"sft": PAPERS, "sft_trajectory": OURS}[objective]
    base = _aspects(_sft_learner(tiny_encoder, objective=objective))
    flipped_learner = _sft_learner(tiny_encoder, objective=objective, **{switch: getattr(other, field)})
    assert flipped_learner.choices == dataclasses.replace(own, **{field: getattr(other, field)})
    flipped = _aspects(flipped_learner)
    for i in range(3):
        assert (flipped[i] != base[i]) == (i == aspect), (switch, i, base[i], flipped[i])
    same = _aspects(_sft_learner(tiny_encoder, objective=objective, **{switch: getattr(own, field)}))
    assert same == base


class _OldOurs:
    """The two learners before the switches existed, as they were written (the comparison below)."""

    def fact_order(self, facts):
        return facts[torch.randperm(len(facts), generator=self.generator).numpy()]

    @staticmethod
    def positives(missing, following):
        return missing

    @staticmethod
    def step_loss(logits, available, positive):
        logits = logits.masked_fill(~available, float("-inf"))
        return torch.logsumexp(logits, 1) - torch.logsumexp(logits.masked_fill(~positive, float("-inf")), 1)


class _OldTrajectory(_OldOurs):
    def fact_order(self, facts):
        return facts

    @staticmethod
    def positives(missing, following):
        return following

    @staticmethod
    def step_loss(logits, available, positive):
        bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, positive.float(), reduction="none")
        return (bce * available).sum(1) / available.sum(1).clamp(min=1)


@pytest.mark.parametrize(
    "overrides,old",
    [
        ({"objective": "sft"}, _OldOurs),
        ({"objective": "sft_trajectory"}, _OldTrajectory),
        # The paper's choices set one by one on ours are the paper's objective, and the reverse.
        ({"objective": "sft", "sft_order": "given", "sft_positives": "next", "sft_loss": "bce"}, _OldTrajectory),
        (
            {"objective": "sft_trajectory", "sft_order": "random", "sft_positives": "missing", "sft_loss": "softmax"},
            _OldOurs,
        ),
    ],
)
def test_sft_objectives_without_switches_are_the_old_learners(tiny_encoder, overrides, old):
    """A whole supervised micro-batch (loss and gradients) equals the old learner's on the same
    episodes and weights: the switches left null change nothing."""
    from qrag.data.tokens import tokenize_samples
    from qrag.model.encoder import load_tokenizer
    from qrag.rl.sft import SupervisedLearner

    new = _sft_learner(tiny_encoder, **overrides)
    reference = type("Old", (old, SupervisedLearner), {})(
        new.qnet, new.layout, new.env_cfg, new.cfg, total_updates=1, device=torch.device("cpu")
    )
    tok = tokenize_samples(
        toy_samples(6, seed=5), load_tokenizer(tiny_encoder), new.layout, chunk_tokens=16, question_tokens=24
    )
    new.qnet.eval()  # no dropout: the two passes see the same network
    results = []
    for learner in (new, reference):
        learner.qnet.zero_grad(set_to_none=True)
        out = learner._rollout_and_backward(tok, alpha=0.0)
        grads = [p.grad.clone() for p in learner.qnet.online_parameters() if p.grad is not None]
        results.append((float(out["loss_sum"]), out["transitions"], grads))
    (loss_new, n_new, g_new), (loss_old, n_old, g_old) = results
    assert (loss_new, n_new) == (pytest.approx(loss_old, rel=1e-6), n_old)
    assert len(g_new) == len(g_old) > 0
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(g_new, g_old))


@pytest.mark.parametrize("switch,value", [("sft_order", "given"), ("sft_positives", "next"), ("sft_loss", "bce")])
def test_sft_switches_are_checked(switch, value):
    """A bad value fails at load and in learner_class (a config built in code), naming the key; a
    switch under objective=pqn with no supervised warm start would do nothing, so it is refused."""
    from qrag.config import ConfigError, LearnerConfig
    from qrag.rl.sft import OURS, SWITCHES, WarmStartedPQNLearner, sft_choices
    from qrag.rl.train import TrainingRun, learner_class

    with pytest.raises(ConfigError, match=rf"learner\.{switch}: unknown value 'typo'"):
        load_config(None, ["learner.objective=sft", f"learner.{switch}=typo"])
    with pytest.raises(ConfigError, match=rf"learner\.{switch}: expected .* got 'typo'"):
        learner_class(LearnerConfig(objective="sft_trajectory", **{switch: "typo"}))
    with pytest.raises(ConfigError, match=rf"learner\.{switch}: only read by supervised updates"):
        learner_class(LearnerConfig(**{switch: value}))
    with pytest.raises(ConfigError, match=rf"learner\.{switch}"):
        TrainingRun(load_config(None, [f"learner.{switch}={value}"]), load_data=False)  # before any model loads
    # The warm start's supervised updates read it.
    warm = LearnerConfig(sft_warmup_updates=5, **{switch: value})
    assert learner_class(warm) is WarmStartedPQNLearner
    field = {name: attr for attr, name in SWITCHES.items()}[switch]
    assert sft_choices(warm, WarmStartedPQNLearner.own) == dataclasses.replace(OURS, **{field: value})
    assert load_config(None, [f"learner.{switch}=null"]).learner.__dict__[switch] is None


def test_supervised_warm_start_then_pqn(tmp_path):
    """learner.sft_warmup_updates: the first updates are supervised (no rollouts: success 0, the
    SFT loss), PQN follows from the encoders they left with the targets reset to them, and the
    chained run finds the toy's support."""
    from conftest import build_tiny_encoder
    from qrag.model.checkpoint import untrained_qnet
    from qrag.config import LearnerConfig
    from qrag.rl.sft import WarmStartedPQNLearner
    from qrag.data.tokens import tokenize_samples

    torch.manual_seed(0)
    encoder = build_tiny_encoder(tmp_path / "enc", hidden=64, layers=0, seed=1)
    qnet, tokenizer, layout = untrained_qnet(
        ModelConfig(encoder=str(encoder), positions="relative"), torch.device("cpu"), True
    )
    train, test = toy_samples(128, seed=3), toy_samples(32, seed=4)
    tok_train = tokenize_samples(train, tokenizer, layout, chunk_tokens=16, question_tokens=24)
    tok_test = tokenize_samples(test, tokenizer, layout, chunk_tokens=16, question_tokens=24)
    before = _fact_f1(qnet, layout, test, tok_test)
    cfg = LearnerConfig(
        lr=3e-3,
        warmup_updates=2,
        episodes_per_update=32,
        micro_batch=32,
        weight_decay=0.0,
        alpha=0.005,
        value_top_k=5,
        sft_warmup_updates=20,
    )
    learner = WarmStartedPQNLearner(
        qnet, layout, EnvConfig(max_steps=4), cfg, total_updates=30, device=torch.device("cpu")
    )
    rng = np.random.default_rng(0)
    batch = lambda: [tok_train[i] for i in rng.choice(len(tok_train), 32, replace=False)]  # noqa: E731
    history = [learner.train_update(batch()) for _ in range(20)]
    assert all(m.success == 0.0 and m.target == 1.0 for m in history)  # supervised: no rollouts yet
    before_switch = [p.detach().clone() for p in qnet.state_encoder.parameters()]
    m = learner.train_update(batch())  # the first PQN update: rollouts, targets reset first
    assert m.success > 0.3 and m.target != 1.0
    # Reset to the encoders before this update, then one EMA step towards the updated ones.
    for b, o, t in zip(before_switch, qnet.state_encoder.parameters(), qnet.target_state_encoder.parameters()):
        if o.requires_grad:
            assert torch.allclose(t, torch.lerp(b, o.detach(), cfg.tau), atol=1e-6)
    history += [learner.train_update(batch()) for _ in range(9)]
    after = _fact_f1(qnet, layout, test, tok_test)
    assert after > before + 0.4, (before, after)


def test_warm_start_needs_the_pqn_objective(tmp_path):
    from qrag.config import ConfigError, LearnerConfig
    from qrag.rl.learner import SoftPQNLearner
    from qrag.rl.sft import WarmStartedPQNLearner
    from qrag.rl.train import TrainingRun, learner_class

    assert learner_class(LearnerConfig()) is SoftPQNLearner
    assert learner_class(LearnerConfig(sft_warmup_updates=5)) is WarmStartedPQNLearner
    cfg = load_config(None, ["learner.objective=sft", "learner.sft_warmup_updates=5"])
    with pytest.raises(ConfigError, match="sft_warmup_updates"):
        TrainingRun(cfg, load_data=False)  # before any model is loaded


def test_sft_stop_teaches_the_state_after_the_last_fact(tiny_encoder):
    """learner.sft_stop: the stop option (logit 0) is right exactly where no chunk is; each episode gets one
    more supervised step, the state after its last fact; the switch is refused where nothing would read it."""
    from qrag.config import ConfigError, LearnerConfig
    from qrag.data.tokens import tokenize_samples
    from qrag.model.encoder import load_tokenizer
    from qrag.rl.train import learner_class

    plain, stopping = _sft_learner(tiny_encoder), _sft_learner(tiny_encoder, sft_stop=True)
    logits = torch.tensor([[1.0, 3.0, -2.0, 0.5]])
    after_last = torch.zeros_like(AVAILABLE)
    # Where a fact is missing: the stop option is one more negative in the softmax.
    with_stop = torch.logsumexp(torch.cat([logits, torch.zeros(1, 1)], 1), 1) - torch.logsumexp(logits[:, 1:3], 1)
    assert stopping.step_loss(logits, AVAILABLE, MISSING).item() == pytest.approx(with_stop.item())
    # After the last fact: the stop option is the one right answer, so every Q is pushed below 0.
    lowered = logits - 5.0
    assert stopping.step_loss(lowered, AVAILABLE, after_last) < stopping.step_loss(logits, AVAILABLE, after_last)
    assert stopping.step_loss(logits, AVAILABLE, after_last).item() == pytest.approx(
        torch.logsumexp(torch.cat([logits, torch.zeros(1, 1)], 1), 1).item()
    )
    assert plain.step_loss(logits, AVAILABLE, MISSING).item() != pytest.approx(with_stop.item())

    tok = tokenize_samples(
        toy_samples(4, seed=5), load_tokenizer(tiny_encoder), plain.layout, chunk_tokens=16, question_tokens=24
    )
    facts = sum(len(s.support) for s in tok)
    assert plain._rollout_and_backward(tok, alpha=0.0)["transitions"] == facts
    assert stopping._rollout_and_backward(tok, alpha=0.0)["transitions"] == facts + len(tok)
    with pytest.raises(ConfigError, match=r"learner\.sft_stop: only read by supervised updates"):
        learner_class(LearnerConfig(sft_stop=True))


def test_sft_stop_weight_scales_only_the_state_after_the_last_fact(tiny_encoder, monkeypatch):
    """learner.sft_stop_weight multiplies the loss of the rows past their last fact and nothing else (0: that
    state untaught, 1: as every other step); it needs learner.sft_stop."""
    from qrag.config import ConfigError, LearnerConfig
    from qrag.data.tokens import tokenize_samples
    from qrag.model.encoder import load_tokenizer
    from qrag.rl.train import learner_class

    def loss_sum(weight: float, unit_rows: bool) -> float:
        torch.manual_seed(0)
        learner = _sft_learner(tiny_encoder, sft_stop=True, sft_stop_weight=weight)
        if unit_rows:  # every row's loss 1 (still on the graph): the sum counts the rows, each by its weight
            monkeypatch.setattr(learner, "step_loss", lambda logits, available, positive: logits.sum(1) * 0 + 1)
        learner.qnet.eval()  # no dropout: the same loss for the same weights
        tok = tokenize_samples(
            toy_samples(4, seed=5), load_tokenizer(tiny_encoder), learner.layout, chunk_tokens=16, question_tokens=24
        )
        tok[1].support = tok[1].support[:1]  # one episode ends early: its stop row shares a step with going-on rows
        learner.generator.manual_seed(3)
        return float(learner._rollout_and_backward(tok, alpha=0.0)["loss_sum"]), tok

    for weight in (0.0, 0.5, 2.0):
        total, tok = loss_sum(weight, unit_rows=True)
        facts = sum(len({int(i) for i in s.support}) for s in tok)
        assert total == pytest.approx(facts + weight * len(tok)), weight
    untaught, full, half = (loss_sum(w, unit_rows=False)[0] for w in (0.0, 1.0, 0.5))
    assert 0 < untaught < full  # the stop rows carry a loss of their own
    assert half == pytest.approx((untaught + full) / 2, rel=1e-5)
    with pytest.raises(ConfigError, match=r"learner\.sft_stop_weight: only read with learner\.sft_stop=true"):
        learner_class(LearnerConfig(objective="sft", sft_stop_weight=0.5))
    with pytest.raises(ConfigError, match=r"learner\.sft_stop_weight: expected a finite weight >= 0"):
        learner_class(LearnerConfig(objective="sft", sft_stop=True, sft_stop_weight=-1.0))


def test_sft_stop_makes_the_learned_stop_work(tmp_path):
    """Trained with the stop option, Q stays above its level 0 while a fact is missing and falls below it
    once the last one is taken, so a threshold chosen on validation questions stops where the facts end
    (toy questions of two or three facts, T = 4)."""
    from conftest import build_tiny_encoder
    from qrag.config import LearnerConfig
    from qrag.data.tokens import tokenize_samples
    from qrag.evaluation.early_stopping import stop_chosen_on
    from qrag.evaluation.evaluate import evaluate
    from qrag.model.checkpoint import untrained_qnet
    from qrag.retrieval.search import Retriever
    from qrag.rl.train import learner_class

    def mixed(n: int, seed: int):
        return toy_samples(n // 2, seed, facts=2) + toy_samples(n - n // 2, seed + 100, facts=3)

    torch.manual_seed(0)
    encoder = build_tiny_encoder(tmp_path / "enc", hidden=64, layers=0, seed=1)
    qnet, tokenizer, layout = untrained_qnet(
        ModelConfig(encoder=str(encoder), positions="relative"), torch.device("cpu")
    )
    parts = {"train": mixed(128, 3), "val": mixed(32, 6), "test": mixed(32, 4)}
    tok = {k: tokenize_samples(v, tokenizer, layout, chunk_tokens=16, question_tokens=24) for k, v in parts.items()}
    cfg = LearnerConfig(
        objective="sft",
        sft_stop=True,
        lr=3e-3,
        warmup_updates=2,
        episodes_per_update=32,
        micro_batch=16,
        weight_decay=0.0,
    )
    learner = learner_class(cfg)(
        qnet, layout, EnvConfig(max_steps=4), cfg, total_updates=30, device=torch.device("cpu")
    )
    rng = np.random.default_rng(0)
    for _ in range(30):
        learner.train_update([tok["train"][i] for i in rng.choice(len(tok["train"]), 32, replace=False)])
    retriever, search = Retriever(qnet, layout, torch.device("cpu")), SearchConfig(max_steps=4)
    on_val = evaluate(retriever, parts["val"], tok["val"], search).records
    result = evaluate(retriever, parts["test"], tok["test"], search)
    # Questions whose first picks are exactly their facts: Q above 0 for those picks, below 0 for the next.
    clean = [r for r in result.records if set(r["retrieved"][: len(r["gold"])]) == set(r["gold"])]
    assert len(clean) >= 0.8 * len(result.records)
    levels = [min(r["q_values"][: len(r["gold"])]) > 0 > r["q_values"][len(r["gold"])] for r in clean]
    assert np.mean(levels) >= 0.9, [r["q_values"] for r in clean]
    stop = stop_chosen_on(on_val, result.records, "threshold")
    assert stop["fact_f1"] > result.summary["oracle_fact_f1"] - 0.05, (stop, result.summary["oracle_fact_f1"])


@pytest.mark.parametrize("sft_stop,packed", [(False, True), (True, True), (False, False)])
def test_supervised_states_share_one_pass_and_keep_their_steps(tiny_encoder, monkeypatch, sft_stop, packed):
    """Teacher forcing knows every step's state in advance, so all of them go through the state
    encoder at once (one packed pass; padded, a pass per step); each step's Q still starts from its
    own states: the question with the facts taken before that step, for the episodes still at it."""
    import qrag.rl.sft as sft_mod
    from qrag.data.tokens import tokenize_samples
    from qrag.model.encoder import load_tokenizer

    learner = _sft_learner(tiny_encoder, sft_stop=sft_stop, packed=packed)
    tok = tokenize_samples(
        toy_samples(5, seed=7, facts=3),
        load_tokenizer(tiny_encoder),
        learner.layout,
        chunk_tokens=16,
        question_tokens=24,
    )
    tok[1].support = tok[1].support[:1]  # episodes of different lengths: the later steps hold fewer rows
    learner.qnet.eval()  # no dropout: the states' vectors depend on their tokens only
    passes, seen = [], []
    real_embed, real_scores = learner._embed, sft_mod.QNetwork.twin_scores
    monkeypatch.setattr(
        learner, "_embed", lambda m, s, grad=False, kind="": passes.append(kind) or real_embed(m, s, grad, kind)
    )
    monkeypatch.setattr(sft_mod.QNetwork, "twin_scores", lambda s, c: seen.append(s.detach()) or real_scores(s, c))
    learner.generator.manual_seed(11)
    learner._rollout_and_backward(tok, alpha=0.0)

    learner.generator.manual_seed(11)
    orders = [learner.fact_order(np.asarray(sorted({int(i) for i in s.support}), dtype=np.int64)) for s in tok]
    steps = max(len(o) for o in orders) + int(sft_stop)
    assert len(seen) == steps
    assert passes.count("states") == (1 if packed else steps)
    for t, states in enumerate(seen):
        rows = [i for i, o in enumerate(orders) if len(o) + int(sft_stop) > t]
        seqs = [learner.layout.state(tok[i].question, [tok[i].chunks[j] for j in sorted(orders[i][:t])]) for i in rows]
        with torch.no_grad():
            expected = learner._embed(learner.qnet.state_encoder, seqs, kind="check")
        assert states.shape == expected.shape and torch.allclose(states, expected, atol=1e-5), t
