"""Measured figures stay out of the package (issue #36): comments, docstrings, ``--help`` texts and
config comments say what a thing does and why, in a sentence; every measured figure lives in a JSON
of ``bench/results/`` and is shown in docs/benchmarks.md or bench/results/README.md, which the code
links to by section, never by a result file.

Scanned: in ``platform/qrag/**/*.py`` the comments (``tokenize``), the docstrings and other bare string
statements, and the help texts (``ast``: the string literals of ``opt(...)`` and ``command(...)``
calls and of the ``help=``, ``description=``, ``epilog=``, ``summary=`` and ``usage=`` arguments of
any call); in ``serve/``, ``tune/``, ``jobs/`` and ``infra/`` scripts the same; in ``configs/*.yaml``,
``serve/config.yaml``, ``tune/*.yaml`` and ``infra/**/*.yaml`` the YAML comments.

Flagged: benchmark rounds and sessions ("round 9", "rounds 5-8", "session 3"); GPU card names (a
card named in code is the context of a measurement); a number with a unit of time, rate or memory
("7.9 ms", "3.2M tokens/s", "734 q/s", "12 GiB"); ranges of measured values ("0.50–0.61"); shares
("0.35 of the bare forward against 0.50", "4 % of a worker's time"); quality scores ("0.93 Fact EM");
run counts ("in 9 of 10 runs"); speed-ups ("×1.6", "1.6x faster"); and paths into ``bench/results``.
A setting that only looks like a figure (a default the config states itself) goes in ``ALLOWED``
below, one entry per line with its reason.

Run ``python tests/test_no_figures_in_code.py`` to print every offending line as ``file:line: text``.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PATTERNS: dict[str, re.Pattern[str]] = {
    "benchmark round": re.compile(r"\b(?:rounds?|sessions?)\s+\d+", re.I),
    "GPU card": re.compile(r"\b(?:[HAB][18]00|[GH]H200|V100|A10G?|L40S?|L4|T4|RTX\s*\d{4})(?:[-_ ]?x\d)?\b"),
    "GPU timing": re.compile(
        r"\b(?:one|a|two|four|\d+)\s+GPUs?\b[^.;]{0,60}\b(?:took|takes|ran|runs at|does)\s+(?:about\s+|~\s*)?\d", re.I
    ),
    "time": re.compile(
        r"(?<![\w.])~?\d[\d.,]*\s*(?:ns|µs|us|ms|s|sec|secs|seconds?|minutes?|mins?|hours?|h)\b(?!\s*[-=]\s*\w)(?![/_])"
    ),
    "rate": re.compile(
        r"\d[\d.,]*\s*[kKMGB]?\s*(?:tokens?|episodes?|eps|q|queries|req|requests|upd|updates|it|samples|chunks|docs|documents|questions|steps)\s*(?:/\s*s\b|per\s+s(?:econd)?\b)",
        re.I,
    ),
    "memory": re.compile(r"\d[\d.,]*\s*(?:[KMGT]iB|[KMGT]B)\b"),
    "token count": re.compile(r"\d\.\d+\s*[KMB]\s*tokens\b"),
    "measured range": re.compile(r"(?<![\w.])\d+\.\d+\s*(?:–|—|-|to)\s*\d+\.\d+(?![\w.])|\d\s*[–-]\s*\d+\s*%"),
    "measured share": re.compile(
        r"\b\d\.\d\d+\s+(?:of the (?:bare|wall)|against\s+\d)|\d\s*%\s+of\s+[^.;]{0,30}\btime\b"
    ),
    "quality score": re.compile(
        r"\b[01]?\.\d+\s+(?:\w+\s+)?(?:Fact|answer)\s+(?:EM|F1)\b|\b(?:Fact|answer)\s+(?:EM|F1)\b[^.;()]{0,25}?(?:[01]?\.\d+|:\s*\d+)"
    ),
    "run count": re.compile(r"\b\d+\s+(?:of|out of)\s+\d+\s+(?:runs|calls|trials|repeats|tries|seeds)\b", re.I),
    "speed-up": re.compile(
        r"(?:×\s*\d[\d.]*|\d[\d.]*\s*×|\b\d[\d.]*\s*x\s+(?:faster|slower|speed|more|less|fewer|higher|lower|the)\b)",
        re.I,
    ),
    "bench/results path": re.compile(r"bench/results\b"),
}

# (path relative to the repository, a text the offending line contains, why it is not a figure).
# Keep it short: a figure belongs in bench/results, not here.
ALLOWED: list[tuple[str, str, str]] = [
    ("platform/qrag/config.py", "'accelerator_type:A100'", "an example of a Ray resource name, not a measurement"),
    ("platform/qrag/model/encoder.py", "(Python's default is 5 ms)", "Python's own switch interval default, a setting"),
    ("serve/config.yaml", "Serve's proxy: 120 s above", "the proxy's request timeout set higher up in this file"),
    (
        "infra/kuberay/serve/rayservice.yaml",
        "Serve's proxy: 120 s above",
        "the proxy's request timeout set higher up in this file",
    ),
    (
        "infra/kuberay/serve/rayservice.yaml",
        "# 8 GiB of loaded corpora",
        "the value of the setting on that line, in GiB",
    ),
]


# -- extraction -----------------------------------------------------------------------------------


HELP_CALLS = {"opt", "command"}  # every string argument is help text (qrag.config.opt, qrag.cli.commands.command)
HELP_KEYWORDS = {"help", "description", "epilog", "summary", "usage"}


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _strings(node: ast.AST):
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            yield n


def _locate(value: str, start: int, lines: list[str], node: ast.AST) -> int:
    """The source line of the text at ``value[start:]`` inside a string literal ``node``."""
    first_line = value[start:].split("\n", 1)[0].strip()[:30]
    if "\n" in value[:start] and node.lineno == node.end_lineno:
        return node.lineno
    guess = node.lineno + value[:start].count("\n")
    if first_line and first_line not in lines[guess - 1]:
        for i in range(node.lineno, (node.end_lineno or node.lineno) + 1):
            if first_line in lines[i - 1]:
                return i
    return guess


def python_texts(source: str) -> list[tuple[int, str, str]]:
    """(line, kind, source line): every comment of a module, and each figure in its docstrings,
    bare strings and help texts (located on the source line that holds it)."""
    out: list[tuple[int, str, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], "comment", tok.string))
    lines = source.split("\n")
    tree = ast.parse(source)
    texts: list[tuple[ast.Constant, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            texts.append((node.value, "docstring"))
        elif isinstance(node, ast.Call):
            if _call_name(node) in HELP_CALLS:
                texts += [(s, "help") for a in node.args for s in _strings(a)]
            texts += [(s, "help") for k in node.keywords if k.arg in HELP_KEYWORDS for s in _strings(k.value)]
    seen: set[tuple[int, int]] = set()
    for const, kind in texts:
        if (const.lineno, const.col_offset) in seen:
            continue
        seen.add((const.lineno, const.col_offset))
        for hit in _hits(const.value):
            line = _locate(const.value, hit, lines, const)
            out.append((line, kind, lines[line - 1]))
    return out


def yaml_comments(text: str) -> list[tuple[int, str, str]]:
    """(line, "comment", text) of every YAML comment: a '#' at the start of a line or after
    whitespace, outside quotes."""
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        quote = None
        for i, ch in enumerate(line):
            if quote:
                quote = None if ch == quote else quote
            elif ch in "'\"" and (i == 0 or line[i - 1] in " \t:[{,-"):
                quote = ch
            elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
                out.append((n, "comment", line[i:]))
                break
    return out


# -- checking -------------------------------------------------------------------------------------


def _hits(text: str) -> list[int]:
    """Start offsets of the figures in ``text``."""
    return sorted({m.start() for p in PATTERNS.values() for m in p.finditer(text)})


def _allowed(rel: str, text: str) -> bool:
    return any(rel == path and needle in text for path, needle, _ in ALLOWED)


def scan_file(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    source = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        texts = [(n, kind, t) for n, kind, t in python_texts(source) if kind != "comment" or _hits(t)]
    else:
        texts = [(n, kind, t) for n, kind, t in yaml_comments(source) if _hits(t)]
    lines = source.split("\n")
    found = []
    for n, _, _ in texts:
        line = lines[n - 1].strip()
        if not _allowed(rel, line):
            found.append(f"{rel}:{n}: {line}")
    return sorted(set(found), key=lambda s: (s.split(":")[0], int(s.split(":")[1])))


def scanned_files() -> list[Path]:
    files = sorted((ROOT / "platform" / "qrag").rglob("*.py"))
    files += [f for d in ("serve", "tune", "jobs", "infra") for f in sorted((ROOT / d).glob("*.py"))]
    files += sorted((ROOT / "configs").glob("*.yaml")) + [ROOT / "serve" / "config.yaml"]
    files += sorted((ROOT / "tune").glob("*.yaml")) + sorted((ROOT / "infra").rglob("*.yaml"))
    return [f for f in files if "__pycache__" not in f.parts]


def offending_lines() -> list[str]:
    return [line for f in scanned_files() for line in scan_file(f)]


# -- tests ----------------------------------------------------------------------------------------


def test_no_measured_figures_in_code_and_config():
    found = offending_lines()
    assert not found, (
        f"{len(found)} lines carry measured figures; say why in a sentence and link "
        "docs/benchmarks.md once (or add a setting to ALLOWED with its reason):\n" + "\n".join(found)
    )


def test_allow_list_entries_still_match():
    """An allow-list entry whose line is gone is removed, so the list stays short."""
    stale = []
    for path, needle, _ in ALLOWED:
        f = ROOT / path
        if not f.exists() or needle not in f.read_text(encoding="utf-8"):
            stale.append(f"{path}: {needle!r}")
    assert not stale, "allow-list entries that match nothing:\n" + "\n".join(stale)


PLANTED_PY = '''"""A module."""
from qrag.config import opt

# three lanes a GPU, round 9
x = 1


def f(p):
    """Pick the lanes."""
    p.add_argument("--lanes", help="lanes per GPU: "
                   "3.2M tokens/s on an H100")
    y = opt(3, "Lanes.")
    return "round 9 in a plain string is behaviour, not documentation"
'''


def test_check_catches_planted_figures(tmp_path):
    texts = [(n, kind) for n, kind, t in python_texts(PLANTED_PY) if kind != "comment" or _hits(t)]
    assert (4, "comment") in texts, texts
    assert (11, "help") in texts, texts
    assert all(n in (4, 11) for n, _ in texts), texts
    assert _hits("0.50–0.61 in 9 of 10 runs") and _hits("×1.6") and _hits("1.6x faster than one process")
    assert _hits("734 q/s, p50 7.9 ms") and _hits("see bench/results/index_one_gpu_round12_h100")
    assert (
        _hits("one GPU's encoder took 41 s")
        and _hits("scored 0.86 -> 0.68 val Fact EM")
        and _hits("Mean Fact EM at 1M: 100")
    )
    assert _hits("0.35 of the bare forward against 0.50") and _hits("was 4 % of a worker's time")
    assert not _hits("three lanes a GPU: one process's GIL cannot keep a GPU fed; docs/benchmarks.md#indexing")
    assert not _hits("request_timeout_s: 60") and not _hits("T = 2 steps, top-k 5, chunk_tokens 220")
    yaml = "a: 1  # 7.9 ms p50\nb: '#not a comment'\n# rounds 5-8\nc: 2 # a setting\n"
    assert [n for n, _, t in yaml_comments(yaml) if _hits(t)] == [1, 3]


if __name__ == "__main__":
    lines = offending_lines()
    print("\n".join(lines))
    print(f"{len(lines)} lines", file=sys.stderr)
    sys.exit(1 if lines else 0)
