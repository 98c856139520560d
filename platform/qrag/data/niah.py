"""RULER needle-in-a-haystack tasks (paper Table 1), generated at any length.

Task definitions follow RULER's ``synthetic.yaml`` (our own code):

| task              | paper | haystack | key   | value  | needles                                 |
| ----------------- | ----- | -------- | ----- | ------ | --------------------------------------- |
| niah_single_1     | S1    | noise    | words | number | 1                                       |
| niah_single_2     | S2    | essay    | words | number | 1                                       |
| niah_single_3     | S3    | essay    | words | uuid   | 1                                       |
| niah_multikey_1   | MK1   | essay    | words | number | 4 keys, 1 asked (3 distractor needles)  |
| niah_multikey_2   | MK2   | needles  | words | number | 1 asked; the haystack is other needles  |
| niah_multikey_3   | MK3   | needles  | uuid  | uuid   | 1 asked; the haystack is other needles  |
| niah_multivalue   | MV    | essay    | words | number | 1 key with 4 values (4 needles)         |
| niah_multiquery   | MQ    | essay    | words | number | 4 keys, all 4 asked                     |

A needle is ``One of the special magic {numbers|uuids} for {key} is: {value}.``; the question is
``What are all the special magic {numbers|uuids} for {key(s)} mentioned in the provided text?``
and the answer the asked values. Word keys are ``adjective-noun``, numbers have 7 digits,
uuids are random version-4 UUIDs. Needles go, in random order, to uniformly random chunk
boundaries; every needle (asked or not, haystack needles too) is its own chunk, and the support
is the chunks of the asked needles.

Haystacks: ``noise`` repeats RULER's fixed sentences; ``essay`` is Paul Graham's essays
(``data.path``, default ``paul_graham_essays/PaulGrahamEssays.json.gz``; a ``{"text": ...}``
JSON or plain text), repeated past its end as RULER does; ``needles`` is a pool of
distractor needles per split whose keys never collide with asked keys. As in RULER, the text of
the noise and essay haystacks is shared by train and dev: the splits differ in their needles
(keys and values are drawn from different seeds).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qrag.config import DataConfig
from qrag.data import register_loader
from qrag.data.chunking import TokenCounter
from qrag.data.contexts import Generated, assemble, fresh_ids, interleave, rng_for
from qrag.data.haystack import Haystack, Measure, cached_haystack
from qrag.data.niah_words import ADJECTIVES, NOUNS
from qrag.data.paths import data_root, open_text
from qrag.data.sample import DataError, Sample
from qrag.data.splits import in_validation

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
QUESTION = "What are all the special magic {kind} for {query} mentioned in the provided text?"
DEFAULT_ESSAYS = "paul_graham_essays/PaulGrahamEssays.json.gz"


@dataclass(frozen=True)
class NiahTask:
    haystack: str  # noise | essay | needles
    key_type: str  # words | uuids
    value_type: str  # numbers | uuids
    keys: int = 1
    values: int = 1
    queries: int = 1


TASKS: dict[str, NiahTask] = {
    "niah_single_1": NiahTask("noise", "words", "numbers"),
    "niah_single_2": NiahTask("essay", "words", "numbers"),
    "niah_single_3": NiahTask("essay", "words", "uuids"),
    "niah_multikey_1": NiahTask("essay", "words", "numbers", keys=4),
    "niah_multikey_2": NiahTask("needles", "words", "numbers"),
    "niah_multikey_3": NiahTask("needles", "uuids", "uuids"),
    "niah_multivalue": NiahTask("essay", "words", "numbers", values=4),
    "niah_multiquery": NiahTask("essay", "words", "numbers", queries=4),
}
ALIASES = {
    "s1": "niah_single_1",
    "s2": "niah_single_2",
    "s3": "niah_single_3",
    "mk1": "niah_multikey_1",
    "mk2": "niah_multikey_2",
    "mk3": "niah_multikey_3",
    "mv": "niah_multivalue",
    "mq": "niah_multiquery",
}
SHORT_NAMES = {v: k.upper() for k, v in ALIASES.items()}


def task_spec(name: str) -> tuple[str, NiahTask]:
    full = ALIASES.get(name.lower(), name)
    if full not in TASKS:
        raise DataError(
            f"unknown NIAH task {name!r} (choose from {', '.join(TASKS)} or {', '.join(k.upper() for k in ALIASES)})"
        )
    return full, TASKS[full]


def asked_needles(name: str) -> int:
    """Needles a question of the task asks for (1 for S1-S3 and MK1-MK3, 4 for MV and MQ): the
    task's T with no spare picks. A property of the task's definition, not of a sample's answer key."""
    spec = task_spec(name)[1]
    return spec.values * spec.queries


# -- keys and values --------------------------------------------------------------------------

N_WORD_KEYS = len(ADJECTIVES) * len(NOUNS)


def word_key(index: int) -> str:
    return f"{ADJECTIVES[index // len(NOUNS)]}-{NOUNS[index % len(NOUNS)]}"


