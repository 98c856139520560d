"""One headline file from several training seeds (qrag combine-seeds, qrag.evaluation.seeds):
means with 95% intervals in the JSON, the printed table, qrag report's Markdown and the plots;
seeds must have been asked the same questions; differences are called only by their intervals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from qrag.data.sample import DataError
from qrag.evaluation.seeds import combine_files, combine_tables

LENGTHS = (1024, 1048576)


def row(model: str, task: str, length: int, scores: list[float], ids: list[str] | None = None) -> dict:
    ids = ids or [f"q{i}" for i in range(len(scores))]
    return {
        "model": model,
        "checkpoint": f"runs/{model}",
        "task": task,
        "length": length,
        "steps": 4,
        "credit": "chunk",
        "fact_em": float(np.mean(scores)),
        "fact_f1": float(np.mean(scores)),
        "num_samples": len(scores),
        "context_tokens": float(length),
        "per_question": {"id": ids, "fact_em": scores, "fact_f1": scores},
    }


def table(seed: int, models: dict[str, float], tasks=("qa3",), n: int = 120) -> dict:
    rng = np.random.default_rng(seed)
    rows = [
        row(m, t, length, rng.binomial(1, p, size=n).astype(float).tolist())
        for m, p in models.items()
        for t in tasks
        for length in LENGTHS
    ]
    return {
        "schema": "qrag.length_sweep/1",
        "split": "dev",
        "git_commit": f"c{seed}",
        "git_dirty": False,
        "rows": rows,
        "training": {"config": {"seed": seed}, "selected_on": "checkpoint: final"},
    }


def write(tmp_path, name: str, data: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_three_seeds_combine_into_means_with_intervals_and_called_differences(tmp_path):
    files = [write(tmp_path, f"s{s}.json", table(s, {"Q-RAG": 0.9})) for s in range(3)]
    files.append(write(tmp_path, "untrained.json", table(9, {"untrained": 0.1})))
    out = combine_files(files, replicates=300)
    assert out["kind"] == "seeds" and [s["training_seed"] for s in out["combined_from"]][:3] == [0, 1, 2]
    by = {(r["model"], r["length"]): r for r in out["rows"]}
    q = by[("Q-RAG", 1024)]
    assert q["num_seeds"] == 3 and q["num_samples"] == 120 and len(q["fact_em_by_seed"]) == 3
    assert q["fact_em_ci"][0] <= q["fact_em"] <= q["fact_em_ci"][1]
    assert q["fact_em"] == pytest.approx(np.mean(q["fact_em_by_seed"]))
    assert by[("untrained", 1024)]["num_seeds"] == 1
    called = {(d["length"], d["a"], d["b"]): d["called"] for d in out["differences"]}
    assert called[(1024, "Q-RAG", "untrained")] == "Q-RAG > untrained"


def test_seeds_asked_other_questions_are_refused(tmp_path):
    a, b = table(0, {"Q-RAG": 0.9}), table(1, {"Q-RAG": 0.9})
    b["rows"][0]["per_question"]["id"] = [f"other{i}" for i in range(120)]
    with pytest.raises(DataError, match="same \\(frozen\\) dev draw"):
        combine_tables([("a.json", a), ("b.json", b)])
    del b["rows"][0]["per_question"]
    with pytest.raises(DataError, match="per-question"):
        combine_tables([("a.json", a), ("b.json", b)])


def val_table(seed: int, models: dict[str, float], data_seed: int, n: int = 60) -> dict:
    """A validation table as bench/longctx.py writes one: its questions follow the run's data seed."""
    out = table(seed, models, n=n)
    out.update(split="val", data={"seed": data_seed})
    for r in out["rows"]:
        r["per_question"]["id"] = [f"d{data_seed}-q{i}" for i in range(n)]
    return out


