"""qrag learned-stop: a stop chosen on one evaluation's questions, applied offline to another's
(qrag.evaluation.learned_stop). Planted bugs each test caught are named in it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qrag.data.sample import DataError
from qrag.evaluation.learned_stop import apply_learned_stop
from qrag.evaluation.seeds import combine_files

ROOT = Path(__file__).resolve().parents[1]


def write_eval(path: Path, split: str, gold: list[int], q: list[float], n: int = 10, **summary_fields) -> str:
    """A full-length greedy eval of n questions that all pick chunks 0, 1, 2, 3 in order."""
    search = {"max_steps": 4, "beam_width": 1, "stop_threshold": None}
    summary = {
        "checkpoint": "runs/a/best",
        "dataset": "musique",
        "split": split,
        "fact_em": 1.0,
        "fact_f1": 0.5,
        "search": search,
        "selected_on": "checkpoint: keep_best's",
        **summary_fields,
    }
    path.write_text(json.dumps(summary))
    rows = [
        {"id": f"{split}{i}", "gold": gold, "retrieved": [0, 1, 2, 3], "q_values": q, "fact_em": 1.0} for i in range(n)
    ]
    path.with_suffix(".records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture()
def pair(tmp_path):
    """Val: 2-hop questions, the Qs falling after two picks; dev: 4-hop, the Qs falling later. On
    dev alone a stop would keep all four picks; chosen on val it keeps two."""
    val = write_eval(tmp_path / "val.json", "train", [0, 1], [0.9, 0.8, 0.1, 0.05])
    dev = write_eval(tmp_path / "dev.json", "dev", [0, 1, 2, 3], [0.9, 0.85, 0.7, 0.6])
    return val, dev


@pytest.mark.parametrize("rule, chosen", [("budget", {"budget": 2}), ("threshold", {"threshold": 0.8})])
def test_the_stop_is_chosen_on_val_and_scored_on_the_other_file(pair, tmp_path, rule, chosen):
    """Planted bug caught: the stop chosen on the reported file (budget 4 / threshold 0.6, F1 1.0)."""
    val, dev = pair
    out = tmp_path / f"dev_{rule}.json"
    summary = apply_learned_stop(val, dev, rule, out)
    assert {k: summary[k] for k in chosen} == chosen and summary["stop_rule"] == rule
    assert summary["threshold_val_fact_f1"] == 1.0 and summary["threshold_val_questions"] == 10
    assert summary["threshold_fact_em"] == 0.0 and summary["threshold_fact_f1"] == pytest.approx(2 / 3)
    assert summary["fact_f1"] == 0.5  # the full-length figure stays beside it
    assert "stop: the" in summary["selected_on"] and "musique train, 10 questions" in summary["selected_on"]
    records = [json.loads(line) for line in out.with_suffix(".records.jsonl").read_text().splitlines()]
    assert len(records) == 10 and all(r["threshold_fact_f1"] == pytest.approx(2 / 3) for r in records)


def test_the_stopped_seeds_combine_with_intervals_and_each_seeds_own_stop(tmp_path):
    """Planted bug caught: a methods file taking the last seed's budget for every seed."""
    files = []
    for seed, val_q in enumerate(([0.9, 0.8, 0.1, 0.05], [0.9, 0.8, 0.1, 0.05], [0.9, 0.8, 0.7, 0.05])):
        gold = [0, 1] if seed < 2 else [0, 1, 2]
        val = write_eval(tmp_path / f"val{seed}.json", "train", gold, val_q, checkpoint=f"runs/s{seed}/best")
        dev = write_eval(tmp_path / f"dev{seed}.json", "dev", [0, 1, 2, 3], [0.9] * 4, checkpoint=f"runs/s{seed}/best")
        files.append(str(tmp_path / f"stopped{seed}.json"))
        apply_learned_stop(val, dev, "budget", files[-1])
    combined = combine_files(files, replicates=50)
    assert combined["budget_by_seed"] == [2, 2, 3] and "budget" not in combined
    assert combined["threshold_fact_f1"] == pytest.approx((2 / 3 + 2 / 3 + 6 / 7) / 3)
    assert len(combined["threshold_fact_f1_ci"]) == 2


