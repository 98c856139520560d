"""The training loop on one machine, without Ray.

``TrainingRun`` owns the model, the learner and the data; ``run()`` takes episodes from any
source (local sampling here, episode-feeder actors under Ray), updates, evaluates, checkpoints and
reports metrics to a callback. ``qrag train`` and the Ray Train worker both call it.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import replace
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from qrag.model.checkpoint import (
    is_checkpoint,
    load_qnet,
    load_training_state,
    numpy_state,
    save_checkpoint,
    set_numpy_state,
    untrained_qnet,
)
from qrag.config import ConfigError, EnvConfig, LearnerConfig, SearchConfig, TrainConfig
from qrag.data.answer_support import training_part
from qrag.data.credit import ANY
from qrag.data.prepared import prepare_split
from qrag.data.sample import Sample
from qrag.data.splits import validation_key
from qrag.model.encoder import load_tokenizer, pick_device, resolve_encoder
from qrag.evaluation.evaluate import EvalResult, evaluate
from qrag.rl.learner import SoftPQNLearner
from qrag.retrieval.search import Retriever
from qrag.rl.sft import (
    OURS,
    SUPERVISED_ONLY,
    SupervisedLearner,
    TrajectorySupervisedLearner,
    WarmStartedPQNLearner,
    sft_choices,
)
from qrag.data.tokens import TokenizedSample, TokenLayout, tokenize_samples

Reporter = Callable[[int, dict[str, float]], None]


class EpisodeSource(Protocol):
    def next_batch(self) -> list[TokenizedSample]: ...


UNSELECTED = (float("-inf"), float("-inf"))


def selection_key(summary: dict[str, Any]) -> tuple[float, float]:
    """What keep_best maximises: the periodic evaluation's Fact F1, ties broken by its Fact EM. A few
    hundred validation questions tie on F1 often enough (a missed fact costs every question the same
    half point), and a tie kept the earlier checkpoint even where the later one had more complete
    answers. Equal on both, the earlier checkpoint stays."""
    return (float(summary["fact_f1"]), float(summary["fact_em"]))


class EpochSampler:
    """Indices of an endless stream of shuffled epochs; its state goes into checkpoints."""

    def __init__(self, n: int, seed: int):
        if n <= 0:
            raise ValueError("no training samples")
        self.n = n
        self.rng = np.random.default_rng(seed)
        self.epoch = 0
        self.perm = self.rng.permutation(n)
        self.pos = 0

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos >= self.n:
                self.perm, self.pos, self.epoch = self.rng.permutation(self.n), 0, self.epoch + 1
            take = min(k - len(out), self.n - self.pos)
            out.extend(int(i) for i in self.perm[self.pos : self.pos + take])
            self.pos += take
        return out

    def state(self) -> dict[str, Any]:
        return {"rng": numpy_state(self.rng), "epoch": self.epoch, "perm": self.perm.tolist(), "pos": self.pos}

    def load_state(self, state: dict[str, Any]) -> None:
        set_numpy_state(self.rng, state["rng"])
        self.epoch, self.perm, self.pos = state["epoch"], np.asarray(state["perm"]), state["pos"]


class LocalEpisodeSource:
    def __init__(self, samples: Sequence[TokenizedSample], batch_size: int, sampler: EpochSampler):
        self.samples, self.batch_size, self.sampler = samples, batch_size, sampler

    def next_batch(self) -> list[TokenizedSample]:
        return [self.samples[i] for i in self.sampler.take(self.batch_size)]


def _init_cuda(device: torch.device) -> None:
    torch.empty(1, device=device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def print_reporter(step: int, metrics: dict[str, float]) -> None:
    print(
        json.dumps(
            {"update": step, **{k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in metrics.items()}}
        ),
        flush=True,
    )


SUPERVISED_LEARNERS: dict[str, type[SoftPQNLearner]] = {
    "sft": SupervisedLearner,
    "sft_trajectory": TrajectorySupervisedLearner,
}


def training_env(cfg: TrainConfig) -> EnvConfig:
    """The environment the learner steps: with ``data.supervision=answer`` a pick of any of a
    question's answer-bearing chunks is the success (evaluation keeps ``env.credit``)."""
    return replace(cfg.env, credit=ANY) if cfg.data.supervision == "answer" else cfg.env


