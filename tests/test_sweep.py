"""Sweeps without a Ray cluster: the sweep file's checks, the draws, the stopping rule (against
Ray's own ASHA bracket), the results table, plot and best config, and the sequential
``--local`` sweep with its resume. The Ray Tune sweep itself: tests/test_sweep_ray.py."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import ROOT

from qrag.config import ConfigError, load_config
from qrag.distributed.sweep.driver import check_same_sweep, main
from qrag.distributed.sweep.local import RungRule
from qrag.distributed.sweep.results import TrialOutcome, best_outcome, table_rows, write_report
from qrag.distributed.sweep.spec import load_sweep

PRESET = str(ROOT / "configs" / "smoke.yaml")
GOOD = {
    "name": "t",
    "base": PRESET,
    "overrides": {"eval_every": 2, "updates": 6, "data.val_fraction": 0.2},
    "space": {"learner.alpha": {"loguniform": [0.01, 0.5]}, "learner.lam": {"grid": [0.0, 0.5, 1.0]}},
    "trials": 2,
}


def write_sweep(tmp_path: Path, data: dict, name: str = "sweep.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def with_(**changes) -> dict:
    data = json.loads(json.dumps(GOOD))
    for key, value in changes.items():
        node = data
        *parents, last = key.split("__")
        for part in parents:
            node = node[part]
        if value is None:
            node.pop(last)
        else:
            node[last] = value
    return data


@pytest.mark.parametrize(
    "data, message",
    [
        (with_(budget=3), "unknown config key budget"),
        (with_(scheduler={"kind": "asha"}), "unknown config key scheduler.kind"),
        (with_(space={"learner.alhpa": {"uniform": [0, 1]}}), "space.learner.alhpa: not a training config key"),
        (with_(space={"alpha": {"uniform": [0, 1]}}), "did you mean learner.alpha"),
        (with_(space={"learner.alpha": {"normal": [0, 1]}}), "unknown kind 'normal'"),
        (with_(space={"learner.alpha": 0.1}), "fixed values go in overrides"),
        (with_(space={"learner.alpha": {"loguniform": [0, 1]}}), "bounds must be positive"),
        (with_(space={"learner.alpha": {"uniform": [1, 0]}}), "low must be below high"),
        (with_(space={"learner.episodes_per_update": {"uniform": [4, 64]}}), "expected an integer"),
        (with_(space={"learner.soft_q": {"choice": [True, "yes"]}}), "expected true or false"),
        (with_(space={"updates": {"choice": [4, 8]}}), "cannot vary updates"),
        (with_(space={"distributed.runners": {"choice": [1, 2]}}), "cannot vary distributed.runners"),
        (with_(space={}), "space: empty"),
        (with_(overrides={"eval_every": 0, "updates": 6, "data.val_fraction": 0.2}), "eval_every=0"),
        (with_(overrides={"eval_every": 2, "updates": 6, "data.val_fraction": 0.0}), "never on dev"),
        (
            with_(overrides={"eval_every": 2, "updates": 6, "data.val_fraction": 0.2, "checkpoint_every": 3}),
            "multiple of eval_every",
        ),
        (
            with_(overrides={"eval_every": 2, "data.val_fraction": 0.2, "learner.alhpa": 1}),
            "overrides: unknown config key learner.alhpa",
        ),
        (with_(scheduler={"reduction_factor": 1}), "scheduler.reduction_factor must be above 1"),
        (with_(scheduler={"metric": "train/return"}), "scheduler.metric must be"),
        (with_(resources={"gpus": 1.5}), "resources.gpus must be"),
        (with_(resources={"trial_cpus": 0}), "resources.trial_cpus must be positive"),
        (with_(base="missing.yaml"), "config file not found"),
        (with_(name="a b"), "use letters, digits"),
    ],
)
def test_sweep_file_errors_name_the_problem(tmp_path, data, message):
    path = write_sweep(tmp_path, data)
    with pytest.raises(ConfigError) as err:
        load_sweep(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_shipped_sweeps_load_and_vary_alpha_lambda_tau():
    hotpot = load_sweep(ROOT / "tune" / "hotpot_alpha_lambda_tau.yaml")
    assert {"learner.alpha", "learner.lam", "learner.tau", "learner.lr", "learner.episodes_per_update"} == set(
        hotpot.keys
    )
    assert hotpot.base.data.val_fraction > 0 and hotpot.base.updates == 160 and hotpot.total_trials() == 16
    assert hotpot.trial_config(hotpot.sample_trials()[0], "x", None).distributed.learner_gpus == 0.25
    smoke = load_sweep(ROOT / "tune" / "smoke.yaml", ["updates=8"])  # command-line overrides reach the base config
    assert smoke.base.updates == 8 and smoke.total_trials() == 4 and smoke.name == "smoke"


def test_trials_cross_the_grid_with_seeded_draws(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path, GOOD))
    trials = sweep.sample_trials()
    assert len(trials) == sweep.total_trials() == 6
    assert sorted(t["learner.lam"] for t in trials) == [0.0, 0.0, 0.5, 0.5, 1.0, 1.0]
    assert all(0.01 <= t["learner.alpha"] <= 0.5 for t in trials)
    assert trials == load_sweep(write_sweep(tmp_path, GOOD, "again.yaml")).sample_trials()  # same seed, same trials
    other = load_sweep(write_sweep(tmp_path, {**GOOD, "seed": 1}, "other.yaml")).sample_trials()
    assert [t["learner.alpha"] for t in other] != [t["learner.alpha"] for t in trials]
    cfg = sweep.trial_config(trials[0], "t-00000", "none")
    assert cfg.learner.alpha == trials[0]["learner.alpha"] and cfg.name == "t-00000"
    assert cfg.out_dir == f"{sweep.sweep_dir()}/trials" and cfg.distributed.mlflow_uri == "none"
    best = sweep.best_config(trials[0])
    assert best.name == "t-best" and best.out_dir == sweep.base.out_dir and best.learner.lam == trials[0]["learner.lam"]


def test_scheduler_max_t_sets_the_trial_length(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path, with_(scheduler={"max_t": 4, "grace_period": 2})))
    assert sweep.base.updates == sweep.max_t == 4 and sweep.grace_period == 2


def test_the_stopping_rule_is_rays_asha():
    """RungRule (the ``--local`` sweep) decides exactly like the bracket of Ray Tune's ASHA."""
    async_hyperband = pytest.importorskip("ray.tune.schedulers.async_hyperband")

    class Trial:
        def __init__(self, trial_id):
            self.trial_id = trial_id

    rng = np.random.default_rng(0)
    for mode in ("max", "min"):
        sign = 1.0 if mode == "max" else -1.0  # Tune's AsyncHyperBandScheduler hands its bracket metric * sign
        for rf, grace, max_t in [(2, 2, 16), (3, 10, 160), (4, 1, 64)]:
            ours = RungRule(grace, rf, max_t, mode, last_update=10**9)
            ray = async_hyperband._Bracket(grace, max_t, rf, 0)
            assert [float(m) for m, _ in reversed(ray._rungs)] == [float(r) for r in ours.rungs]
            trials = [Trial(str(i)) for i in range(12)]
            for step in range(200):
                trial = trials[int(rng.integers(len(trials)))]
                update = int(rng.integers(1, max_t + 1))
                value = float(rng.random())
                stop_ray = ray.on_result(trial, update, sign * value) == "STOP"
                assert ours.decide(trial.trial_id, update, value) == stop_ray, (mode, rf, step)


