import json
import subprocess
import sys

import pytest

from conftest import ROOT

QRAG = [sys.executable, "-m", "qrag"]
ENV = {"PYTHONPATH": str(ROOT / "platform"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}


def run(args, **kw):
    import os

    return subprocess.run(QRAG + args, capture_output=True, text=True, env={**os.environ, **ENV}, timeout=600, **kw)


def test_help_on_every_subcommand():
    from qrag.cli.commands import COMMANDS, build_parser

    build_parser()
    out = run(["--help"])
    assert out.returncode == 0 and "train" in out.stdout
    for name in COMMANDS:
        sub = run([name, "--help"])
        assert sub.returncode == 0, (name, sub.stderr)
        assert "usage: qrag " + name in sub.stdout
    train_help = run(["train", "--help"]).stdout
    assert "learner.alpha" in train_help and "entropy temperature" in train_help


def test_train_then_eval_end_to_end(tiny_encoder, hotpot_file, tmp_path):
    common = [f"model.encoder={tiny_encoder}", f"data.path={hotpot_file}", "data.chunk_tokens=48"]
    out = run(
        [
            "train",
            *common,
            f"out_dir={tmp_path}",
            "name=cli",
            "updates=2",
            "learner.episodes_per_update=4",
            "--no-progress",
            "learner.micro_batch=4",
            "eval_limit=5",
            "data.val_fraction=0.2",
        ]
    )  # overrides after an option too
    assert out.returncode == 0, out.stderr
    final = json.loads(out.stdout.strip().splitlines()[-1])
    assert final["updates"] == 2 and 0 <= final["fact_em"] <= 1
    # MLflow by default, as on Ray: the SQLite store beside the run (distributed.mlflow_uri=none: off)
    assert final["mlflow_run_id"] and final["tracking_uri"] == f"sqlite:///{tmp_path / 'mlflow.db'}"
    ck = tmp_path / "cli" / "final"
    res = tmp_path / "eval.json"
    ev = run(
        [
            "eval",
            "--checkpoint",
            str(ck),
            "--limit",
            "6",
            "--steps",
            "3",
            "--beam",
            "2",
            "--out",
            str(res),
            "--device",
            "cpu",
        ]
    )
    assert ev.returncode == 0, ev.stderr
    summary = json.loads(res.read_text())
    for key in ("fact_em", "fact_f1", "num_samples", "avg_steps"):
        assert key in summary
    assert summary["num_samples"] == 6 and summary["avg_steps"] == 3 and summary["objective"] == "pqn"
    # What chose it, from where it lies in its run, and the code that scored it (for combine-seeds).
    assert summary["selected_on"] == "checkpoint: the run's last (no choice among checkpoints)"
    assert {"git_commit", "git_dirty", "git_diff_sha256"} <= summary.keys()
    records = (tmp_path / "eval.records.jsonl").read_text().splitlines()
    assert len(records) == 6 and "retrieved" in json.loads(records[0])
    # --split val: exactly the questions training held out (data.val_fraction, the run's own), none trained on.
    from qrag.data.splits import in_split, in_validation

    held_out = {
        r["_id"]
        for r in json.loads(open(hotpot_file).read())
        if in_split(r["_id"], "train", 0.2) and in_validation(r["_id"], 0.2)
    }
    val = run(
        ["eval", "--checkpoint", str(ck), "--split", "val", "--device", "cpu", "--out", str(tmp_path / "val.json")]
    )
    assert val.returncode == 0, val.stderr
    assert json.loads((tmp_path / "val.json").read_text())["split"] == "val"
    val_ids = {json.loads(line)["id"] for line in (tmp_path / "val.records.jsonl").read_text().splitlines()}
    assert held_out and val_ids == held_out
    base = run(["eval", "--checkpoint", "none", *common, "--limit", "4", "--device", "cpu"])
    assert base.returncode == 0, base.stderr
    assert json.loads(base.stdout)["num_samples"] == 4
    assert json.loads(base.stdout)["selected_on"] == "nothing: the untrained encoder"


def test_eval_says_what_chose_its_checkpoint():
    from qrag.config import TrainConfig
    from qrag.evaluation.evaluate import checkpoint_selection

    cfg = TrainConfig()
    cfg.data.val_fraction = 0.1
    assert "validation part of train (data.val_fraction=0.1" in checkpoint_selection("runs/x/best/", cfg)
    cfg.data.val_fraction = 0.0
    assert "the dev split" in checkpoint_selection("runs/x/best", cfg)
    assert "update_0000300, given" in checkpoint_selection("runs/x/checkpoints/update_0000300", cfg)


@pytest.mark.parametrize(
    "args,message",
    [
        (["train", "learner.alpah=1"], "unknown config key learner.alpah"),
        (["train", "data.path=/nonexistent/file.json", "updates=1"], "/nonexistent/file.json: no such file"),
        (["train", "model.encoder=/nonexistent/model", "updates=1"], "encoder directory not found: /nonexistent/model"),
        (["eval", "--checkpoint", "/nonexistent/ck"], "checkpoint directory not found"),
        (["eval", "--checkpoint", "none", "--split", "val", "data.val_fraction=0"], "data.val_fraction is 0"),
    ],
)
def test_errors_are_one_clear_line(args, message):
    out = run(args)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_train_in_slices_with_stop_at_and_resume(tiny_encoder, hotpot_file, tmp_path):
    """`qrag train --stop-at U` ends a slice with a resumable checkpoint (no eval); `--resume`
    finishes the same run, in the same MLflow run."""
    common = [
        f"model.encoder={tiny_encoder}",
        f"data.path={hotpot_file}",
        "data.chunk_tokens=48",
        f"out_dir={tmp_path}",
        "name=sliced",
        "updates=3",
        "learner.episodes_per_update=4",
        "learner.micro_batch=4",
        "eval_limit=5",
        "--no-progress",
    ]
    first = run(["train", *common, "--stop-at", "2"])
    assert first.returncode == 0, first.stderr
    stopped = json.loads(first.stdout.strip().splitlines()[-1])
    assert stopped["stopped_at"] == 2 and stopped["updates"] == 3
    stopped_run = stopped["mlflow_run_id"]
    assert stopped["checkpoint"].endswith("checkpoints/update_0000002") and not (tmp_path / "sliced" / "final").exists()
    second = run(["train", *common, *stopped["resume"].split()])
    assert second.returncode == 0, second.stderr
    done = json.loads(second.stdout.strip().splitlines()[-1])
    assert done["updates"] == 3 and (tmp_path / "sliced" / "final").is_dir()
    assert done["total_seconds"] > done["seconds"]  # both slices' time, not the last one's alone

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("qrag").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # one MLflow run for both slices
    assert runs[0].info.run_id == stopped_run == done["mlflow_run_id"]