def learner_class(cfg: LearnerConfig) -> type[SoftPQNLearner]:
    """The learner ``learner.objective`` (and a supervised warm start) asks for."""
    if cfg.objective != "pqn" and cfg.objective not in SUPERVISED_LEARNERS:
        raise ConfigError(f"learner.objective: expected pqn, sft or sft_trajectory, got {cfg.objective!r}")
    if cfg.sft_warmup_updates < 0 or (cfg.sft_warmup_updates and cfg.objective != "pqn"):
        raise ConfigError(
            "learner.sft_warmup_updates: a count >= 0 of supervised updates before soft PQN (objective=pqn only)"
        )
    sft_choices(cfg, OURS)  # a bad learner.sft_* value fails here, naming its key
    if not (math.isfinite(cfg.sft_stop_weight) and cfg.sft_stop_weight >= 0):
        raise ConfigError(f"learner.sft_stop_weight: expected a finite weight >= 0, got {cfg.sft_stop_weight!r}")
    if cfg.sft_stop_weight != 1.0 and not cfg.sft_stop:
        raise ConfigError("learner.sft_stop_weight: only read with learner.sft_stop=true")
    if cfg.objective == "pqn" and not cfg.sft_warmup_updates:
        for name in SUPERVISED_ONLY:
            if getattr(cfg, name) not in (None, False):  # no supervised update would read it
                raise ConfigError(
                    f"learner.{name}: only read by supervised updates (objective=sft or sft_trajectory, "
                    "or objective=pqn with sft_warmup_updates > 0)"
                )
    if cfg.objective in SUPERVISED_LEARNERS:
        return SUPERVISED_LEARNERS[cfg.objective]
    return WarmStartedPQNLearner if cfg.sft_warmup_updates else SoftPQNLearner


