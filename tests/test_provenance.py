"""Where a result was measured: the commit, whether the tree differed from it (tracked changes or
untracked files) and a hash of that difference (issue 33: results said "+wip" by hand)."""

from __future__ import annotations

import subprocess

import pytest

from qrag.integrations import provenance


@pytest.fixture()
def repo(tmp_path, monkeypatch):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / ".gitignore").write_text("ignored/\n")
    git("add", "-A")
    git("commit", "-qm", "one")
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    monkeypatch.delenv("QRAG_COMMIT", raising=False)
    provenance._checkout_state.cache_clear()
    yield tmp_path
    provenance._checkout_state.cache_clear()


def state():
    provenance._checkout_state.cache_clear()
    return provenance.git_state()


def test_clean_dirty_and_the_hash_of_the_difference(repo):
    clean = state()
    assert len(clean["commit"]) == 40 and clean["dirty"] is False and clean["diff_sha256"] is None
    (repo / "ignored").mkdir()
    (repo / "ignored" / "big.bin").write_text("not code")
    assert state()["dirty"] is False  # ignored files are not the code that ran
    (repo / "a.py").write_text("x = 2\n")
    edited = state()
    assert edited["dirty"] is True and edited["commit"] == clean["commit"] and len(edited["diff_sha256"]) == 64
    (repo / "new.py").write_text("y = 1\n")
    untracked = state()
    assert untracked["dirty"] is True and untracked["diff_sha256"] != edited["diff_sha256"]
    (repo / "new.py").write_text("y = 2\n")
    assert state()["diff_sha256"] != untracked["diff_sha256"]


def test_a_copied_tree_reads_the_state_from_the_environment(repo, monkeypatch):
    (repo / "a.py").write_text("x = 3\n")
    lines = dict(
        line.split("=", 1) for line in (provenance._checkout_state.cache_clear() or provenance.env_lines()).splitlines()
    )
    assert lines["QRAG_DIRTY"] == "1" and len(lines["QRAG_DIFF_SHA256"]) == 64
    for key, value in lines.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(provenance, "REPO", repo / "nowhere")
    assert provenance.git_state() == {
        "commit": lines["QRAG_COMMIT"],
        "dirty": True,
        "diff_sha256": lines["QRAG_DIFF_SHA256"],
    }
    assert provenance.machine_info()["dirty"] is True
    monkeypatch.delenv("QRAG_DIRTY")
    assert provenance.git_state()["dirty"] is None  # unknown, not clean
