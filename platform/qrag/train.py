"""The training loop on one machine, without Ray.

``TrainingRun`` owns the model, the learner and the data; ``run()`` takes episodes from any
source (local sampling here, env-runner actors under Ray), updates, evaluates, checkpoints and
reports metrics to a callback. ``qrag train`` and the Ray Train worker both call it.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from .checkpoint import (
    is_checkpoint, load_qnet, load_training_state, numpy_state, save_checkpoint, set_numpy_state, untrained_qnet,
)
from .config import SearchConfig, TrainConfig
from .data import load_samples
from .data.chunking import tokenizer_counter
from .data.sample import Sample
from .encoder import pick_device
from .evaluate import EvalResult, evaluate
from .learner import SoftPQNLearner
from .search import Retriever
from .tokens import TokenizedSample, tokenize_samples

Reporter = Callable[[int, dict[str, float]], None]


class EpisodeSource(Protocol):
    def next_batch(self) -> list[TokenizedSample]: ...


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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def print_reporter(step: int, metrics: dict[str, float]) -> None:
    print(json.dumps({"update": step, **{k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in metrics.items()}}), flush=True)


class TrainingRun:
    """Model + learner + data for one run; resumable from a checkpoint directory."""

    def __init__(self, cfg: TrainConfig, resume: str | Path | None = None, device: torch.device | None = None, load_data: bool = True):
        self.cfg = cfg
        self.device = device or pick_device(cfg.device)
        seed_everything(cfg.seed)
        if resume is not None:
            self.qnet, self.tokenizer, self.layout, _ = load_qnet(resume, self.device, with_targets=True)
            if cfg.learner.use_target and not self.qnet.use_target:
                raise ValueError(f"{resume} has no target encoders but learner.use_target is true")
        else:
            self.qnet, self.tokenizer, self.layout = untrained_qnet(cfg.model, self.device, cfg.learner.use_target)
        self.learner = SoftPQNLearner(self.qnet, self.layout, cfg.env, cfg.learner, cfg.updates, self.device, seed=cfg.seed)
        self.train_samples: list[Sample] = []
        self.dev_samples: list[Sample] = []
        self.train_tok: list[TokenizedSample] = []
        self.dev_tok: list[TokenizedSample] = []
        if load_data:
            self.load_data()
        self.sampler = EpochSampler(max(1, len(self.train_tok)), cfg.seed)
        self.history: list[dict[str, float]] = []
        if resume is not None:
            extra = load_training_state(resume, self.learner)
            if "sampler" in extra and self.train_tok:
                self.sampler.load_state(extra["sampler"])
            self.history = extra.get("history", [])

    # -- data ----------------------------------------------------------------------------------

    def load_data(self) -> None:
        count = tokenizer_counter(self.tokenizer)
        self.train_samples = load_samples(self.cfg.data, "train", count)
        self.dev_samples = load_samples(self.cfg.data, "dev", count)
        self.train_tok = self.tokenize(self.train_samples)
        self.dev_tok = self.tokenize(self.dev_samples)

    def tokenize(self, samples: Sequence[Sample]) -> list[TokenizedSample]:
        d = self.cfg.data
        return tokenize_samples(samples, self.tokenizer, self.layout, chunk_tokens=d.chunk_tokens, question_tokens=d.question_tokens)

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

    def evaluate(self, limit: int | None = None, search: SearchConfig | None = None) -> EvalResult:
        search = search or self.cfg.search
        n = len(self.dev_tok) if limit is None else min(limit, len(self.dev_tok))
        retriever = Retriever(self.qnet, self.layout, self.device, self.cfg.learner.encode_tokens)
        try:
            return evaluate(retriever, self.dev_samples[:n], self.dev_tok[:n], search, extra={"update": self.learner.update})
        finally:
            self.qnet.train()

    def save(self, directory: Path) -> Path:
        extra = {"sampler": self.sampler.state(), "history": self.history[-10000:]}
        return save_checkpoint(directory, self.qnet, self.tokenizer, self.cfg, self.learner, extra)

    def run(
        self,
        source: EpisodeSource | None = None,
        report: Reporter = print_reporter,
        on_checkpoint: Callable[[Path, dict[str, float]], None] | None = None,
        progress: bool = False,
    ) -> dict[str, Any]:
        cfg = self.cfg
        source = source or self.local_source()
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.updates, initial=self.learner.update, desc="train", unit="upd", dynamic_ncols=True)
        last_eval: dict[str, float] = {}
        started = time.perf_counter()
        while self.learner.update < cfg.updates:
            t0 = time.perf_counter()
            batch = source.next_batch()
            wait = time.perf_counter() - t0
            m = self.learner.train_update(batch)
            seconds = time.perf_counter() - t0
            update = self.learner.update
            metrics = {
                "train/return": m.episode_return, "train/success": m.success, "train/loss": m.loss,
                "train/q_taken": m.q_taken, "train/target": m.target, "train/episode_length": m.episode_length,
                "train/alpha": m.alpha, "train/lr": m.lr, "train/grad_norm": m.grad_norm,
                "perf/episodes_per_s": m.episodes / seconds, "perf/encoder_tokens_per_s": m.encoder_tokens / seconds,
                "perf/runner_wait_s": wait, "perf/update_s": seconds,
            }
            if m.encoder_seconds:
                metrics["perf/encoder_share"] = m.encoder_seconds / m.seconds
            self.history.append({"update": update, **metrics})
            if bar is not None:
                bar.update(1)
                bar.set_postfix(ret=f"{m.episode_return:.3f}", loss=f"{m.loss:.4f}", eps=f"{metrics['perf/episodes_per_s']:.0f}")
            if cfg.eval_every and update % cfg.eval_every == 0 and update < cfg.updates:
                ev = self.evaluate(cfg.eval_limit).summary
                last_eval = {"eval/fact_em": ev["fact_em"], "eval/fact_f1": ev["fact_f1"]}
                metrics.update(last_eval)
            if update % max(1, cfg.log_every) == 0 or update == cfg.updates or "eval/fact_f1" in metrics:
                report(update, metrics)
            if cfg.checkpoint_every and update % cfg.checkpoint_every == 0 and update < cfg.updates:
                path = self.save(self.checkpoint_dir(update))
                if on_checkpoint is not None:
                    on_checkpoint(path, metrics)
        if bar is not None:
            bar.close()
        final = self.save(self.run_dir / "final")
        result = self.evaluate(cfg.eval_limit)
        result.write(self.run_dir / "eval.json")
        summary = {"eval/fact_em": result.summary["fact_em"], "eval/fact_f1": result.summary["fact_f1"]}
        report(self.learner.update, summary)
        if on_checkpoint is not None:
            on_checkpoint(final, summary)
        return {
            "checkpoint": str(final), "eval": result.summary, "updates": self.learner.update,
            "seconds": time.perf_counter() - started, "run_dir": str(self.run_dir),
        }


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete periodic checkpoint of a run (``*.partial`` ones are ignored)."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return None
    done = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.endswith(".partial") and is_checkpoint(p))
    return done[-1] if done else None