class TrainingRun:
    """Model + learner + data for one run; resumable from a checkpoint directory."""

    def __init__(
        self,
        cfg: TrainConfig,
        resume: str | Path | None = None,
        device: torch.device | None = None,
        load_data: bool = True,
    ):
        self.cfg = cfg
        learner_cls = learner_class(cfg.learner)  # a bad objective fails before minutes of loading
        self.device = device or pick_device(cfg.device)
        seed_everything(cfg.seed)
        self.train_samples: list[Sample] = []
        self.dev_samples: list[Sample] = []
        self.val_samples: list[Sample] = []
        self.train_tok: list[TokenizedSample] = []
        self.left_out = 0  # training questions data.supervision left out (no answer-bearing chunk)
        self.val_tok: list[TokenizedSample] = []
        self.dev_tok: list[TokenizedSample] = []
        self.best = UNSELECTED  # keep_best's selection key of the checkpoint in <run>/best
        # Data loading (JSON parsing, tokenisation: mostly GIL-free Rust) overlaps with loading
        # the encoders and initialising the GPU; it only needs the tokenizer.
        self.timings: dict[str, float] = {}
        t0 = time.perf_counter()
        self.tokenizer = load_tokenizer(
            str(Path(resume) / "tokenizer") if resume is not None else resolve_encoder(cfg.model.encoder)
        )
        self.layout = TokenLayout.from_tokenizer(self.tokenizer, cfg.model.max_state_tokens)
        with ThreadPoolExecutor(max_workers=2) as pool:
            if self.device.type == "cuda":
                pool.submit(_init_cuda, self.device)  # seconds of driver start-up, off the critical path
            loading = pool.submit(self.load_data) if load_data else None
            if resume is not None:
                self.qnet, _, _, _ = load_qnet(resume, self.device, with_targets=True)
                if cfg.learner.use_target and not self.qnet.use_target:
                    raise ValueError(f"{resume} has no target encoders but learner.use_target is true")
            else:
                self.qnet, _, _ = untrained_qnet(cfg.model, self.device, cfg.learner.use_target)
            self.timings["model_s"] = time.perf_counter() - t0
            if loading is not None:
                loading.result()
            self.timings["model_and_data_s"] = time.perf_counter() - t0
        self.learner = learner_cls(
            self.qnet, self.layout, training_env(cfg), cfg.learner, cfg.updates, self.device, seed=cfg.seed
        )
        self.sampler = EpochSampler(max(1, len(self.train_tok)), cfg.seed)
        self.history: list[dict[str, float]] = []
        self.resumed_sampler: dict[str, Any] | None = None
        self.seconds_before = 0.0
        self.slice_started: float | None = None  # set while run() trains
        if resume is not None:
            extra = load_training_state(resume, self.learner)
            self.resumed_sampler = extra.get("sampler")
            # The slices before the checkpoint: a resumed run reports its whole training time, not its last slice's.
            self.seconds_before = float(extra.get("seconds", 0.0))
            if self.resumed_sampler and self.train_tok:
                self.sampler.load_state(self.resumed_sampler)
            self.history = extra.get("history", [])
            # Checkpoints before the Fact EM tie-break kept the Fact F1 alone.
            self.best = tuple(extra.get("best_key") or (extra.get("best_f1", UNSELECTED[0]), UNSELECTED[1]))

    # -- data ----------------------------------------------------------------------------------

    def load_data(self) -> None:
        t0 = time.perf_counter()
        # Chunked and tokenised once per data source, tokenizer and chunk settings, then read from
        # the Arrow cache (qrag.data.prepared).
        d = self.cfg.data
        train, val = prepare_split(d, "train", self.tokenizer, self.layout).split_validation(d.val_fraction)
        dev = prepare_split(d, "dev", self.tokenizer, self.layout)
        part = training_part(d.supervision, train.samples(), train.tokenized())
        self.train_samples, self.train_tok, self.left_out = part
        self.val_samples, self.val_tok = val.samples(), val.tokenized()
        self.dev_samples, self.dev_tok = dev.samples(), dev.tokenized()
        self.timings["data_s"] = time.perf_counter() - t0

    def use_data(
        self,
        train: tuple[list[Sample], list[TokenizedSample]],
        val: tuple[list[Sample], list[TokenizedSample]],
        dev: tuple[list[Sample], list[TokenizedSample]],
    ) -> None:
        """Data made outside :meth:`load_data` (e.g. generated haystacks), as (samples, tokenized)
        pairs. A resumed run's epoch order goes on where its checkpoint left it."""
        (self.val_samples, self.val_tok), (self.dev_samples, self.dev_tok) = val, dev
        self.train_samples, self.train_tok, self.left_out = training_part(self.cfg.data.supervision, *train)
        self.sampler = EpochSampler(max(1, len(self.train_tok)), self.cfg.seed)
        if self.resumed_sampler:
            self.sampler.load_state(self.resumed_sampler)

    def tokenize(self, samples: Sequence[Sample]) -> list[TokenizedSample]:
        d = self.cfg.data
        return tokenize_samples(
            samples, self.tokenizer, self.layout, chunk_tokens=d.chunk_tokens, question_tokens=d.question_tokens
        )

    # -- paths ---------------------------------------------------------------------------------

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.out_dir) / self.cfg.name

    def checkpoint_dir(self, update: int) -> Path:
        return self.run_dir / "checkpoints" / f"update_{update:07d}"

    # -- steps ---------------------------------------------------------------------------------

    def local_source(self) -> LocalEpisodeSource:
        """Episodes sampled in this process from the training split (the default source)."""
        return LocalEpisodeSource(self.train_tok, self.cfg.learner.episodes_per_update, self.sampler)

    def evaluate(
        self,
        limit: int | None = None,
        search: SearchConfig | None = None,
        split: str = "dev",
        credit: str | None = None,
    ) -> EvalResult:
        """Search + metrics on ``split`` ("dev", or "val" — the held-out part of train), under the
        credit rule ``credit`` (default: the one the run is trained with)."""
        samples, tokenized = (self.val_samples, self.val_tok) if split == "val" else (self.dev_samples, self.dev_tok)
        search = search or self.cfg.search
        n = len(tokenized) if limit is None else min(limit, len(tokenized))
        retriever = Retriever(self.qnet, self.layout, self.device, self.cfg.learner.encode_tokens)
        try:
            return evaluate(
                retriever,
                samples[:n],
                tokenized[:n],
                search,
                extra={"update": self.learner.update, "split": split},
                credit=credit or self.cfg.env.credit,
            )
        finally:
            self.qnet.train()

    @property
    def periodic_split(self) -> str:
        """Periodic evaluation (and best-checkpoint selection) never looks at dev when a
        validation split exists, so the final dev figure stays unbiased."""
        return "val" if self.val_tok else "dev"

    def total_seconds(self) -> float:
        """Seconds of run() over every slice so far: this one's and those its checkpoint recorded (a slice
        killed after its last checkpoint loses the time since that checkpoint)."""
        this_slice = 0.0 if self.slice_started is None else time.perf_counter() - self.slice_started
        return self.seconds_before + this_slice

    def _end_slice(self) -> float:
        """The run's seconds so far, with this slice folded in (a later run() on this object goes on from there)."""
        self.seconds_before, self.slice_started = self.total_seconds(), None
        return self.seconds_before

    def save(self, directory: Path, resumable: bool = True) -> Path:
        extra = {
            "sampler": self.sampler.state(),
            "history": self.history[-10000:],
            "best_key": list(self.best),
            "seconds": self.total_seconds(),
        }
        # What it trained on, so that evaluation can refuse it (none known when Ray runners hold the data).
        trained = [validation_key(s) for s in self.train_samples] if self.train_samples else None
        return save_checkpoint(
            directory,
            self.qnet,
            self.tokenizer,
            self.cfg,
            self.learner if resumable else None,
            extra,
            trained_sources=trained,
        )

    def run(
        self,
        source: EpisodeSource | None = None,
        report: Reporter = print_reporter,
        on_checkpoint: Callable[[Path, dict[str, float]], None] | None = None,
        progress: bool = False,
        stop_at: int | None = None,
    ) -> dict[str, Any]:
        """Train to ``cfg.updates``, then evaluate on dev once. ``stop_at``: end this call after that
        update instead (one slice of a longer run, e.g. under a 10-minute job limit): a resumable
        checkpoint is saved and returned with ``stopped`` true, and no evaluation runs."""
        cfg = self.cfg
        end = cfg.updates if stop_at is None else min(cfg.updates, stop_at)
        source = source or self.local_source()
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.updates, initial=self.learner.update, desc="train", unit="upd", dynamic_ncols=True)
        last_eval: dict[str, float] = {}
        started = self.slice_started = time.perf_counter()
        while self.learner.update < end:
            t0 = time.perf_counter()
            batch = source.next_batch()
            wait = time.perf_counter() - t0
            m = self.learner.train_update(batch)
            seconds = time.perf_counter() - t0
            update = self.learner.update
            metrics = {
                "train/return": m.episode_return,
                "train/success": m.success,
                "train/loss": m.loss,
                "train/q_taken": m.q_taken,
                "train/target": m.target,
                "train/episode_length": m.episode_length,
                "train/alpha": m.alpha,
                "train/lr": m.lr,
                "train/grad_norm": m.grad_norm,
                "perf/episodes_per_s": m.episodes / seconds,
                "perf/encoder_tokens_per_s": m.encoder_tokens / seconds,
                "perf/runner_wait_s": wait,
                "perf/update_s": seconds,
                # The learning signal (qrag.rl.learner): visible without a debugger.
                "train/policy_entropy": m.policy_entropy,
                "train/value_next": m.value_next,
                "train/nonzero_return_share": m.nonzero_return_share,
                **{
                    f"train/{k}": v
                    for k, v in (("q_success", m.q_success), ("q_failure", m.q_failure))
                    if v is not None
                },
            }
            if m.encoder_seconds:
                metrics["perf/encoder_share"] = m.encoder_seconds / m.seconds
            self.history.append({"update": update, **metrics})
            if bar is not None:
                bar.update(1)
                bar.set_postfix(
                    ret=f"{m.episode_return:.3f}", loss=f"{m.loss:.4f}", eps=f"{metrics['perf/episodes_per_s']:.0f}"
                )
            if cfg.eval_every and (update % cfg.eval_every == 0 or update == cfg.updates):
                ev = self.evaluate(cfg.eval_limit, split=self.periodic_split).summary
                last_eval = {"eval/fact_em": ev["fact_em"], "eval/fact_f1": ev["fact_f1"]}
                metrics.update(last_eval)
                self.history[-1].update(last_eval)  # kept in checkpoints: which update keep_best chose stays traceable
                key = selection_key(ev)
                if cfg.keep_best and key > self.best:
                    self.best = key
                    best = self.save(self.run_dir / "best", resumable=False)
                    metrics["eval/best_fact_f1"] = self.best[0]
                    if on_checkpoint is not None:
                        on_checkpoint(best, metrics)
            if update % max(1, cfg.log_every) == 0 or update == cfg.updates or "eval/fact_f1" in metrics:
                report(update, metrics)
            if cfg.checkpoint_every and update % cfg.checkpoint_every == 0 and update < cfg.updates:
                path = self.save(self.checkpoint_dir(update))
                if on_checkpoint is not None:
                    on_checkpoint(path, metrics)
        if bar is not None:
            bar.close()
        if self.learner.update < cfg.updates:
            path = self.checkpoint_dir(self.learner.update)
            if not is_checkpoint(path):  # checkpoint_every may have saved this update already
                path = self.save(path)
            return {
                "stopped": True,
                "checkpoint": str(path),
                "updates": self.learner.update,
                "seconds": time.perf_counter() - started,
                "total_seconds": self._end_slice(),
                "run_dir": str(self.run_dir),
            }
        final = self.save(self.run_dir / "final")
        reported = final
        if cfg.keep_best and (self.run_dir / "best").is_dir():
            # Report the selected checkpoint: load its weights into the live model.
            best_qnet, *_ = load_qnet(self.run_dir / "best", self.device, with_targets=False)
            self.qnet.state_encoder.load_state_dict(best_qnet.state_encoder.state_dict())
            self.qnet.action_encoder.load_state_dict(best_qnet.action_encoder.state_dict())
            reported = self.run_dir / "best"
        result = self.evaluate(None)
        result.summary["checkpoint"] = str(reported)
        result.write(self.run_dir / "eval.json")
        summary = {"final/dev_fact_em": result.summary["fact_em"], "final/dev_fact_f1": result.summary["fact_f1"]}
        report(self.learner.update, summary)
        if on_checkpoint is not None:
            on_checkpoint(final, summary)
        return {
            "checkpoint": str(reported),
            "final_checkpoint": str(final),
            "eval": result.summary,
            "updates": self.learner.update,
            "seconds": time.perf_counter() - started,
            "total_seconds": self._end_slice(),
            "run_dir": str(self.run_dir),
        }


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete periodic checkpoint of a run (``*.partial`` ones are ignored)."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return None
    done = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.endswith(".partial") and is_checkpoint(p))
    return done[-1] if done else None