def test_val_tables_of_several_data_seeds_combine_and_pair_seed_for_seed():
    tables = [
        (f"{m}_s{s}", val_table(10 * k + s, {m: p}, data_seed=s))
        for k, (m, p) in enumerate((("w1", 0.95), ("w0.3", 0.5)))
        for s in range(3)
    ]
    out = combine_tables(tables, replicates=300)
    w1 = next(r for r in out["rows"] if r["model"] == "w1" and r["length"] == 1024)
    assert w1["num_seeds"] == 3 and w1["num_samples"] == 60
    diff = next(d for d in out["differences"] if d["length"] == 1024)
    assert (diff["a"], diff["b"], diff["paired"], diff["called"]) == ("w1", "w0.3", True, "w1 > w0.3")
    # seeds out of step (seed 0 of one against seed 1 of the other): compared unpaired
    swapped = tables[:3] + [tables[4], tables[3], tables[5]]
    assert not next(d for d in combine_tables(swapped, replicates=100)["differences"])["paired"]
    # two files of one data seed must hold the same questions
    twin = val_table(7, {"w1": 0.9}, data_seed=0)
    twin["rows"][0]["per_question"]["id"] = [f"other{i}" for i in range(60)]
    with pytest.raises(DataError, match="same data seed 0"):
        combine_tables(tables[:3] + [("w1_twin", twin)])
    # a dev table among them: the frozen-draw rule again
    dev = [(f, {**t, "split": "dev"}) if f == "w1_s2" else (f, t) for f, t in tables]
    with pytest.raises(DataError, match="same \\(frozen\\) dev draw"):
        combine_tables(dev)


def test_several_tasks_get_a_mean_row_with_its_interval(tmp_path):
    tasks = ("niah_single_1", "niah_multivalue")
    out = combine_tables([(f"s{s}", table(s, {"Q-RAG": 0.8}, tasks, n=40)) for s in range(3)], replicates=200)
    mean = next(r for r in out["rows"] if r["task"] == "mean" and r["length"] == 1024)
    parts = [r for r in out["rows"] if r["task"] in tasks and r["length"] == 1024]
    assert mean["num_samples"] == 80 and mean["tasks"] == sorted(tasks)
    assert mean["fact_em"] == pytest.approx(np.mean([r["fact_em"] for r in parts]))


def test_cli_combine_then_report_show_the_intervals(tmp_path, capsys):
    from qrag.cli import main

    files = [write(tmp_path, f"s{s}.json", table(s, {"Q-RAG": 0.9, "untrained": 0.2})) for s in range(3)]
    out = tmp_path / "headline.json"
    assert main(["combine-seeds", *files, "--out", str(out), "--replicates", "200"]) == 0
    printed = capsys.readouterr().out
    assert "95% interval" in printed and "[" in printed and "Q-RAG > untrained" in printed
    assert out.with_suffix(".png").is_file() or "plot" in printed
    assert main(["report", str(out), "--out", str(tmp_path / "report")]) == 0
    md = (tmp_path / "report" / "report.md").read_text()
    assert "Differences in Fact EM" in md and "a difference only where the interval excludes 0" in md
    cell = json.loads(out.read_text())["rows"][0]
    assert f"{cell['fact_em']:.3f} [{cell['fact_em_ci'][0]:.3f}, {cell['fact_em_ci'][1]:.3f}]" in md
    assert "training seed(s) per row" in md


def test_eval_summaries_combine_from_their_records(tmp_path):
    files = [
        write_summary(
            tmp_path,
            f"eval{s}",
            None,
            0.7,
            s,
            n=60,
            selected_on="checkpoint: keep_best's" if s < 2 else "checkpoint: the run's last",
            git_dirty=s == 1,
        )
        for s in range(3)
    ]
    out = combine_files(files, replicates=200)
    assert out["num_seeds"] == 3 and out["fact_em_ci"][0] < out["fact_em"] < out["fact_em_ci"][1]
    # Every seed's selection and state, not the last file's alone.
    assert (
        out["selected_on"] == "eval0.json, eval1.json: checkpoint: keep_best's | eval2.json: checkpoint: the run's last"
    )
    assert out["git_commit"] == "abc" and out["git_dirty"] is True
    from qrag.evaluation.report import table2

    md = "\n".join(table2([("h.json", out)]).markdown)
    assert f"{out['fact_em']:.3f} [" in md


def test_report_seeds_combines_then_reports(tmp_path, capsys):
    from qrag.cli import main

    files = [write(tmp_path, f"s{s}.json", table(s, {"Q-RAG": 0.9})) for s in range(3)]
    assert main(["report", "--seeds", *files, "--out", str(tmp_path / "rep")]) == 0
    assert json.loads((tmp_path / "rep" / "combined.json").read_text())["kind"] == "seeds"
    assert "95% interval" in (tmp_path / "rep" / "report.md").read_text()
    files[1] = write(
        tmp_path,
        "bad.json",
        {**table(1, {"Q-RAG": 0.9}), "rows": [{**table(1, {"Q-RAG": 0.9})["rows"][0], "per_question": None}]},
    )
    assert main(["report", "--seeds", *files, "--out", str(tmp_path / "rep2")]) == 2
    assert "qrag report: error" in capsys.readouterr().err