def test_the_stopping_rule_never_stops_a_trial_at_its_last_update():
    rule = RungRule(2, 2, 8, "max", last_update=8)
    assert not rule.decide("a", 8, 0.9)
    assert not rule.decide("b", 8, 0.1)  # below the rung's cutoff, but finishing anyway
    assert rule.decide("c", 4, 0.0) is False and rule.decide("d", 4, -1.0) is True


def outcome(trial_id, status, evals, **params):
    return TrialOutcome(
        trial_id,
        {"learner.alpha": 0.05, "learner.lam": 0.5, **params},
        status,
        evals[-1][0] if evals else 0,
        evals,
        dev_fact_f1=0.5 if status == "completed" else None,
        run_dir=f"/runs/{trial_id}",
    )


def test_report_ranks_plots_and_writes_a_trainable_best_config(tmp_path):
    sweep = load_sweep(
        write_sweep(
            tmp_path,
            with_(
                overrides={
                    "eval_every": 2,
                    "updates": 6,
                    "data.val_fraction": 0.2,
                    "keep_best": True,
                    "out_dir": str(tmp_path / "runs"),
                }
            ),
        )
    )
    outcomes = [
        outcome("a", "completed", [(2, 0.40), (4, 0.55), (6, 0.50)], **{"learner.alpha": 0.02}),
        outcome("b", "stopped", [(2, 0.60)], **{"learner.alpha": 0.3}),  # best early value, but never finished
        outcome("c", "completed", [(2, 0.45), (4, 0.50), (6, 0.52)], **{"learner.alpha": 0.1, "learner.lam": 1.0}),
        outcome("d", "error", [], **{"learner.alpha": 0.2}),
    ]
    assert [r["trial"] for r in table_rows(outcomes, sweep)] == ["b", "a", "c", "d"]  # by best validation F1
    assert best_outcome(outcomes, sweep).trial_id == "a"  # the best *completed* trial: b never finished its schedule
    report = write_report(outcomes, sweep, tmp_path / "out")
    rows = list(csv.DictReader(report.csv.open()))
    assert (
        [r["trial"] for r in rows] == ["b", "a", "c", "d"]
        and rows[1]["best_fact_f1"] == "0.55"
        and rows[1]["last_fact_f1"] == "0.5"
    )
    assert report.png.read_bytes()[:4] == b"\x89PNG"
    assert "learner.alpha" in report.table and "stopped" in report.table
    best = load_config(report.best_yaml)  # what `qrag train --config best.yaml` does first
    assert best.learner.alpha == 0.02 and best.learner.lam == 0.5 and best.name == "t-best"
    assert best.out_dir == str(tmp_path / "runs") and best.eval_every == 2
    assert "trial a, completed, best eval/fact_f1 0.5500" in report.best_yaml.read_text()


