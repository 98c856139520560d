"""The sweep on Ray Tune (Ray Train V2): a function trainable per trial that runs
``train_with_ray``, ASHA on the evaluation metric, trials resumed with the sweep.

* **Trainable.** ``run_trial`` builds the trial's training config (base + its draws, stored in
  ``<sweep>/trials/<sweep>-<trial id>/``) and calls ``train_with_ray`` with a Train
  ``UserCallback`` (``ray.tune.integration.ray_train.TuneReportCallback``) that forwards every
  report of the learner to Tune: evaluations (every ``eval_every`` updates, on the validation
  part of train) and checkpoints. The learner and its EpisodeFeeders get their resources from
  Ray Train, so the trial itself reserves only a sliver of a CPU (``resources.trial_cpus``).
* **Scheduler.** Ray's ASHA on ``update`` (time) and the sweep metric, with two additions: its
  rungs are saved in ``<sweep>/asha_state.pkl`` (Tune's public ``TrialScheduler.save``) after
  every decision (``Tuner.restore`` would otherwise start them empty), and it never stops a
  trial at its last update, which would cut off the final checkpoint and the trial's MLflow
  record.
* **Resume.** The trial's Train run lives at a path that depends on the trial id only; a
  restored trial calls ``train_with_ray`` again, which resumes it from its latest checkpoint in
  the same MLflow run.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray.tune as tune
from ray.tune.integration.ray_train import TuneReportCallback
from ray.tune.schedulers import AsyncHyperBandScheduler, FIFOScheduler, TrialScheduler
from ray.tune.search.basic_variant import BasicVariantGenerator

from qrag.distributed.sweep.results import TrialOutcome
from qrag.distributed.sweep.spec import Dimension, Sweep
from qrag.distributed.train import train_with_ray

ASHA_STATE = "asha_state.pkl"


@dataclass
class TrialSetup:
    """What every trial needs from the driver (shipped once through the object store)."""

    sweep: Sweep
    parent_run_id: str | None
    mlflow_uri: str | None

    def run_name(self, trial_id: str) -> str:
        return f"{self.sweep.name}-{trial_id}"

    def run_dir(self, trial_id: str) -> str:
        return f"{self.sweep.trials_dir()}/{self.run_name(trial_id)}"


class EvalForwarder(TuneReportCallback):
    """Forwards the learner's reports to Tune. The final checkpoint's report carries the final
    dev figures but not the evaluation of its update (reported just before): add it, so that
    every result Tune sees has the metric its scheduler compares."""

    def __init__(self) -> None:
        super().__init__()
        self.last_eval: dict[str, Any] = {}

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        first = metrics[0]
        evals = {k: v for k, v in first.items() if k.startswith("eval/")}
        if evals:
            self.last_eval = evals
        elif self.last_eval:
            metrics = [{**self.last_eval, **first}, *metrics[1:]]
        else:
            return  # nothing Tune could judge (the sweep's config check makes this unreachable)
        super().after_report(run_context, metrics, checkpoint)


def run_trial(params: dict[str, Any], setup: TrialSetup) -> None:
    """The Tune function trainable: one training run on Ray Train."""
    trial_id = tune.get_context().get_trial_id()
    name = setup.run_name(trial_id)
    cfg = setup.sweep.trial_config(params, name, setup.mlflow_uri)
    train_with_ray(
        cfg,
        storage_path=setup.sweep.trials_dir(),
        run_name=name,
        parent_run_id=setup.parent_run_id,
        callbacks=[EvalForwarder()],
        tracking=setup.mlflow_uri is not None,
    )


class ResumableASHA(AsyncHyperBandScheduler):
    """ASHA whose rungs survive a restart of the sweep and that lets a trial finish its last update."""

    _OWN = ("_state_file", "_last_update", "_restored")

    def __init__(self, state_file: str, last_update: int, **kwargs: Any):
        super().__init__(**kwargs)
        self._state_file, self._last_update, self._restored = state_file, last_update, False
        self.stopped: list[str] = []  # trials this scheduler stopped (saved with the rungs)

    def _restore_once(self) -> None:
        """Tune's public scheduler checkpoint (``TrialScheduler.restore``), keeping our own settings."""
        if self._restored:
            return
        own = {k: getattr(self, k) for k in self._OWN}
        if os.path.isfile(self._state_file):
            self.restore(self._state_file)
        for key, value in own.items():
            setattr(self, key, value)
        self._restored = True

    def _persist(self) -> None:
        tmp = f"{self._state_file}.tmp"
        self.save(tmp)  # TrialScheduler.save: public, and whatever ASHA needs to resume
        os.replace(tmp, self._state_file)
        # What the sweep's report needs, in a file of our own (not inside Tune's checkpoint).
        stopped = stopped_file(self._state_file)
        Path(f"{stopped}.tmp").write_text(json.dumps(self.stopped))
        os.replace(f"{stopped}.tmp", stopped)

    def on_trial_add(self, tune_controller, trial) -> None:
        self._restore_once()
        super().on_trial_add(tune_controller, trial)

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        self._restore_once()
        action = super().on_trial_result(tune_controller, trial, result)
        if action == TrialScheduler.STOP and result.get("update", 0) >= self._last_update:
            action = TrialScheduler.CONTINUE  # finishing anyway: let it write its final checkpoint
        elif action == TrialScheduler.STOP:
            self.stopped.append(trial.trial_id)
        self._persist()
        return action

    def on_trial_complete(self, tune_controller, trial, result: dict) -> None:
        self._restore_once()
        super().on_trial_complete(tune_controller, trial, result)
        self._persist()