def _is_asked_space(index: np.ndarray) -> np.ndarray:
    # A quarter of the word keys may be asked; haystack needles use the rest, so they never collide.
    return index % 4 == 0


def draw_keys(rng: np.random.Generator, key_type: str, n: int, asked: bool) -> list[str]:
    if key_type == "uuids":
        return [str(uuid.UUID(int=int.from_bytes(rng.bytes(16), "big"), version=4)) for _ in range(n)]
    space = np.arange(N_WORD_KEYS)
    space = space[_is_asked_space(space) == asked]
    if n > len(space):
        raise DataError(f"NIAH: {n} distinct word keys requested, only {len(space)} exist")
    return [word_key(int(i)) for i in rng.choice(space, size=n, replace=False)]


def draw_values(rng: np.random.Generator, value_type: str, n: int) -> list[str]:
    if value_type == "uuids":
        return [str(uuid.UUID(int=int.from_bytes(rng.bytes(16), "big"), version=4)) for _ in range(n)]
    return [str(v) for v in rng.integers(1_000_000, 10_000_000, size=n)]


def near_miss(rng: np.random.Generator, key: str, key_type: str) -> str:
    """A key that differs a little from ``key``: a uuid with 2-8 of its hex digits changed, or a
    word key with its adjective or its noun swapped. A long haystack holds such keys by its size
    (at 1M tokens some of ~20K uuids share long runs of digits with the asked one); a 2K-token
    training context almost never does, so training sees them only when they are put in."""
    if key_type == "uuids":
        chars = list(key)
        hexes = [
            i for i, c in enumerate(chars) if c != "-" and i not in (14, 19)
        ]  # version and variant digits stay valid
        for i in rng.choice(hexes, size=int(rng.integers(2, 9)), replace=False):
            chars[i] = "0123456789abcdef"[(int(chars[i], 16) + int(rng.integers(1, 16))) % 16]
        return "".join(chars)
    adjective, noun = key.split("-", 1)
    if rng.random() < 0.5:
        return (
            f"{ADJECTIVES[(ADJECTIVES.index(adjective) + int(rng.integers(1, len(ADJECTIVES)))) % len(ADJECTIVES)]}"
            f"-{noun}"
        )
    return f"{adjective}-{NOUNS[(NOUNS.index(noun) + int(rng.integers(1, len(NOUNS)))) % len(NOUNS)]}"


def needle(kind: str, key: str, value: str) -> str:
    return NEEDLE.format(kind=kind, key=key, value=value)


