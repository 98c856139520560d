"""Every command in README.md, CONTRIBUTING.md and docs/*.md still works as written, as far as
can be checked without running it: a `qrag` subcommand exists and its parser accepts the options
(and `qrag train` loads its config with the overrides), a `python <script>` exists and its
argparse parser accepts the arguments, a `make` target exists; and every repository path the
docs name exists. (What the commands do is tested elsewhere; `make demo` runs the first one.)

The commands are checked in one child process (``python tests/test_docs.py COMMANDS.json``): it
imports each script with ``sys.argv`` set and stops it as soon as its argument parser returns.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = ("bash", "sh", "shell", "console")
# Scripts the docs run with no arguments that have no argument parser: another test runs them.
RUN_BY_TESTS = {"infra/validate.py": "tests/test_infra_manifests.py"}
PYTHONS = re.compile(r"^(?:\S*/)?python(?:3(?:\.\d+)?)?$")
SEPARATORS = {"&&", "||", ";", "|", "&", "do", "then", "done", "fi"}


# -- extraction -----------------------------------------------------------------------------------


def shell_blocks(path: Path) -> list[tuple[int, str]]:
    """(first line number, text) of each fenced shell block."""
    out, lines, i = [], path.read_text().split("\n"), 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if m:
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            if m.group(1) in SHELL_FENCES:
                out.append((i + 2, "\n".join(lines[i + 1 : j])))
            i = j
        i += 1
    return out


def simple_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell snippet (continuations joined, comments dropped, split on
    ;, &&, ||, |), with unexpanded words ($VAR, "${@:2}") left out."""
    commands = []
    for line in text.replace("\\\n", " ").split("\n"):
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for w in words + [";"]:
            ends = w.endswith(";") and w != ";"
            w = w[:-1] if ends else w
            if w in SEPARATORS:
                if current:
                    commands.append(current)
                current = []
                continue
            if not (w.startswith("$") or "${" in w):
                current.append(w)
            if ends:
                commands.append(current)
                current = []
    return [c for c in commands if c]


def invocations() -> list[dict]:
    """Every qrag / python-script / make invocation of the docs, with where it is written."""
    out = []
    for doc in DOCS:
        for line, block in shell_blocks(doc):
            for words in simple_commands(block):
                where = f"{doc.relative_to(ROOT)} (block at line {line}): {shlex.join(words)}"
                while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # VAR=value cmd
                    words = words[1:]
                if not words:
                    continue
                if words[0] == "qrag":
                    out.append({"kind": "qrag", "argv": words[1:], "where": where})
                elif words[0] == "make":
                    out.append({"kind": "make", "argv": words[1:], "where": where})
                else:
                    py = next((i for i, w in enumerate(words) if PYTHONS.match(w)), None)
                    if py is None:
                        continue
                    rest = words[py + 1 :]
                    if rest[:2] == ["-m", "qrag"]:
                        out.append({"kind": "qrag", "argv": rest[2:], "where": where})
                    elif rest and rest[0].endswith(".py"):
                        out.append({"kind": "script", "script": rest[0], "argv": rest[1:], "where": where})
    return out


# Repository paths in the text: they start at a top-level entry of the repository (or `qrag/`,
# the package under platform/), after a space, quote, backtick, bracket, '=' or line start.
def _roots() -> list[str]:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    tops = {p.split("/")[0] for p in tracked} | {"docs", "CONTRIBUTING.md"}
    return sorted(t for t in tops if not t.startswith("."))


