"""qrag.distributed without a Ray cluster: episode packing, episode feeders' shards, MLflow history,
path resolution and the checks that stop a job before any actor starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from qrag.config import ConfigError, load_config
from qrag.distributed.episodes import EpisodeBatch
from qrag.distributed.faults import FaultPlan, claim_once
from qrag.distributed.feeder import EpisodeFeeder, ShardStream
from qrag.model.encoder import load_tokenizer
from qrag.data.tokens import TokenizedSample, TokenLayout


def _sample(i: int, n_chunks: int) -> TokenizedSample:
    rng = np.random.default_rng(i)
    chunks = [rng.integers(0, 1000, size=rng.integers(3, 9)).astype(np.int32) for _ in range(n_chunks)]
    return TokenizedSample(f"s{i}", rng.integers(0, 1000, size=5).astype(np.int32), chunks, np.array([0, n_chunks - 1]))


def test_episode_batch_round_trip():
    episodes = [_sample(i, n) for i, n in enumerate([1, 4, 7])]
    back = EpisodeBatch.pack(episodes).unpack()
    assert [e.id for e in back] == ["s0", "s1", "s2"]
    for a, b in zip(episodes, back):
        assert np.array_equal(a.question, b.question) and b.question.dtype == np.int32
        assert len(a.chunks) == len(b.chunks) and all(np.array_equal(x, y) for x, y in zip(a.chunks, b.chunks))
        assert np.array_equal(a.support, b.support)
    assert EpisodeBatch.pack([]).unpack() == []


def test_shard_stream_walks_shuffled_epochs_deterministically():
    stream = ShardStream(7, seed=3, index=1)
    first = stream.take(0, 21)
    assert first == ShardStream(7, seed=3, index=1).take(0, 21)  # a function of (seed, index, position)
    for epoch in range(3):
        assert sorted(first[epoch * 7 : (epoch + 1) * 7]) == list(range(7))
    assert first[:7] != first[7:14]
    assert stream.take(5, 4) == first[5:9]  # any window, in any order of requests
    assert ShardStream(7, seed=3, index=2).take(0, 7) != first[:7]


def test_episode_feeders_partition_the_training_split(tiny_cfg):
    tok = load_tokenizer(tiny_cfg.model.encoder)
    layout = TokenLayout.from_tokenizer(tok, tiny_cfg.model.max_state_tokens)
    feeders = [EpisodeFeeder(tiny_cfg, i, 3, tiny_cfg.model.encoder, layout, 4) for i in range(3)]
    shards = [{e.id for e in f.episodes} for f in feeders]
    assert all(shards) and not (shards[0] & shards[1]) and not (shards[1] & shards[2])
    from qrag.data import load_samples
    from qrag.data.chunking import tokenizer_counter

    train = {s.id for s in load_samples(tiny_cfg.data, "train", tokenizer_counter(tok))}
    assert set().union(*shards) == train
    batch = feeders[1].episodes_for(2).unpack()
    assert len(batch) == 4 and {e.id for e in batch} <= shards[1]
    again = EpisodeFeeder(tiny_cfg, 1, 3, tiny_cfg.model.encoder, layout, 4).episodes_for(2).unpack()
    assert [e.id for e in again] == [e.id for e in batch]  # a restarted feeder answers the same
    with pytest.raises(ValueError, match="tokenizer"):
        EpisodeFeeder(tiny_cfg, 0, 3, tiny_cfg.model.encoder, dataclasses.replace(layout, pad_id=layout.pad_id + 1), 4)


def test_feeders_leave_the_validation_part_to_the_learner(tiny_cfg):
    from qrag.data.splits import in_validation

    cfg = dataclasses.replace(tiny_cfg, data=dataclasses.replace(tiny_cfg.data, val_fraction=0.3))
    tok = load_tokenizer(cfg.model.encoder)
    layout = TokenLayout.from_tokenizer(tok, cfg.model.max_state_tokens)
    ids = {e.id for e in EpisodeFeeder(cfg, 0, 1, cfg.model.encoder, layout, 4).episodes}
    assert ids and not any(in_validation(i, 0.3) for i in ids)


def test_fault_plan_fires_once(tmp_path):
    marker = str(tmp_path / "m")
    assert claim_once(marker) and not claim_once(marker) and not claim_once(None)
    cfg = load_config(None, ["learner.episodes_per_update=6", "distributed.kill_runner_at_update=2"])
    plan = FaultPlan(cfg, str(tmp_path / "run"))
    # 2 runners x 3 episodes per request: update 3 starts at episode 12 = request 4 = runner 0's 3rd.
    k, marker = plan.runner_crash(runners=2, per_request=3)
    assert k == 2 and marker.endswith("runner0_after_2")
    assert FaultPlan(cfg, "s3://bucket/run").runner_crash(2, 3) == (None, None)


# -- MLflow -----------------------------------------------------------------------------------


def test_metric_history_has_no_duplicates_after_a_restart(tmp_path, tiny_cfg):
    from mlflow import MlflowClient

    from qrag.integrations.tracking import MetricLogger, open_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = open_run(tiny_cfg, uri, "/runs/a", "a", resuming=False, parent_run_id="parent123")
    first = MetricLogger(uri, run_id)
    for step in (1, 2, 3):
        first.log(step, {"train/loss": 1.0 / step, "flag": True})
    # The learner crashed after update 3 and resumed from its checkpoint at update 2.
    again = MetricLogger(uri, run_id)
    logged = [again.log(step, {"train/loss": 5.0, "eval/fact_f1": 0.5}) for step in (3, 4, 5)]
    assert logged == [1, 2, 2]  # update 3: only the metric MLflow did not have yet
    client = MlflowClient(uri)
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5]
    assert [m.value for m in history if m.step == 3] == [pytest.approx(1 / 3)]
    run = client.get_run(run_id)
    assert run.data.params["learner.episodes_per_update"] == "6" and "flag" not in run.data.metrics
    assert run.data.tags["mlflow.parentRunId"] == "parent123"
    assert "config.yaml" in {a.path for a in client.list_artifacts(run_id)}
    assert (tmp_path / "mlruns").is_dir()  # artifacts beside the database, not in the cwd


def test_resubmitted_run_reuses_its_mlflow_run_unless_the_storage_was_cleared(tmp_path, tiny_cfg):
    from qrag.integrations.tracking import open_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = open_run(tiny_cfg, uri, "/runs/a", "a", resuming=False)
    assert open_run(tiny_cfg, uri, "/runs/a", "a", resuming=True) == first
    other = dataclasses.replace(tiny_cfg, distributed=dataclasses.replace(tiny_cfg.distributed, runners=5))
    assert open_run(other, uri, "/runs/a", "a", resuming=True) == first  # how it runs may change
    changed = dataclasses.replace(tiny_cfg, learner=dataclasses.replace(tiny_cfg.learner, alpha=0.3))
    with pytest.raises(ConfigError, match="learner.alpha: 0.05 -> 0.3"):
        open_run(changed, uri, "/runs/a", "a", resuming=True)
    assert open_run(tiny_cfg, uri, "/runs/a", "a", resuming=False) != first


def test_tracking_uri_defaults_beside_the_runs(tmp_path, monkeypatch):
    from qrag.integrations.tracking import tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(None, [f"out_dir={tmp_path}"])
    assert tracking_uri(cfg) == f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert tracking_uri(cfg) == "http://127.0.0.1:5000"
    assert tracking_uri(load_config(None, ["distributed.mlflow_uri=none"])) is None


# -- before any actor starts ------------------------------------------------------------------


@pytest.fixture
def no_ray(monkeypatch):
    """Fail the test if a job gets as far as connecting to Ray."""
    from qrag.distributed import job

    def refuse(*args, **kwargs):
        raise AssertionError("the job reached Ray")

    monkeypatch.setattr(job, "connect", refuse)
    monkeypatch.setattr(job, "launch", refuse)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["learner.alpah=1"], "unknown config key learner.alpah"),
        (["learner.alpha"], "bad override 'learner.alpha'"),
        (["data.path=/nonexistent/data.json"], "/nonexistent/data.json: no such file"),
        (["model.encoder=/nonexistent/model"], "encoder directory not found: /nonexistent/model"),
        (["distributed.prefetch=0"], "distributed.prefetch must be at least 1"),
    ],
)
def test_bad_input_stops_the_job_before_ray(extra, message, tiny_encoder, hotpot_file, tmp_path, capsys, no_ray):
    from qrag.distributed.job import run_job

    argv = [f"model.encoder={tiny_encoder}", f"data.path={hotpot_file}", f"out_dir={tmp_path}", *extra]
    assert run_job(argv, str(Path(__file__).parents[1] / "configs" / "smoke.yaml")) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_relative_paths_default_to_rays_storage_root_on_a_cluster(tmp_path, monkeypatch, tiny_encoder):
    from qrag.distributed.preflight import base_directory, resolve_paths

    monkeypatch.delenv("QRAG_BASE_DIR", raising=False)
    monkeypatch.setenv("RAY_STORAGE", str(tmp_path / "storage"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "h.json").write_text("[]")
    cfg = load_config(
        None,
        [
            "out_dir=runs",
            "data.path=data/h.json",
            f"model.encoder={tiny_encoder}",
            "distributed.mlflow_uri=sqlite:///runs/m.db",
        ],
    )
    # Joining a cluster (`ray job submit` sets RAY_ADDRESS): outputs under Ray's storage root,
    # inputs from the (uploaded) working directory.
    on_cluster = resolve_paths(cfg, base_directory(None, cluster=True))
    assert on_cluster.out_dir == str(tmp_path / "storage" / "runs") and on_cluster.data.path == str(
        tmp_path / "data" / "h.json"
    )
    assert on_cluster.distributed.mlflow_uri == f"sqlite:///{tmp_path / 'storage' / 'runs' / 'm.db'}"
    monkeypatch.delenv("RAY_STORAGE")
    assert resolve_paths(cfg, base_directory(None, cluster=True)).out_dir == str(
        Path("~/ray_results/runs").expanduser()
    )
    # An input that is not in the working directory has no meaning on the cluster: a clear error.
    missing = load_config(None, ["data.path=elsewhere/h.json", f"model.encoder={tiny_encoder}"])
    with pytest.raises(ConfigError, match="data.path=elsewhere/h.json is a relative path"):
        resolve_paths(missing, base_directory(None, cluster=True))
    # --base-dir: everything under it; a local Ray (plain python): the cwd.
    other = tmp_path / "other"
    other.mkdir()
    resolved = resolve_paths(cfg, base_directory(str(other), cluster=True))
    assert resolved.out_dir == str(other / "runs") and resolved.data.path == str(other / "data" / "h.json")
    assert resolve_paths(cfg, base_directory(None)).out_dir == str(tmp_path / "runs")


def test_autoscaling_capacity_counts(monkeypatch):
    from qrag.distributed.train import learner_resources

    cfg = load_config(None, ["distributed.runners=3", "distributed.runner_cpus=1", "distributed.learner_cpus=2"])
    monkeypatch.delenv("QRAG_AUTOSCALE_TO", raising=False)
    with pytest.raises(ConfigError, match="needs 5 CPUs .* has 2"):
        learner_resources(cfg, {"CPU": 2.0})
    monkeypatch.setenv("QRAG_AUTOSCALE_TO", '{"CPU": 16, "GPU": 2}')
    assert learner_resources(cfg, {"CPU": 2.0}) == (True, {"CPU": 2.0, "GPU": 1.0})
    monkeypatch.delenv("QRAG_AUTOSCALE_TO")
    grown = load_config(
        None, ["distributed.runners=3", "distributed.learner_cpus=2", "distributed.autoscale_to={CPU: 8}"]
    )
    assert learner_resources(grown, {"CPU": 2.0}) == (False, {"CPU": 2.0})


def test_the_cluster_must_hold_the_run():
    from qrag.distributed.train import learner_resources

    cfg = load_config(None, ["distributed.runners=3", "distributed.runner_cpus=1", "distributed.learner_cpus=2"])
    with pytest.raises(ConfigError, match="needs 5 CPUs .* has 4"):
        learner_resources(cfg, {"CPU": 4.0})
    assert learner_resources(cfg, {"CPU": 8.0, "GPU": 1.0}) == (True, {"CPU": 2.0, "GPU": 1.0})
    assert learner_resources(cfg, {"CPU": 8.0}) == (False, {"CPU": 2.0})
    with pytest.raises(ConfigError, match="no GPU"):
        learner_resources(load_config(None, ["distributed.learner_gpu=true"]), {"CPU": 8.0})
