"""qrag report: the Table 2 layout, length sweeps, early-stopping tables and plots."""

from __future__ import annotations

import json

import pytest

from qrag.evaluation.report import ReportError, build_report, table2


def summary(dataset, trained, fact_f1, fact_em, ans_f1=None, ans_em=None, checkpoint="runs/hotpot/final", beam=1, **kw):
    out = {
        "dataset": dataset,
        "train_dataset": trained,
        "fact_f1": fact_f1,
        "fact_em": fact_em,
        "num_samples": 10,
        "split": "dev",
        "checkpoint": checkpoint,
        "search": {"max_steps": 2, "beam_width": beam},
        **kw,
    }
    if ans_f1 is not None:
        out.update(ans_f1=ans_f1, ans_em=ans_em, reader_model="SmolLM2-135M-Instruct (local)", answer_errors=0)
    return out


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_table2_layout_ood_average_and_paper_rows():
    rep = table2(
        [
            ("h.json", summary("hotpotqa", "hotpotqa", 0.9, 0.8, 0.5, 0.4)),
            ("m.json", summary("musique", "hotpotqa", 0.6, 0.3, 0.3, 0.2)),
            ("b.json", summary("hotpotqa", None, 0.7, 0.5, 0.45, 0.35, checkpoint="none", similarity="cosine")),
            (
                "bm.json",
                summary("musique", None, 0.5, 0.3, checkpoint="none", similarity="cosine"),
            ),  # untrained: joins the OOD column
            ("p.json", summary("hotpotqa", "hotpotqa", 0.92, 0.85, beam=4)),
        ],
        paper=True,
    )
    lines = rep.markdown
    header = cells(next(line for line in lines if line.startswith("| Method")))
    assert header[:5] == ["Method", "HotPotQA Fact F1", "HotPotQA Fact EM", "HotPotQA Ans F1", "HotPotQA Ans EM"]
    assert header[5:9] == [
        "MuSiQue (OOD) Fact F1",
        "MuSiQue (OOD) Fact EM",
        "MuSiQue (OOD) Ans F1",
        "MuSiQue (OOD) Ans EM",
    ]
    assert header[-2:] == ["Avg Ans F1", "Avg Ans EM"]
    rows = {
        cells(line)[0]: cells(line)[1:] for line in lines if line.startswith("| ") and not line.startswith("| Method")
    }
    assert rows["Q-RAG"] == ["0.900", "0.800", "0.500", "0.400", "0.600", "0.300", "0.300", "0.200", "0.400", "0.300"]
    assert (
        rows["Multi-step RAG w/o FT"][:4] == ["0.700", "0.500", "0.450", "0.350"]
        and rows["Multi-step RAG w/o FT"][-1] == "–"
    )
    assert not any("| MuSiQue Fact F1" in line for line in lines)  # no separate in-distribution column
    assert rows["Plan Q-RAG"][2] == "–"  # no reader: no answer scores
    assert rows["Multi-step RAG w/o FT"][4:6] == ["0.500", "0.300"]
    # The paper's rows, with its averages over HotPotQA and MuSiQue (OOD).
    assert rows["Q-RAG (paper)"] == [
        "0.930",
        "0.890",
        "0.760",
        "0.590",
        "0.710",
        "0.550",
        "0.520",
        "0.370",
        "0.640",
        "0.480",
    ]
    assert rows["RAG-RL (paper)"][1] == "–"
    assert any("SmolLM2" in n and "MuSiQue (OOD)" in n for n in rep.notes)


def test_table2_refuses_ambiguous_rows():
    with pytest.raises(ReportError, match="two results for 'Q-RAG' on HotPotQA"):
        table2(
            [
                ("a.json", summary("hotpotqa", "hotpotqa", 0.9, 0.8)),
                ("b.json", summary("hotpotqa", "hotpotqa", 0.8, 0.7)),
            ]
        )
    rep = table2(
        [
            ("a.json", summary("hotpotqa", "hotpotqa", 0.9, 0.8, label="run A")),
            ("b.json", summary("hotpotqa", "hotpotqa", 0.8, 0.7, label="run B")),
        ]
    )
    assert sum(line.startswith("| run ") for line in rep.markdown) == 2


