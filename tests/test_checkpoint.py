import json
from pathlib import Path

import pytest
import torch

from qrag.model.checkpoint import CheckpointError, fingerprint, load_qnet, read_meta
from qrag.rl.train import TrainingRun, latest_checkpoint


def params(qnet):
    return {k: v.detach().clone() for k, v in qnet.state_dict().items()}


def test_checkpoint_files_are_safetensors_and_json_only(tiny_cfg):
    run = TrainingRun(tiny_cfg)
    run.learner.train_update(run.train_tok[:4])
    path = run.save(Path(tiny_cfg.out_dir) / "ck")
    suffixes = {p.suffix for p in path.rglob("*") if p.is_file()}
    assert suffixes <= {".safetensors", ".json", ".yaml", ".txt"}, suffixes
    assert not any(p.suffix in {".bin", ".pt", ".pkl"} for p in path.rglob("*"))
    qnet, tok, layout, cfg = load_qnet(path, torch.device("cpu"))
    for name in ("state_encoder", "action_encoder", "target_state_encoder", "target_action_encoder"):
        a, b = getattr(run.qnet, name).state_dict(), getattr(qnet, name).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert cfg.learner.lr == tiny_cfg.learner.lr
    assert read_meta(path)["model"]["positions"] == tiny_cfg.model.positions
    assert len(fingerprint(path)) == 16


def test_resume_gives_the_same_result_as_an_uninterrupted_run(tiny_cfg, tmp_path):
    straight = TrainingRun(tiny_cfg)
    straight.run(report=lambda *_: None)

    from qrag.config import load_config, to_dict

    first_cfg = load_config(
        None,
        [f"{k}={json.dumps(v)}" for k, v in _flat(to_dict(tiny_cfg)).items()] + ["checkpoint_every=2", "name=split"],
    )
    first = TrainingRun(first_cfg)
    # stop after the checkpoint at update 2, as a crash would
    source = first.local_source()
    while first.learner.update < 2:
        first.learner.train_update(source.next_batch())
    ck = first.save(first.checkpoint_dir(2))
    assert latest_checkpoint(first.run_dir) == ck
    resumed = TrainingRun(first_cfg, resume=ck)
    assert resumed.learner.update == 2
    resumed.run(report=lambda *_: None)
    a, b = params(straight.qnet), params(resumed.qnet)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k


def test_a_run_cut_into_slices_equals_an_uninterrupted_run(tiny_cfg, tmp_path):
    straight = TrainingRun(tiny_cfg)
    straight.run(report=lambda *_: None)

    from qrag.config import load_config, to_dict

    cfg = load_config(
        None,
        [f"{k}={json.dumps(v)}" for k, v in _flat(to_dict(tiny_cfg)).items()] + ["checkpoint_every=0", "name=sliced"],
    )
    first = TrainingRun(cfg)
    out = first.run(report=lambda *_: None, stop_at=2)
    # A slice ends with a resumable checkpoint and no evaluation and no final checkpoint.
    assert out["stopped"] and out["updates"] == 2 and Path(out["checkpoint"]) == first.checkpoint_dir(2)
    assert not (first.run_dir / "final").exists() and not (first.run_dir / "eval.json").exists()
    assert latest_checkpoint(first.run_dir) == first.checkpoint_dir(2)

    # Data handed in from outside (generated haystacks) keeps the epoch order of the checkpoint.
    probe = TrainingRun(cfg, resume=out["checkpoint"], load_data=False)
    probe.use_data(
        (first.train_samples, first.train_tok), (first.val_samples, first.val_tok), (first.dev_samples, first.dev_tok)
    )
    assert probe.sampler.state() == first.sampler.state()

    resumed = TrainingRun(cfg, resume=out["checkpoint"])
    # The first slice's time travels in its checkpoint: the finished run reports both slices, not its last alone.
    before = resumed.seconds_before
    assert 0 < before <= out["total_seconds"]
    done = resumed.run(report=lambda *_: None, stop_at=10**6)  # past the schedule: the run just completes
    assert "stopped" not in done and done["updates"] == tiny_cfg.updates
    assert before + done["seconds"] <= done["total_seconds"] <= before + done["seconds"] + 0.1
    a, b = params(straight.qnet), params(resumed.qnet)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        elif not (isinstance(v, dict)):
            out[f"{prefix}{k}"] = v
    return out


def test_missing_or_foreign_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_qnet(tmp_path / "nope", torch.device("cpu"))
    (tmp_path / "x").mkdir()
    with pytest.raises(CheckpointError, match="not a qrag checkpoint"):
        load_qnet(tmp_path / "x", torch.device("cpu"))