def test_the_combined_provenance_speaks_for_every_source_not_the_last_file():
    seeds = [table(s, {"Q-RAG": 0.9}) for s in range(3)]
    for t in seeds:
        t["selected_on"] = t["training"]["selected_on"] = "checkpoint: the best on the val split at 1m"
    untrained = table(9, {"untrained": 0.1})
    untrained["training"] = {}
    untrained["selected_on"] = "learned stop only"
    seeds[1]["git_dirty"] = True
    out = combine_tables([(f"s{i}", t) for i, t in enumerate([*seeds, untrained])], replicates=100)
    assert out["selected_on"] == "Q-RAG: checkpoint: the best on the val split at 1m | untrained: learned stop only"
    assert out["git_commit"] == ["c0", "c1", "c2", "c9"] and out["git_dirty"] is True
    same = combine_tables([(f"s{i}", t) for i, t in enumerate(seeds)], replicates=100)
    assert same["selected_on"] == "checkpoint: the best on the val split at 1m"


def test_error_bars_are_never_negative_when_every_seed_scores_the_same():
    """Seeds all at 0.4: the mean (summed one way) can sit a hair above its interval's bound (summed
    another), and matplotlib refuses a negative bar; a combined table at a ceiling must still plot."""
    from qrag.evaluation.lengths import error_bars

    mean = sum([0.4] * 7 + [0.4] * 3) / 10 * 100  # 39.99999999999999 or 40.00000000000001
    bars = error_bars([mean, 50.0], [[0.3999999999999999, 0.3999999999999999], [0.45, 0.55]])
    assert min(bars[0] + bars[1]) >= 0.0
    assert bars[0][1] == pytest.approx(5.0) and bars[1][1] == pytest.approx(5.0)
    assert error_bars([mean], [[0.4 + 1e-16, 0.4 - 1e-16]])[1][0] >= 0.0


def write_summary(tmp_path, name: str, label: str | None, p: float, seed: int, n: int = 80, ids=None, **fields) -> str:
    """One seed's eval summary (``qrag eval --label``) with its per-question records beside it."""
    scores = np.random.default_rng(seed).binomial(1, p, size=n).astype(float)
    summary = {
        "dataset": "hotpotqa",
        "split": "dev",
        "checkpoint": f"runs/{name}/best",
        "fact_em": float(scores.mean()),
        "fact_f1": float(scores.mean()),
        "num_samples": n,
        "search": {"max_steps": 2},
        "train_dataset": "hotpotqa",
        "selected_on": "checkpoint: keep_best's",
        "git_commit": "abc",
        "git_dirty": False,
        **({"label": label} if label else {}),
        **fields,
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(summary))
    ids = ids or [f"q{i}" for i in range(n)]
    path.with_suffix(".records.jsonl").write_text(
        "".join(json.dumps({"id": q, "fact_em": v, "fact_f1": v}) + "\n" for q, v in zip(ids, scores))
    )
    return str(path)


def test_several_methods_seeds_combine_each_and_are_compared(tmp_path):
    """Table 3's rows on HotpotQA: each label's seeds combined, then every pair's difference, called
    only when its interval excludes 0."""
    files = [write_summary(tmp_path, f"q{s}", None, 0.9, s) for s in range(3)]
    files += [write_summary(tmp_path, f"t{s}", "w/o target", 0.3, 10 + s) for s in range(3)]
    files += [write_summary(tmp_path, f"c{s}", "w/o soft-Q", 0.9, 20 + s) for s in range(3)]
    out = combine_files(files, replicates=300)
    assert out["kind"] == "methods"
    methods = {m["label"]: m for m in out["methods"]}
    assert set(methods) == {"Q-RAG", "w/o target", "w/o soft-Q"}
    assert all(m["num_seeds"] == 3 for m in methods.values())
    assert methods["w/o target"]["combined_from"] == files[3:6]
    calls = {(d["a"], d["b"]): d["called"] for d in out["differences"]}
    assert calls[("Q-RAG", "w/o target")] == "Q-RAG > w/o target"
    assert calls[("Q-RAG", "w/o soft-Q")] == "no difference shown"
    # Same questions, as many seeds: compared question by question, seed i against seed i.
    assert all(d["paired"] for d in out["differences"])
    from qrag.evaluation.report import build_report

    path = tmp_path / "table3.json"
    path.write_text(json.dumps(out))
    text = build_report([path], tmp_path / "rep").text()
    assert "w/o target" in text and "Q-RAG > w/o target" in text

    # One seed against three cannot be paired seed for seed: each side is resampled on its own.
    untrained = combine_files([*files, write_summary(tmp_path, "u", "untrained", 0.5, 40)], replicates=50)
    assert {(d["a"], d["b"]): d["paired"] for d in untrained["differences"]}[("Q-RAG", "untrained")] is False
    files.append(write_summary(tmp_path, "other", "SFT", 0.9, 30, ids=[f"x{i}" for i in range(80)]))
    with pytest.raises(DataError, match="other questions"):
        combine_files(files, replicates=50)


