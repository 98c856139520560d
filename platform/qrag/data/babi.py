"""bAbI v1.2 tasks in their original text format (the facts BabiLong hides in book text).

A file is a sequence of stories; a story restarts when the line number goes back to 1.
Fact lines are ``<n> <sentence>``; question lines are ``<n> <question>\\t<answer>\\t<support line numbers>``.
Each question becomes one :class:`BabiQuestion` whose ``facts`` are the story's fact sentences
before it (question lines are not facts) and whose ``support`` indexes into ``facts``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from qrag.data.paths import data_root, open_text
from qrag.data.sample import DataError

DEFAULT_DIR = "babi/tasks_1-20_v1-2"
# Prefer the 10k version; fall back to the 1k one (en-10k lacks qa3 train in shared/data).
VARIANTS = ("en-10k", "en")
# bAbI's own file names call the held-out part "test"; our "dev" split reads it.
FILE_SPLITS = {"train": ("train",), "dev": ("test",), "test": ("test",), "all": ("train", "test")}
_TASK = re.compile(r"^qa(\d+)$")


@dataclass(frozen=True)
class BabiQuestion:
    task: str  # qa1 .. qa20
    id: str  # "<task>-<file split>-<question number in file>"
    facts: tuple[str, ...]  # story facts before the question, in story order
    question: str
    answer: str
    support: tuple[int, ...]  # indices into ``facts``, ascending
    # "<task>-<file split>-story<k>": every question of one story shares its facts, so held-out
    # splits are drawn by story (a question whose story is trained on is not held out).
    story: str = ""

    @property
    def source(self) -> str:
        """What decides a question's side in a held-out split: its story (its own id without one)."""
        return self.story or self.id


def default_dir() -> Path:
    return data_root() / DEFAULT_DIR


def task_file(root: str | Path | None, task: str, file_split: str) -> Path:
    """``<root>/<en-10k|en>/qaN_<name>_<train|test>.txt[.gz]``, the 10k version when present."""
    if not _TASK.match(task):
        raise DataError(f"unknown bAbI task {task!r} (expected qa1 .. qa20)")
    root = Path(root) if root else default_dir()
    if not root.is_dir():
        raise DataError(f"bAbI folder not found: {root} (set data.facts_path)")
    for variant in VARIANTS:
        for suffix in (".txt.gz", ".txt"):
            hits = sorted((root / variant).glob(f"{task}_*_{file_split}{suffix}"))
            if hits:
                return hits[0]
    raise DataError(f"{root}: no {task} {file_split} file in {' or '.join(VARIANTS)}/")


def parse_babi(path: Path, task: str, file_split: str = "test") -> list[BabiQuestion]:
    """Every question of one bAbI file; a malformed line is an error naming file and line."""
    questions: list[BabiQuestion] = []
    facts: list[str] = []
    line_to_fact: dict[int, int] = {}
    last = 0
    stories = 0
    try:
        with open_text(path) as fh:
            for lineno, raw in enumerate(fh, 1):
                line = raw.rstrip("\n")
                if not line.strip():
                    continue
                where = f"{path}: line {lineno}"
                head, _, text = line.partition(" ")
                if not head.isdigit() or not text.strip():
                    raise DataError(f"{where}: expected '<number> <sentence>', got {line[:60]!r}")
                n = int(head)
                if n == 1 or n <= last:  # a new story
                    facts, line_to_fact = [], {}
                    stories += 1
                last = n
                if "\t" not in text:
                    line_to_fact[n] = len(facts)
                    facts.append(text.strip())
                    continue
                parts = text.split("\t")
                if len(parts) < 3 or not parts[1].strip():
                    raise DataError(f"{where}: a question line needs '<question>\\t<answer>\\t<support lines>'")
                try:
                    lines = [int(x) for x in parts[2].split()]
                except ValueError:
                    raise DataError(f"{where}: support {parts[2]!r} is not a list of line numbers") from None
                missing = [x for x in lines if x not in line_to_fact]
                if not lines or missing:
                    raise DataError(
                        f"{where}: support line {missing[0] if missing else '(none)'} is not a fact of this story"
                    )
                support = tuple(sorted({line_to_fact[x] for x in lines}))
                questions.append(
                    BabiQuestion(
                        task=task,
                        id=f"{task}-{file_split}-{len(questions)}",
                        facts=tuple(facts),
                        question=parts[0].strip(),
                        answer=parts[1].strip(),
                        support=support,
                        story=f"{task}-{file_split}-story{stories - 1}",
                    )
                )
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise DataError(f"{path}: cannot read: {exc}") from None
    return questions


@functools.lru_cache(maxsize=32)
def _cached(path: str, task: str, file_split: str) -> tuple[BabiQuestion, ...]:
    return tuple(parse_babi(Path(path), task, file_split))


def load_babi(root: str | Path | None, task: str, split: str) -> list[BabiQuestion]:
    """Questions of ``task`` for our split: train -> bAbI train, dev -> bAbI test, all -> both."""
    if split not in FILE_SPLITS:
        raise DataError(f"unknown split {split!r} for bAbI (choose from train, dev, all)")
    out: list[BabiQuestion] = []
    for file_split in FILE_SPLITS[split]:
        path = task_file(root, task, file_split)
        out.extend(_cached(str(path), task, file_split))
    if not out:
        raise DataError(f"bAbI {task} {split}: no questions")
    return out
