"""configs/hotpot-mpnet.yaml: the HotpotQA preset chosen on val (docs/training.md). It must stay the
run that was measured, and it must train: here a tiny random-init MPNet stands in for MPNet-base."""

from __future__ import annotations

import json

from conftest import ROOT

from qrag.config import flatten, load_config, to_dict

# What bench/hotpot_seeds.sh trained and HotpotQA val chose
# (bench/results/hotpot_encoders_h200/mpnet_mixed_80_updates/).
MEASURED = [
    "learner.objective=sft",
    "updates=80",
    "eval_every=10",
    "learner.micro_batch=64",
    "checkpoint_every=20",
    "model.encoder=mpnet",
]


def test_the_preset_is_the_measured_run():
    measured = flatten(to_dict(load_config(ROOT / "configs" / "hotpot-mixed.yaml", MEASURED)))
    preset = flatten(to_dict(load_config(ROOT / "configs" / "hotpot-mpnet.yaml")))
    differ = {
        k: (measured.get(k), preset.get(k)) for k in measured.keys() | preset.keys() if measured.get(k) != preset.get(k)
    }
    assert differ == {"name": ("hotpot-mixed", "hotpot-mpnet")}


def test_the_preset_trains_an_mpnet_on_cpu(tiny_mpnet, shared_data, tmp_path, monkeypatch):
    from qrag.cli import main

    monkeypatch.setenv("QRAG_DATA_DIR", str(shared_data))
    out = tmp_path / "run"
    args = [
        "train",
        "--config",
        str(ROOT / "configs" / "hotpot-mpnet.yaml"),
        f"model.encoder={tiny_mpnet}",
        "device=cpu",
    ]
    args += ["updates=2", "eval_every=2", "eval_limit=4", "checkpoint_every=2", "learner.episodes_per_update=8"]
    args += ["learner.micro_batch=4", f"out_dir={out}", "log_every=1"]
    assert main(args) == 0
    run = out / "hotpot-mpnet"
    encoder = json.loads((run / "best" / "state_encoder" / "config.json").read_text())
    assert encoder["model_type"] == "mpnet"
    assert load_config(run / "best" / "config.yaml").learner.objective == "sft"
    assert (
        json.loads((run / "eval.json").read_text())["num_samples"] == 286
    )  # HotpotQA's dev part, as configs/hotpot.yaml