def stopped_file(state_file: str) -> str:
    return os.path.join(os.path.dirname(state_file), "asha_stopped.json")


def stopped_trials(sweep: Sweep) -> set[str]:
    """Ids of the trials the scheduler stopped."""
    path = stopped_file(os.path.join(sweep.sweep_dir(), ASHA_STATE))
    return set(json.loads(Path(path).read_text())) if os.path.isfile(path) else set()


def tune_domain(dim: Dimension) -> Any:
    lo, hi = dim.values[0], dim.values[-1]
    return {
        "uniform": lambda: tune.uniform(lo, hi),
        "loguniform": lambda: tune.loguniform(lo, hi),
        "randint": lambda: tune.randint(lo, hi + 1),  # the sweep file's bounds are inclusive
        "choice": lambda: tune.choice(list(dim.values)),
        "grid": lambda: tune.grid_search(list(dim.values)),
    }[dim.kind]()


def make_tuner(setup: TrialSetup, restore: bool) -> tune.Tuner:
    sweep = setup.sweep
    spec = sweep.spec
    trainable = tune.with_resources(tune.with_parameters(run_trial, setup=setup), {"cpu": spec.resources.trial_cpus})
    if restore:
        return tune.Tuner.restore(sweep.tune_dir(), trainable=trainable, resume_unfinished=True, resume_errored=True)
    if spec.scheduler.type == "asha":
        scheduler = ResumableASHA(
            os.path.join(sweep.sweep_dir(), ASHA_STATE),
            sweep.base.updates,
            time_attr="update",
            grace_period=sweep.grace_period,
            reduction_factor=spec.scheduler.reduction_factor,
            max_t=sweep.max_t,
        )
    else:
        scheduler = FIFOScheduler()
    name = sweep.name
    return tune.Tuner(
        trainable,
        param_space={dim.key: tune_domain(dim) for dim in sweep.dims},
        tune_config=tune.TuneConfig(
            metric=sweep.metric,
            mode=sweep.mode,
            scheduler=scheduler,
            num_samples=spec.trials,
            # The generator enforces the concurrency limit (TuneConfig's would be ignored next to it).
            search_alg=BasicVariantGenerator(random_state=spec.seed, max_concurrent=spec.max_concurrent),
            trial_name_creator=lambda trial: f"{name}-{trial.trial_id}",
            trial_dirname_creator=lambda trial: f"trial-{trial.trial_id}",
        ),
        run_config=tune.RunConfig(
            name="tune", storage_path=sweep.sweep_dir(), failure_config=tune.FailureConfig(max_failures=0), verbose=1
        ),
    )


def _history(result) -> list[dict[str, Any]]:
    """Every result the trial reported (Tune's ``result.json``, one JSON object a line)."""
    try:
        with result.filesystem.open_input_stream(f"{result.path}/result.json") as fh:
            text = fh.read().decode("utf-8")
    except (FileNotFoundError, OSError):
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def outcome_of(result, setup: TrialSetup, stopped: set[str]) -> TrialOutcome:
    """A Tune trial as the sweep reports it: completed (it wrote its final checkpoint), stopped
    (by the scheduler), error, or interrupted (the sweep was, while it ran)."""
    sweep = setup.sweep
    trial_id = os.path.basename(result.path.rstrip("/")).removeprefix("trial-")
    history = _history(result)
    evals: dict[int, float] = {}
    for r in history:
        if sweep.metric in r and "update" in r:
            evals.setdefault(int(r["update"]), float(r[sweep.metric]))
    final = [r for r in history if "final/dev_fact_f1" in r]
    run_dir = setup.run_dir(trial_id)
    status = (
        "error"
        if result.error is not None
        else "completed"
        if final
        else "stopped"
        if trial_id in stopped
        else "interrupted"
    )
    checkpoint = None
    if final:
        chosen = "best" if sweep.base.keep_best and os.path.isdir(f"{run_dir}/best") else "final"
        checkpoint = f"{run_dir}/{chosen}"
    return TrialOutcome(
        trial_id=trial_id,
        params={key: (result.config or {}).get(key) for key in sweep.keys},
        status=status,
        updates=max((int(r.get("update", 0)) for r in history), default=0),
        evals=sorted(evals.items()),
        dev_fact_f1=final[-1]["final/dev_fact_f1"] if final else None,
        run_name=setup.run_name(trial_id),
        run_dir=run_dir,
        checkpoint=checkpoint,
        error=None
        if result.error is None
        else f"{type(result.error).__name__}: "
        f"{str(result.error).strip().splitlines()[0] if str(result.error).strip() else ''}",
    )