def test_report_files_lengths_and_early_stopping(tmp_path):
    (tmp_path / "h.json").write_text(json.dumps(summary("hotpotqa", "hotpotqa", 0.9, 0.8, 0.5, 0.4)))
    sweep = {
        "schema": "qrag.length_sweep/1",
        "rows": [
            {"model": "Q-RAG", "task": t, "length": n, "fact_f1": f, "fact_em": f - 0.1}
            for t in ("qa1", "qa2")
            for n, f in ((4096, 0.9), (131072, 0.8), (1048576, 0.7))
        ],
    }
    (tmp_path / "lengths.json").write_text(json.dumps(sweep))
    from qrag.evaluation.early_stopping import analyse

    records = [
        {"id": str(i), "gold": [1], "retrieved": [i % 3, 1, 5], "q_values": [0.9, 0.5 - 0.1 * (i % 3), -0.1]}
        for i in range(9)
    ]
    (tmp_path / "es.json").write_text(json.dumps(analyse(records)))
    out = tmp_path / "report"
    rep = build_report([tmp_path / "h.json", tmp_path / "lengths.json", tmp_path / "es.json"], out, paper=True)
    text = (out / "report.md").read_text()
    assert "## Fact and answer scores" in text and "## Fact F1 by context length (lengths)" in text
    assert (
        "| Task | 4K | 128K | 1M |" in text
        and "| qa1 | 0.900 | 0.800 | 0.700 |" in text
        and "| mean | 0.900 | 0.800 | 0.700 |" in text
    )
    assert "## Early stopping on the Q threshold (es)" in text and "| oracle |" in text
    assert {p.name for p in rep.plots} == {"lengths.lengths.png", "es.early_stopping.png"}
    for p in rep.plots:
        assert p.is_file() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
        assert f"]({p.name})" in text


def test_lengths_with_several_models(tmp_path):
    rows = [
        {"model": m, "task": "qa3", "length": n, "fact_f1": f}
        for m, f in (("Q-RAG", 0.9), ("untrained", 0.4))
        for n in (1024, 4096)
    ]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"rows": rows}))
    text = build_report([path], tmp_path / "r").text()
    assert "| qa3 · Q-RAG | 0.900 | 0.900 |" in text and "| qa3 · untrained | 0.400 | 0.400 |" in text


def test_length_columns_use_the_sweeps_labels(tmp_path):
    rows = [{"model": "Q-RAG", "task": "qa3", "length": n, "fact_f1": 0.5} for n in (1000, 4096, 2**20)]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"rows": rows}))
    text = build_report([path], tmp_path / "r").text()
    assert "| Task | 1000 | 4K | 1M |" in text  # qrag.data.contexts.length_label, as qrag sweep-lengths prints


def test_cli_report_with_early_stopping_from_records(tmp_path, capsys):
    from qrag.cli import main

    ev = tmp_path / "dev.json"
    ev.write_text(json.dumps(summary("hotpotqa", "hotpotqa", 0.9, 0.8)))
    with open(tmp_path / "dev.records.jsonl", "w") as fh:
        for i in range(6):
            fh.write(
                json.dumps(
                    {
                        "id": str(i),
                        "gold": [0, 1],
                        "retrieved": [0, 1, 2, 3],
                        "q_values": [0.8, 0.6, 0.1 * i, -0.2],
                        "stopped_early": False,
                    }
                )
                + "\n"
            )
    out = tmp_path / "rep"
    assert (
        main(["report", str(ev), "--early-stopping", "--thresholds", "0,0.25,0.7", "--out", str(out), "--paper"]) == 0
    )
    printed = capsys.readouterr().out
    assert "Q-RAG (paper)" in printed and "Early stopping on the Q threshold (dev)" in printed
    table = json.loads((out / "dev.early_stopping.json").read_text())
    assert [r["threshold"] for r in table["rows"]] == [0.0, 0.25, 0.7]
    # Q_3 = 0.1 i: at threshold 0.25 episodes i >= 3 take a third (unneeded) step: late stops.
    assert table["rows"][1]["late"] == pytest.approx(3 / 6) and table["rows"][1]["perfect"] == pytest.approx(3 / 6)
    assert (out / "dev.early_stopping.png").is_file()


def test_cli_report_errors_are_one_line(tmp_path, capsys):
    from qrag.cli import main

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["report", str(bad), "--out", str(tmp_path / "r")]) == 2
    assert "bad.json: not a JSON result file" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    assert main(["report", str(other), "--out", str(tmp_path / "r")]) == 2
    assert "other.json: not an eval summary" in capsys.readouterr().err
    thresholded = tmp_path / "t.records.jsonl"
    thresholded.write_text(
        json.dumps({"id": "a", "gold": [1], "retrieved": [1], "q_values": [0.5], "stopped_early": True}) + "\n"
    )
    assert main(["report", str(thresholded), "--out", str(tmp_path / "r")]) == 2
    assert "t.records.jsonl: record 0 (id=a): the run stopped on a Q threshold" in capsys.readouterr().err