def test_what_a_stop_cannot_be_learned_from_is_refused_naming_the_files(pair, tmp_path):
    """Planted bugs caught: each check below removed."""
    val, dev = pair
    out = tmp_path / "out.json"
    other = write_eval(tmp_path / "other.json", "dev", [0, 1], [0.9] * 4, checkpoint="runs/b/best")
    with pytest.raises(DataError, match="a stop is learned for one checkpoint"):
        apply_learned_stop(val, other, "budget", out)
    with pytest.raises(DataError, match="chosen on the questions it is reported on"):
        apply_learned_stop(dev, dev, "budget", out)
    beam = write_eval(tmp_path / "beam.json", "dev", [0, 1], [0.9] * 4, search={"max_steps": 4, "beam_width": 4})
    with pytest.raises(DataError, match="beam.json: searched with beam_width=4"):
        apply_learned_stop(val, beam, "budget", out)
    short = write_eval(tmp_path / "short.json", "dev", [0, 1], [0.9] * 4, search={"max_steps": 2, "beam_width": 1})
    with pytest.raises(DataError, match="use the same T"):
        apply_learned_stop(val, short, "budget", out)
    with pytest.raises(DataError, match="not an eval summary"):
        (tmp_path / "sweep.json").write_text(json.dumps({"rows": []}))
        apply_learned_stop(str(tmp_path / "sweep.json"), dev, "budget", out)
    assert not out.exists()


def test_the_command_runs(pair, tmp_path):
    val, dev = pair
    out = tmp_path / "cli.json"
    done = subprocess.run(
        [sys.executable, "-m", "qrag", "learned-stop", val, dev, "--rule", "budget", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT / "platform"), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["budget"] == 2 and out.is_file()


def write_mixed_eval(path: Path, split: str, questions: list[tuple[list[int], list[float]]]) -> str:
    """A full-length greedy eval whose questions (gold, Q values) differ, each picking 0, 1, 2, 3 in order."""
    write_eval(path, split, [0], [0.0] * 4, n=0)
    rows = [
        {"id": f"{split}{i}", "gold": gold, "retrieved": [0, 1, 2, 3], "q_values": q, "fact_em": 1.0}
        for i, (gold, q) in enumerate(questions)
    ]
    path.with_suffix(".records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_best_rule_takes_whichever_stop_scores_higher_on_val(tmp_path):
    """Planted bugs caught: ``best`` always the threshold; ``best`` chosen by the reported file's score."""
    two, three = ([0, 1], [0.9, 0.8, 0.1, 0.05]), ([0, 1, 2], [0.9, 0.8, 0.7, 0.05])
    dev = write_mixed_eval(tmp_path / "dev.json", "dev", [two, three])
    # Q falls right after the last fact: the threshold stops every question where it should, no count can.
    val = write_mixed_eval(tmp_path / "val.json", "train", [two, three] * 3)
    summary = apply_learned_stop(val, dev, "best", tmp_path / "by_q.json")
    assert summary["stop_rule"] == "threshold" and summary["threshold_val_fact_f1"] == 1.0
    assert "of the best budget and the best threshold" in summary["selected_on"]
    # Q says nothing (the same at every step) and every question has two hops: a count of 2 is right, a
    # threshold can only keep all four picks or none. On dev the threshold's four picks would score higher.
    flat = ([0, 1], [0.5, 0.5, 0.5, 0.5])
    val = write_mixed_eval(tmp_path / "val_flat.json", "train", [flat] * 4)
    dev = write_mixed_eval(tmp_path / "dev_long.json", "dev", [([0, 1, 2, 3], [0.5] * 4)] * 2)
    summary = apply_learned_stop(val, dev, "best", tmp_path / "by_count.json")
    assert summary["stop_rule"] == "budget" and summary["budget"] == 2 and "threshold" not in summary