def test_a_resumed_sweep_must_keep_its_settings(tmp_path):
    out = f"out_dir={tmp_path / 'runs'}"
    first = load_sweep(write_sweep(tmp_path, GOOD), [out])
    check_same_sweep(first, resuming=False)
    check_same_sweep(
        load_sweep(write_sweep(tmp_path, {**GOOD, "max_concurrent": 3}, "b.yaml"), [out]), resuming=True
    )  # how, not what
    changed = load_sweep(write_sweep(tmp_path, GOOD, "c.yaml"), [out, "learner.lr=0.1"])
    with pytest.raises(ConfigError, match="started with other settings.*learner.lr"):
        check_same_sweep(changed, resuming=True)


def test_cli_errors_stop_before_anything_runs(tmp_path, capsys):
    path = write_sweep(tmp_path, with_(space={"learner.alhpa": {"uniform": [0, 1]}}))
    assert main(["--local", "--config", str(path)], prog="sweep") == 2
    assert "sweep: error:" in capsys.readouterr().err
    assert (
        main(["--config", str(ROOT / "tune" / "smoke.yaml"), "model.encoder=/nonexistent/encoder"], prog="sweep") == 2
    )


def test_local_sweep_stops_the_bad_trials_and_resumes(tiny_encoder, hotpot_file, tmp_path, capsys):
    """The shipped smoke sweep without Ray: the two trials that cannot retrieve (stop_threshold 10)
    are stopped at their first rung; an interrupted trial resumes from its checkpoint."""
    out = tmp_path / "runs"
    argv = [
        "--local",
        "--config",
        str(ROOT / "tune" / "smoke.yaml"),
        f"model.encoder={tiny_encoder}",
        f"data.path={hotpot_file}",
        f"out_dir={out}",
        "device=cpu",
    ]
    assert main(argv, prog="sweep") == 0
    first = capsys.readouterr()
    summary = json.loads(first.out.strip().splitlines()[-1])
    assert summary["trials"]["error"] == 0 and summary["trials"]["completed"] >= 1  # the first trial always completes
    rows = list(csv.DictReader(open(summary["results_csv"])))
    bad = [r for r in rows if r["search.stop_threshold"] == "10.0"]
    assert len(bad) == 2 and all(
        r["status"] == "stopped" and r["updates"] == "2" and r["best_fact_f1"] == "0.0" for r in bad
    )
    assert Path(summary["plot"]).is_file() and load_config(summary["best_config"]).name == "smoke-best"

    # Interrupt the last completed trial after its checkpoint at update 4: it resumes from there.
    state_path = out / "smoke" / "local_state.json"
    state = json.loads(state_path.read_text())
    last = max(k for k, o in state["outcomes"].items() if o["status"] == "completed")
    evals = state["outcomes"].pop(last)["evals"]
    state["partial"][last] = [e for e in evals if e[0] <= 4]
    state_path.write_text(json.dumps(state))
    assert main(argv, prog="sweep") == 0
    second = capsys.readouterr()
    assert f"trial {last}" in second.err and "resuming from" in second.err and "update_0000004" in second.err
    assert sum("sweep: trial" in line and "{" in line for line in second.err.splitlines()) == 1  # only that trial ran
    again = json.loads(second.out.strip().splitlines()[-1])
    assert again["trials"] == summary["trials"] and math.isclose(again["best"]["score"], summary["best"]["score"])


def test_a_sweep_that_stops_trials_needs_rays_state_api(monkeypatch, tiny_encoder, hotpot_file, tmp_path):
    """Without the state API, Ray Train never frees a stopped trial's resources: fail at once."""
    import ray.util.state

    from qrag.config import ConfigError
    from qrag.distributed.sweep.driver import require_state_api
    from qrag.distributed.sweep.spec import load_sweep

    sweep = load_sweep(
        ROOT / "tune" / "smoke.yaml",
        [f"model.encoder={tiny_encoder}", f"data.path={hotpot_file}", f"out_dir={tmp_path}"],
    )

    def no_dashboard(**kwargs):
        raise ConnectionError("no dashboard at 127.0.0.1:8265")

    monkeypatch.setattr(ray.util.state, "list_actors", no_dashboard)
    with pytest.raises(ConfigError, match="state API"):
        require_state_api(sweep)
    monkeypatch.setattr(ray.util.state, "list_actors", lambda **kwargs: [])
    require_state_api(sweep)  # answers: fine
