"""The sweep without Ray: the same trials one after another in this process with
``qrag.rl.train.TrainingRun``, stopped by the same successive-halving rule as Ray Tune's ASHA.

For machines with torch but no Ray or MLflow (``tune/sweep.py --local``). Trials draw their
values with numpy (Tune draws its own under Ray). Progress is kept in ``<sweep>/local_state.json``
after every evaluation: started again, the sweep skips finished trials, resumes the interrupted
one from its latest checkpoint and keeps the rungs it had.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from qrag.rl.train import TrainingRun, latest_checkpoint
from qrag.distributed.sweep.results import TrialOutcome
from qrag.distributed.sweep.spec import Sweep


class RungRule:
    """Asynchronous successive halving, one bracket (the rule of Ray Tune's ASHA): rungs at
    grace * rf^k updates up to max_t; the first evaluation of a trial at or past a rung is
    recorded there, and the trial stops if it is below the (1 - 1/rf) quantile of what the rung
    recorded before it. A trial is never stopped at its last update (it is finishing anyway).

    Why a rule of our own and not Tune's scheduler run in-process: ``--local`` is the sweep for
    machines that have torch but no Ray (``bench/sweep_gpu.py`` runs on them), so it cannot
    import ``ray.tune``. It must still stop the same trials as the Ray sweep, so that a local
    sweep and a Ray sweep of one file are comparable: ``tests/test_sweep.py::
    test_the_stopping_rule_is_rays_asha`` feeds both this rule and Ray's own ASHA bracket the same
    random evaluations (both modes, several grace periods and reduction factors) and checks every
    decision, wherever Ray is installed (its CI is). Rungs are recorded under ``str(rung)`` so
    that ``local_state.json`` restores them on resume."""

    def __init__(self, grace: int, reduction_factor: float, max_t: int, mode: str, last_update: int):
        count = int(np.log(max_t / grace) / np.log(reduction_factor) + 1)  # as Ray's _Bracket
        self.rungs = [grace * reduction_factor**k for k in range(count)]
        self.rf, self.sign, self.last_update = reduction_factor, 1.0 if mode == "max" else -1.0, last_update
        self.recorded: dict[str, dict[str, float]] = {str(r): {} for r in self.rungs}

    def decide(self, trial: str, update: int, value: float) -> bool:
        """Record an evaluation; True if the trial should stop."""
        for rung in reversed(self.rungs):
            seen = self.recorded[str(rung)]
            if update < rung or trial in seen:
                continue
            before = list(seen.values())
            seen[trial] = self.sign * value
            stop = bool(before) and self.sign * value < float(np.nanpercentile(before, (1 - 1 / self.rf) * 100))
            return stop and update < self.last_update
        return False

    def state(self) -> dict[str, dict[str, float]]:
        return self.recorded

    def load(self, recorded: dict[str, dict[str, float]]) -> None:
        for rung, seen in recorded.items():
            self.recorded.setdefault(rung, {}).update(seen)


class _Stop(Exception):
    """Raised from the report callback: the rule stops this trial."""


class LocalSweep:
    def __init__(self, sweep: Sweep):
        self.sweep = sweep
        s = sweep.spec.scheduler
        self.rule = (
            RungRule(sweep.grace_period, s.reduction_factor, sweep.max_t, sweep.mode, sweep.base.updates)
            if s.type == "asha"
            else None
        )
        self.state_path = Path(sweep.sweep_dir()) / "local_state.json"
        self.outcomes: dict[str, TrialOutcome] = {}
        self.partial: dict[str, list[tuple[int, float]]] = {}  # evaluations of the trial in progress

    def _load(self, trials: list[dict[str, Any]]) -> None:
        if not self.state_path.is_file():
            return
        state = json.loads(self.state_path.read_text())
        if state.get("trials") != trials:
            from qrag.config import ConfigError

            raise ConfigError(
                f"sweep {self.sweep.name} in {self.state_path.parent} was started with other trials; "
                "resume it unchanged or choose a new --name"
            )
        self.outcomes = {k: TrialOutcome.from_json(v) for k, v in state.get("outcomes", {}).items()}
        self.partial = {k: [tuple(e) for e in v] for k, v in state.get("partial", {}).items()}
        if self.rule is not None:
            self.rule.load(state.get("rungs", {}))

    def _save(self, trials: list[dict[str, Any]]) -> None:
        state = {
            "trials": trials,
            "outcomes": {k: o.to_json() for k, o in self.outcomes.items()},
            "partial": self.partial,
            "rungs": self.rule.state() if self.rule else {},
        }
        tmp = self.state_path.with_suffix(".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_path)

    def run(self, deadline: float | None = None) -> tuple[list[TrialOutcome], bool]:
        """(outcomes so far, whether every trial has one). With ``deadline`` (``time.monotonic()``)
        no trial starts that the longest trial so far says would end past it: run again to go on."""
        trials = self.sweep.sample_trials()
        self._load(trials)
        longest = 0.0
        for i, params in enumerate(trials):
            trial_id = f"{i:05d}"
            if trial_id in self.outcomes:
                continue
            if deadline is not None and time.monotonic() + longest > deadline:
                break
            t0 = time.monotonic()
            self.outcomes[trial_id] = self._run_trial(trial_id, params, trials)
            longest = max(longest, time.monotonic() - t0)
            self.partial.pop(trial_id, None)
            self._save(trials)
        done = [self.outcomes[f"{i:05d}"] for i in range(len(trials)) if f"{i:05d}" in self.outcomes]
        return done, len(done) == len(trials)

    def _run_trial(self, trial_id: str, params: dict[str, Any], trials: list[dict[str, Any]]) -> TrialOutcome:
        sweep = self.sweep
        name = f"{sweep.name}-{trial_id}"
        cfg = sweep.trial_config(params, name, None)
        run_dir = Path(cfg.out_dir) / name
        resume = latest_checkpoint(run_dir)
        evals = self.partial.setdefault(trial_id, [])
        outcome = TrialOutcome(trial_id, params, "error", 0, evals, run_name=name, run_dir=str(run_dir))
        print(
            f"sweep: trial {trial_id} {json.dumps(params)}" + (f" (resuming from {resume})" if resume else ""),
            file=sys.stderr,
            flush=True,
        )

        def report(update: int, metrics: dict[str, float]) -> None:
            outcome.updates = update
            if sweep.metric not in metrics:
                return
            value = float(metrics[sweep.metric])
            if not any(u == update for u, _ in evals):
                evals.append((update, value))
            stop = self.rule is not None and self.rule.decide(trial_id, update, value)
            self._save(trials)
            print(
                f"sweep: trial {trial_id} update {update} {sweep.metric} {value:.4f}"
                + ("  -> stopped" if stop else ""),
                file=sys.stderr,
                flush=True,
            )
            if stop:
                raise _Stop

        t0 = time.perf_counter()
        try:
            out = TrainingRun(cfg, resume=resume).run(report=report)
        except _Stop:
            outcome.status = "stopped"
        except Exception as exc:  # noqa: BLE001 - one broken trial must not end the sweep
            outcome.error = f"{type(exc).__name__}: {exc}"
            print(f"sweep: trial {trial_id} failed: {outcome.error}", file=sys.stderr, flush=True)
        else:
            outcome.status, outcome.updates = "completed", out["updates"]
            outcome.dev_fact_f1, outcome.checkpoint = out["eval"]["fact_f1"], out["checkpoint"]
        print(
            f"sweep: trial {trial_id} {outcome.status} after {outcome.updates} updates "
            f"({time.perf_counter() - t0:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        return outcome
