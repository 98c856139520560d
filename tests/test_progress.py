"""Progress with an ETA on long commands: a tqdm bar on stderr when asked (or on a terminal),
nothing from library code that no command turned on, one bar over a whole length sweep, and
``qrag index``'s bar over the input's documents."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from argparse import Namespace
from contextlib import redirect_stderr

import pytest

from conftest import ROOT
from qrag import progress


@pytest.fixture(autouse=True)
def bars_off_after():
    yield
    progress.configure(False)


def test_library_bars_are_silent_unless_a_command_turns_them_on():
    err = io.StringIO()
    with redirect_stderr(err):
        progress.configure(False)
        with progress.bar(10, "quiet", "q") as shown:
            shown.update(10)
        assert err.getvalue() == ""
        progress.configure(True)
        with progress.bar(10, "loud", "q") as shown:
            shown.update(10)
    assert "loud: 100%" in err.getvalue() and "10/10" in err.getvalue()


def test_a_command_bar_collects_the_inner_bars_of_its_kind():
    """qrag sweep-lengths: every retrieve call adds to one bar over the whole sweep."""
    from qrag.cli.lengths import with_progress
    from qrag.retrieval.search import RETRIEVE

    def fake_sweep(models, cfg, tasks, lengths, samples, val_samples=0, log=None):
        for _ in range(len(models) * len(tasks)):
            for n in [*map(samples, lengths), val_samples]:
                with progress.bar(n, "retrieve", "q", kind=RETRIEVE) as shown:
                    shown.update(n)
        return {"rows": []}

    progress.configure(True)
    err = io.StringIO()
    with redirect_stderr(err):
        with_progress(fake_sweep)(
            [("a", "none"), ("b", "none")], None, ["qa1"], [1000, 4000], lambda n: n // 100, val_samples=5
        )
    text = err.getvalue()
    assert "sweep-lengths: 100%" in text and "110/110" in text  # 2 models x (10 + 40 + 5 validation) questions
    assert "retrieve" not in text


def _run(args: list[str], tmp_path, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT / "platform"), **env}
    return subprocess.run(
        [sys.executable, "-m", "qrag", *args], capture_output=True, text=True, env=full, cwd=tmp_path, timeout=600
    )


def test_eval_shows_a_bar_with_an_eta_only_when_asked(tiny_encoder, hotpot_file, tmp_path):
    common = [
        "eval",
        "--checkpoint",
        "none",
        "--data",
        hotpot_file,
        "--limit",
        "6",
        "--device",
        "cpu",
        f"model.encoder={tiny_encoder}",
        "data.chunk_tokens=48",
        "data.cache_dir=none",
    ]
    shown = _run([*common, "--progress"], tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "retrieve: 100%" in shown.stderr and "6/6" in shown.stderr and "<00:00" in shown.stderr  # elapsed<remaining
    quiet = _run(common, tmp_path)  # stderr is a pipe here: no bar unless asked
    assert quiet.returncode == 0 and "retrieve:" not in quiet.stderr
    assert json.loads(quiet.stdout)["num_samples"] == json.loads(shown.stdout)["num_samples"] == 6
    off = _run([*common, "--no-progress"], tmp_path)
    assert off.returncode == 0 and "retrieve:" not in off.stderr


def test_index_counts_the_input_documents_and_follows_the_commits(tmp_path):
    from qrag.cli.index import input_documents, on_commit

    docs = tmp_path / "docs.jsonl"
    docs.write_text(
        "".join(json.dumps({"id": f"d{i}", "text": f"Document {i}. It has two sentences."}) + "\n" for i in range(7))
    )
    (tmp_path / "book.txt").write_text("A whole book in one file.")
    assert input_documents([(str(docs), "jsonl"), (str(tmp_path / "book.txt"), "text")]) == 8

    lines: list[dict] = []
    line = lines.append
    progress.configure(False)
    assert on_commit(Namespace(progress=None), None, line) is line  # no terminal: a line per commit
    assert on_commit(Namespace(progress=False), None, line) is None  # --no-progress: nothing
    progress.configure(True)
    err = io.StringIO()
    with redirect_stderr(err), progress.bar(8, "index books", "doc") as shown:
        report = on_commit(Namespace(progress=True), shown, line)
        report({"documents": 2, "already_committed": 3, "chunks": 10, "tokens": 400, "seconds": 2.0})  # a resumed run
        assert (shown.n, shown.total) == (2, 5)
        report({"documents": 5, "already_committed": 3, "chunks": 25, "tokens": 1000, "seconds": 4.0})
    assert "index books: 100%" in err.getvalue() and "5/5" in err.getvalue() and "250 tokens/s" in err.getvalue()
    assert lines == []