def query_text(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


# -- haystacks --------------------------------------------------------------------------------


def default_essays() -> Path:
    return data_root() / DEFAULT_ESSAYS


def read_essays(path: str | Path | None) -> str:
    p = Path(path) if path else default_essays()
    if not p.is_file():
        raise DataError(f"NIAH essay haystack not found: {p} (set data.path)")
    try:
        with open_text(p) as fh:
            raw = fh.read()
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise DataError(f"{p}: cannot read: {exc}") from None
    if p.name.endswith((".json", ".json.gz")):
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise DataError(f"{p}: malformed JSON at line {exc.lineno}: {exc.msg}") from None
        if not isinstance(data, dict) or not isinstance(data.get("text"), str):
            raise DataError(f'{p}: expected a JSON object {{"text": "..."}} (RULER\'s PaulGrahamEssays.json)')
        raw = data["text"]
    if not raw.strip():
        raise DataError(f"{p}: empty essay text")
    return raw


def haystack_for(
    spec: NiahTask, split: str, length: int, measure: Measure, budget: int, seed: int, essays: str | Path | None
) -> Haystack:
    if spec.haystack == "noise":
        # Enough repetitions that packing settles into its period; windows wrap around it.
        return cached_haystack(
            ("niah-noise", budget),
            measure,
            lambda: Haystack.build("niah-noise", [" ".join([NOISE] * 64)], budget, measure),
        )
    if spec.haystack == "essay":
        path = str(Path(essays) if essays else default_essays())
        return cached_haystack(
            ("niah-essay", path, budget),
            measure,
            lambda: Haystack.build("niah-essay", [read_essays(path)], budget, measure),
        )
    # A pool of distractor needles, one per chunk, sized for the context (a power of two).
    per_needle = 16 if spec.key_type == "words" else 48  # fewer tokens than a needle really has
    size = 1 << max(10, int(np.ceil(np.log2(max(1, length) / per_needle + 1))))
    if spec.key_type == "words":
        size = min(size, N_WORD_KEYS - N_WORD_KEYS // 4)
    kind = spec.value_type

    def build() -> Haystack:
        rng = rng_for("niah-pool", seed, split, spec.key_type, spec.value_type, size)
        keys = draw_keys(rng, spec.key_type, size, asked=False)
        values = draw_values(rng, spec.value_type, size)
        text = [needle(kind, k, v) for k, v in zip(keys, values)]
        return Haystack.build(
            f"niah-needles-{split}-{spec.key_type}-{spec.value_type}-{size}",
            [text],
            budget,
            measure,
            standalone=True,
            split=lambda doc: list(doc),
        )

    return cached_haystack(("niah-needles", split, spec.key_type, spec.value_type, size, seed), measure, build)


# -- generation -------------------------------------------------------------------------------


def generate_niah(
    task: str,
    split: str,
    length: int,
    n: int,
    measure: Measure,
    *,
    seed: int = 0,
    budget: int = 64,
    essays: str | Path | None = None,
    near_misses: int = 0,
    val_fraction: float = 0.0,
    skip: Callable[[str], bool] | None = None,
) -> Iterator[Generated]:
    """``n`` samples of one RULER NIAH task at ``length`` tokens, one at a time. ``near_misses``:
    that many extra distractor needles per sample whose keys are near misses of an asked key
    (:func:`near_miss`; training hard negatives, recorded in ``meta['near_misses']``), except in the
    samples ``val_fraction`` holds out of train (validation contexts are never training contexts).
    ``skip``: samples whose id it accepts are left out before anything of them is built (a
    validation draw keeps a few samples of many; each sample's draws are its own, so leaving one
    out changes no other)."""
    name, spec = task_spec(task)
    if length <= 0:
        raise DataError(f"niah: context length must be positive, got {length}")
    hay = haystack_for(spec, split, length, measure, budget, seed, essays)
    n_keys = max(spec.keys, spec.queries)
    for i in range(n):
        sample_id = f"niah-{name}-{split}-{length}-{i}"
        if skip is not None and skip(sample_id):
            continue
        misses = 0 if in_validation(sample_id, val_fraction) else near_misses
        rng = rng_for("niah", seed, name, split, length, i)
        keys = draw_keys(rng, spec.key_type, n_keys, asked=True)
        asked = keys[: spec.queries]
        needles: list[tuple[str, str]] = []  # (key, text)
        answers: list[str] = []
        for key in keys:
            for value in draw_values(rng, spec.value_type, spec.values):
                needles.append((key, needle(spec.value_type, key, value)))
                if key in asked:
                    answers.append(value)
        for _ in range(misses):
            key = near_miss(rng, asked[int(rng.integers(len(asked)))], spec.key_type)
            if key not in keys:
                needles.append((key, needle(spec.value_type, key, draw_values(rng, spec.value_type, 1)[0])))
        order = rng.permutation(len(needles))
        needles = [needles[j] for j in order]
        texts = [t for _, t in needles]
        counts, ids = measure.measure(texts)  # each needle tokenised once: counts fit it, ids feed evaluation
        needle_tokens = int(counts.sum())
        if needle_tokens > length:
            raise DataError(f"niah {name}: the needles alone ({needle_tokens} tokens) exceed {length} tokens")
        window = hay.window(rng, length - needle_tokens)
        chunks, refs, pos = assemble(hay, window, texts, rng)
        fresh = fresh_ids(hay, window, refs, ids)
        support = sorted(int(pos[j]) for j, (key, _) in enumerate(needles) if key in asked)
        sample = Sample(
            id=sample_id,
            question=QUESTION.format(kind=spec.value_type, query=query_text(asked)),
            chunks=chunks,
            support=support,
            answer=", ".join(answers),
            meta={
                "task": name,
                "context_tokens": window.tokens + needle_tokens,
                "target_tokens": length,
                "needles": len(needles),
                "background": hay.name,
                "answers": answers,
                **({"near_misses": misses} if misses else {}),
            },
        )
        yield Generated(sample, hay, refs, fresh)


def _tasks(cfg: DataConfig) -> list[str]:
    return [task_spec(t)[0] for t in cfg.tasks] if cfg.tasks else list(TASKS)


def near_misses_for(cfg: DataConfig, split: str, task: str) -> int:
    """Near-miss needles per training context of ``task``: ``data.hard_negatives`` where the
    haystack is made of needles (niah_multikey_2/3), else none. Only a needle haystack holds
    near misses at long lengths; in the essay and noise tasks they would only teach what no test
    context asks, and on the validation split at 1M they cost niah_multiquery its questions
    (measured: docs/benchmarks.md, "Quality: BabiLong and RULER NIAH")."""
    if split != "train":
        return 0
    return cfg.hard_negatives if task_spec(task)[1].haystack == "needles" else 0


def generate_from_config(
    cfg: DataConfig, split: str, measure: Measure, length: int | None = None, n: int | None = None
) -> list[Generated]:
    from qrag.data.babilong import samples_for_split

    count = n if n is not None else samples_for_split(cfg, split)
    per_task = [
        list(
            generate_niah(
                t,
                split,
                length or cfg.context_tokens,
                count,
                measure,
                seed=cfg.seed,
                budget=cfg.chunk_tokens,
                essays=cfg.path,
                near_misses=near_misses_for(cfg, split, t),
                val_fraction=cfg.val_fraction,
            )
        )
        for t in _tasks(cfg)
    ]
    return interleave(per_task)


@register_loader("niah")
def load_niah(cfg: DataConfig, split: str, count: TokenCounter) -> list[Sample]:
    samples = [g.sample for g in generate_from_config(cfg, split, Measure(count))]
    return samples[: cfg.limit] if cfg.limit is not None else samples