def test_eval_label_names_the_method_in_the_summary(tiny_encoder, hotpot_file, tmp_path):
    from qrag.cli import main

    out = tmp_path / "u.json"
    args = [
        "eval",
        "--checkpoint",
        "none",
        "--config",
        "configs/hotpot.yaml",
        f"data.path={hotpot_file}",
        f"model.encoder={tiny_encoder}",
        "device=cpu",
        "--limit",
        "3",
        "--no-progress",
        "--out",
        str(out),
    ]
    assert main(args + ["--label", "BM25-free baseline"]) == 0
    assert json.loads(out.read_text())["label"] == "BM25-free baseline"
    assert main(args) == 0
    assert json.loads(out.read_text())["label"] == "Multi-step RAG w/o FT"


def test_each_seeds_own_stop_is_kept_per_seed_not_taken_from_the_first(tmp_path):
    """A seed's threshold and its stop's val score are its own: the combined row lists them by seed."""
    tables = [table(s, {"Q-RAG": 0.9}) for s in range(3)]
    for s, t in enumerate(tables):
        for r in t["rows"]:
            r.update(threshold=0.1 * s, threshold_val_fact_f1=0.8 + 0.01 * s, oracle_val_fact_f1=0.9 - 0.01 * s)
    out = combine_files([write(tmp_path, f"s{s}.json", t) for s, t in enumerate(tables)], replicates=50)
    r = out["rows"][0]
    assert r["threshold_val_fact_f1_by_seed"] == pytest.approx([0.8, 0.81, 0.82])
    assert r["oracle_val_fact_f1_by_seed"] == pytest.approx([0.9, 0.89, 0.88])
    assert r["threshold_by_seed"] == pytest.approx([0.0, 0.1, 0.2])
    assert "oracle_val_fact_f1" not in r and "threshold_val_fact_f1" not in r  # no one seed speaks for all


def test_learned_stops_are_compared_on_their_stopped_fact_f1(tmp_path):
    """qrag learned-stop files of two rows that pick alike over all T steps but stop differently: the
    methods file compares them on the stopped Fact F1 too, not on the unstopped Fact EM alone; a
    report shows each metric's differences under its own title."""
    files = []
    for label, stopped in (("SFT stop", 0.9), ("SFT", 0.4)):
        for s in range(3):
            path = write_summary(tmp_path, f"{label}{s}".replace(" ", "_"), label, 0.6, s)
            records = Path(path).with_suffix(".records.jsonl")
            rng = np.random.default_rng(100 + s)
            rows = [json.loads(line) for line in records.read_text().splitlines()]
            for r, f1 in zip(rows, rng.binomial(1, stopped, size=len(rows))):
                r.update(threshold_fact_em=float(f1), threshold_fact_f1=float(f1))
            records.write_text("".join(json.dumps(r) + "\n" for r in rows))
            files.append(path)
    out = combine_files(files, replicates=300)
    calls = {d["metric"]: d["called"] for d in out["differences"]}
    assert calls == {"fact_em": "no difference shown", "threshold_fact_f1": "SFT stop > SFT"}
    # A row without a stop (the untrained encoder) is compared on Fact EM and leaves the stopped pairs alone.
    out = combine_files([*files, write_summary(tmp_path, "u", "untrained", 0.2, 50)], replicates=100)
    pairs = {(d["metric"], d["a"], d["b"]) for d in out["differences"]}
    assert {p for p in pairs if p[0] == "threshold_fact_f1"} == {("threshold_fact_f1", "SFT stop", "SFT")}
    assert ("fact_em", "SFT", "untrained") in pairs
    from qrag.evaluation.report import build_report

    path = tmp_path / "stops.json"
    path.write_text(json.dumps(out))
    text = build_report([path], tmp_path / "rep").text()
    assert "Differences in Fact EM" in text and "Differences in Fact F1, learned" in text
