"""bench/val_from_logs.py: each seed's keep_best val score from its training log, rows named as their dev summaries."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

SCRIPT = ROOT / "bench" / "val_from_logs.py"


def write_log(path: Path, evals: list[tuple[int, float, float]]) -> None:
    lines = ["qrag train: starting", json.dumps({"update": 5, "train/loss": 0.3})]
    lines += [json.dumps({"update": u, "eval/fact_em": em, "eval/fact_f1": f1}) for u, em, f1 in evals]
    path.write_text("\n".join(lines) + '\n{\n  "fact_em": 0.1\n}\n')


def run(*args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT / "platform"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)


def test_keep_best_per_seed_and_rows_by_label(tmp_path):
    # keep_best keeps the first best F1 (a resumed run repeats update 20 with the same F1: not a new pick).
    write_log(tmp_path / "seed0.log", [(10, 0.50, 0.70), (20, 0.60, 0.80), (20, 0.65, 0.80), (30, 0.70, 0.75)])
    write_log(tmp_path / "seed1.log", [(10, 0.55, 0.72)])
    write_log(tmp_path / "sft-seed0.log", [(10, 0.80, 0.90)])
    write_log(tmp_path / "sft-seed1.log", [(10, 0.70, 0.85), (20, 0.90, 0.95)])
    (tmp_path / "hotpot_sft-s0.json").write_text(json.dumps({"label": "SFT"}))
    (tmp_path / "hotpot_s0.json").write_text(json.dumps({"label": "Q-RAG"}))
    (tmp_path / "hotpot_s1.json").write_text(json.dumps({"label": "Q-RAG"}))
    out = tmp_path / "val.json"
    done = run(str(tmp_path), "--out", str(out))
    assert done.returncode == 0, done.stderr
    summary = json.loads(out.read_text())
    rows = {m["label"]: m for m in summary["methods"]}
    assert set(rows) == {"Q-RAG", "SFT", "sft"}  # a seed without a dev summary keeps its log's tag
    assert rows["Q-RAG"]["seeds"]["0"] == {"update": 20, "fact_f1": 0.80, "fact_em": 0.60}
    assert abs(rows["Q-RAG"]["fact_em"] - (0.60 + 0.55) / 2) < 1e-9
    assert rows["SFT"]["seeds"]["0"]["fact_em"] == 0.80
    assert rows["sft"]["seeds"]["1"]["update"] == 20
    assert {(d["a"], d["b"]) for d in summary["differences"]} == {("Q-RAG", "SFT"), ("Q-RAG", "sft"), ("SFT", "sft")}


def test_a_log_without_evaluations_is_named(tmp_path):
    write_log(tmp_path / "seed0.log", [])
    done = run(str(tmp_path))
    assert done.returncode == 2
    assert "seed0.log: no periodic evaluation" in done.stderr and "Traceback" not in done.stderr