def mentioned_paths(doc: Path) -> list[tuple[str, Path]]:
    text = doc.read_text()
    found = []
    for m in re.finditer(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", text):  # Markdown links, relative to the file
        target = m.group(1)
        if not re.match(r"^[a-z]+:", target):
            found.append((target, (doc.parent / target)))
    text = re.sub(r"\]\([^)]*\)", "]", text)
    roots = "|".join(re.escape(r) for r in _roots() + ["qrag"])
    for m in re.finditer(rf"(?:(?<=^)|(?<=[\s`'\"(\[=]))((?:{roots})(?:/[\w.*<>{{}},@-]*)*)", text, re.M):
        raw = m.group(1).rstrip(".,;:")
        if "/" not in raw and raw not in _roots():
            continue
        if raw == "qrag" or raw.startswith("qrag/") and raw.endswith("/"):  # the package name, a module folder
            continue
        rel = "platform/" + raw if raw.startswith("qrag/") else raw
        found.append((raw, ROOT / rel))
    return found


def path_exists(path: Path) -> bool:
    text = str(path)
    if "<" in text:  # a template (an output named by its run): its folder must exist
        return (
            Path(text.split("<")[0]).parent.exists()
            if not text.split("<")[0].endswith("/")
            else Path(text.split("<")[0]).exists()
        )
    m = re.search(r"\{([^{}]*)\}", text)
    if m:  # brace expansion
        return all(path_exists(Path(text[: m.start()] + alt + text[m.end() :])) for alt in m.group(1).split(","))
    if "*" in text:
        return bool(glob.glob(text))
    return path.exists() or os.path.lexists(path)


# -- the child process: parse each invocation, stop before any work -------------------------------


class _Parsed(BaseException):  # not an Exception: a script's `except Exception` must not swallow it
    pass


class _WouldWork(BaseException):
    pass


def _check_in_child(items: list[dict]) -> list[str]:
    import runpy

    sys.path.insert(0, str(ROOT / "platform"))
    os.chdir(ROOT)
    depth = 0
    parse_args, parse_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def patched_args(self, args=None, namespace=None):
        nonlocal depth
        depth += 1
        try:
            ns = parse_args(self, args, namespace)
        finally:
            depth -= 1
        if depth == 0:
            raise _Parsed(ns)
        return ns

    def patched_known(self, args=None, namespace=None):
        nonlocal depth
        depth += 1
        try:
            ns, extra = parse_known(self, args, namespace)
        finally:
            depth -= 1
        if depth == 0:  # the project's rule for the leftovers: key=value overrides only
            bad = [a for a in extra if a.startswith("-") or "=" not in a]
            if bad:
                self.error(f"unrecognized arguments: {' '.join(bad)}")
            raise _Parsed(ns)
        return ns, extra

    problems = []
    try:  # a command that gets past its parser must not start anything
        import ray

        def no_ray(*args, **kwargs):
            raise _WouldWork("ray.init was called: the command did work beyond parsing its arguments")

        ray.init = no_ray
    except ImportError:
        pass
    from qrag.cli import commands as cli

    def train_stub(args):
        from qrag.config import load_config

        if getattr(args, "config", None):
            load_config(args.config, args.overrides)
        return 0

    cli._load_extra_commands()  # every subcommand registered, then each one's work replaced
    for name, (help_text, configure, _) in list(cli.COMMANDS.items()):
        cli.COMMANDS[name] = (help_text, configure, train_stub if name == "train" else (lambda args: 0))
    for item in items:
        import contextlib
        import io

        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                if item["kind"] == "qrag":
                    code = cli.main(item["argv"])
                else:
                    argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = (
                        patched_args,
                        patched_known,
                    )
                    saved = list(sys.argv), list(sys.path)
                    try:
                        sys.argv = [item["script"], *item["argv"]]
                        sys.path.insert(0, str((ROOT / item["script"]).parent))
                        runpy.run_path(item["script"], run_name="__main__")
                        code = "the script ran to its end without parsing arguments"
                    finally:
                        sys.argv, sys.path[:] = saved
                        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = (
                            parse_args,
                            parse_known,
                        )
        except _Parsed:
            code = 0
        except _WouldWork as exc:
            code = str(exc)
        except SystemExit as exc:
            code = exc.code
        except Exception as exc:  # noqa: BLE001 - report the command whatever went wrong
            code = f"{type(exc).__name__}: {exc}"
        if code not in (0, None):
            problems.append(f"{item['where']}\n    -> {code}: {err.getvalue().strip()[-600:]}")
    return problems


# -- tests ----------------------------------------------------------------------------------------


def test_the_docs_have_commands_of_every_kind():
    items = invocations()
    kinds = {i["kind"] for i in items}
    assert kinds == {"qrag", "script", "make"}, kinds
    readme = [i for i in items if i["where"].startswith("README.md")]
    assert [i["argv"] for i in readme[:2]] == [["demo"], ["test"]]  # the quick start's two commands, verified by CI
    assert {i["argv"][0] for i in items if i["kind"] == "qrag"} >= {"train", "eval", "serve", "report", "sweep-lengths"}


def test_make_targets_exist():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    for item in (i for i in invocations() if i["kind"] == "make"):
        wanted = [a for a in item["argv"] if "=" not in a and not a.startswith("-")] or ["install"]
        assert set(wanted) <= targets, item["where"]


def test_scripts_exist():
    for item in (i for i in invocations() if i["kind"] == "script"):
        assert (ROOT / item["script"]).is_file(), item["where"]


def test_every_qrag_and_script_command_parses(tmp_path):
    items = [
        i for i in invocations() if i["kind"] == "qrag" or (i["kind"] == "script" and i["script"] not in RUN_BY_TESTS)
    ]
    for script, test in RUN_BY_TESTS.items():
        assert (ROOT / test).is_file() and script in (ROOT / test).read_text()
    spec = tmp_path / "commands.json"
    spec.write_text(json.dumps(items))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, __file__, str(spec)], cwd=ROOT, capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"checked": len(items)}


def test_every_path_the_docs_name_exists():
    missing = [
        f"{doc.relative_to(ROOT)}: {raw}" for doc in DOCS for raw, path in mentioned_paths(doc) if not path_exists(path)
    ]
    assert not missing, "\n".join(missing)


def test_readme_is_short_and_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in readme, page.name


if __name__ == "__main__":
    problems = _check_in_child(json.loads(Path(sys.argv[1]).read_text()))
    if problems:
        print("\n".join(problems))
        sys.exit(1)
    print(json.dumps({"checked": len(json.loads(Path(sys.argv[1]).read_text()))}))
