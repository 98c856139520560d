"""MuSiQue-Ans, official JSONL layout (``musique_ans_v1.0_{train,dev}.jsonl``).

A line is ``{"id", "question", "answer", "answer_aliases", "answerable",
"paragraphs": [{"idx", "title", "paragraph_text", "is_supporting"}, ...] (20 per question),
"question_decomposition": [...]}``. One chunk = one paragraph (``"title: sentences"``), cut at a
sentence boundary to the chunk budget (110 tokens in the paper, with T = 4); the support chunks
are the ``is_supporting`` paragraphs. The whole paragraph stays in ``meta["passages"]`` for the
reader, and ``answer`` plus ``answer_aliases`` in ``meta["answer_aliases"]`` for answer scoring.

Splits: the shipped data has no official dev file (see ``shared/data/musique/SOURCE.md``). With the
default path, ``train`` is the 150-question train subset and ``dev`` the 100-question MIGRES file
whose split is not stated (probably official dev): the out-of-distribution evaluation set for a
HotpotQA-trained retriever; ``all`` is both. With an explicit ``data.path`` the records are split
by a hash of their id, like every other loader. A bad line stops loading with an error naming the
file and the line. ``data.hub`` (e.g. ``dgslibisey/MuSiQue``: the official layout) reads the hub's
train and validation splits instead (:mod:`qrag.data.hf`).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from qrag.config import DataConfig
from qrag.data import register_loader
from qrag.data.chunking import TokenCounter, cap_paragraphs, split_sentences
from qrag.data.hf import record_pairs
from qrag.data.paths import data_root, note_source, read_jsonl
from qrag.data.sample import DataError, Sample
from qrag.data.splits import SPLITS, records_in_split

TRAIN_FILE = "musique/musique_ans_v1.0_train.subset150.jsonl.gz"
DEV_FILE = "musique/musique_ans_v1.0.migres100_split_unstated.jsonl.gz"


def default_files(split: str) -> list[Path]:
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r} (choose from {', '.join(SPLITS)})")
    root = data_root()
    names = {"train": [TRAIN_FILE], "dev": [DEV_FILE], "all": [TRAIN_FILE, DEV_FILE]}[split]
    return [root / name for name in names]


def _paragraphs(record: dict[str, Any], where: str) -> list[tuple[str, str]]:
    paragraphs = record.get("paragraphs")
    if not isinstance(paragraphs, list) or not paragraphs:
        raise DataError(f"{where}: no paragraphs")
    out = []
    for j, para in enumerate(paragraphs):
        if not isinstance(para, dict):
            raise DataError(f"{where}: paragraphs[{j}] is not an object")
        title, text = para.get("title", ""), para.get("paragraph_text")
        if not isinstance(title, str) or not isinstance(text, str):
            raise DataError(f"{where}: paragraphs[{j}] needs string fields 'title' and 'paragraph_text'")
        if "idx" in para and para["idx"] != j:
            # Support indices and question_decomposition refer to idx: they must be positions.
            raise DataError(f"{where}: paragraphs[{j}] has idx {para['idx']!r}; expected {j} (paragraphs in idx order)")
        if not isinstance(para.get("is_supporting"), bool):
            raise DataError(f"{where}: paragraphs[{j}] has no boolean 'is_supporting'")
        out.append((title, text))
    return out


def _aliases(record: dict[str, Any], where: str) -> list[str]:
    answer, aliases = record.get("answer"), record.get("answer_aliases", [])
    if not isinstance(answer, str) or not answer.strip():
        raise DataError(f"{where}: missing or empty field 'answer'")
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise DataError(f"{where}: 'answer_aliases' must be a list of strings")
    return [answer, *(a for a in aliases if a != answer)]


def parse_record(record: Any, where: str, budget: int, count: TokenCounter) -> Sample:
    if not isinstance(record, dict):
        raise DataError(f"{where}: a record must be a JSON object")
    for key in ("id", "question"):
        if not isinstance(record.get(key), str) or not record[key].strip():
            raise DataError(f"{where}: missing or empty field {key!r}")
    if record.get("answerable", True) is not True:
        raise DataError(
            f"{where}: 'answerable' is {record.get('answerable')!r}; "
            "this loader reads MuSiQue-Ans (answerable questions only)"
        )
    paragraphs = _paragraphs(record, where)
    support = [j for j, para in enumerate(record["paragraphs"]) if para["is_supporting"]]
    if not support:
        raise DataError(f"{where}: no paragraph has is_supporting = true")
    aliases = _aliases(record, where)
    sentences = [(title, split_sentences(text) or [text]) for title, text in paragraphs]
    sample = Sample(
        id=record["id"],
        question=record["question"].strip(),
        chunks=cap_paragraphs(sentences, budget, count),
        support=support,
        answer=aliases[0],
        meta={
            "answer_aliases": aliases,
            "titles": [title for title, _ in paragraphs],
            "passages": [f"{title}: {text}".strip() if title else text for title, text in paragraphs],
            "hops": len(support),
        },
    )
    sample.validate(where)
    return sample


def load_musique(
    path: str | Path | None,
    *,
    split: str,
    dev_fraction: float,
    budget: int,
    count: TokenCounter,
    limit: int | None = None,
    hub: str | None = None,
) -> list[Sample]:
    if path is None and hub is None:
        files, by_hash = default_files(split), False
        for file in files:
            if not file.is_file():
                raise DataError(f"{file}: no such file (set data.path or QRAG_DATA_DIR)")
            note_source(file)
        pairs = (pair for file in files for pair in _lines(file))
    else:
        pairs, by_hash = record_pairs(path or "", hub, split, _lines)
    in_split = records_in_split(pairs, "id", split, dev_fraction, by_hash=by_hash)
    return list(itertools.islice((parse_record(record, where, budget, count) for where, record in in_split), limit))


def _lines(file: Path):
    return ((f"{file}: line {lineno}", record) for lineno, record in read_jsonl(file))


@register_loader("musique")
def _musique(cfg: DataConfig, split: str, count: TokenCounter) -> list[Sample]:
    return load_musique(
        cfg.path,
        split=split,
        dev_fraction=cfg.dev_fraction,
        budget=cfg.chunk_tokens,
        count=count,
        limit=cfg.limit,
        hub=cfg.hub,
    )
