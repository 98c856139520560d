"""Evaluation: run the search over samples and score the retrieved chunks."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qrag.config import DataConfig, SearchConfig, to_dict
from qrag.data.chunking import TokenCounter
from qrag.data.sample import DataError, Sample
from qrag.data.credit import fact_picks, support_classes
from qrag.evaluation.early_stopping import Trace
from qrag.metrics import fact_em, fact_f1, mean
from qrag.retrieval.multistep import Retrieval
from qrag.retrieval.search import Retriever
from qrag.data.tokens import TokenizedSample


@dataclass
class EvalResult:
    summary: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)

    def write(self, path: str | Path, with_records: bool = True) -> None:
        """The summary as JSON; per-question records beside it as ``<name>.records.jsonl``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.summary, indent=2) + "\n")
        if with_records:
            with open(path.with_suffix(".records.jsonl"), "w") as fh:
                for rec in self.records:
                    fh.write(json.dumps(rec) + "\n")


def score_retrievals(
    samples: Sequence[Sample], retrievals: Sequence[Retrieval], credit: str = "chunk"
) -> list[dict[str, Any]]:
    """Per-question records. ``fact_em``/``fact_f1``: every pick of the run (no oracle: the
    headline); ``oracle_fact_*``: the picks up to the one that completes the support (a search
    stopped by the answer key, as the reference's environment does; comparable with the paper's
    tables). ``fact_picks``/``n_facts`` put the picks in fact space under the credit rule
    (:mod:`qrag.data.credit`) for later re-scoring (learned Q-threshold stops)."""
    records = []
    for sample, ret in zip(samples, retrievals):
        selected = ret.selected
        classes, n_facts = support_classes(sample.chunks, sample.support, credit)
        picks = fact_picks(classes, selected)
        facts = range(n_facts)
        complete = Trace(sample.id, tuple(facts), tuple(picks), ()).t_earliest  # picks that complete the support
        oracle = picks[:complete] if complete is not None else picks
        records.append(
            {
                "id": sample.id,
                "question": sample.question,
                "gold": list(sample.support),
                "retrieved": selected,
                "q_values": [round(s.q, 5) for s in ret.steps],
                "steps": len(selected),
                "stopped_early": ret.stopped_early,
                "credit": credit,
                "n_facts": n_facts,
                "fact_picks": picks,
                "complete_at": complete,
                "fact_em": fact_em(facts, picks),
                "fact_f1": fact_f1(facts, picks),
                "oracle_fact_em": fact_em(facts, oracle),
                "oracle_fact_f1": fact_f1(facts, oracle),
                "answer": sample.answer,
            }
        )
    return records


PROTOCOL_KEYS = ("fact_em", "fact_f1", "oracle_fact_em", "oracle_fact_f1")
# What each protocol's search did, said beside every table (qrag report, qrag sweep-lengths),
# the headline first.
PROTOCOL_NOTES = {
    "fact_em": "all T picks, no oracle: every support fact among them (the headline)",
    "oracle_fact_f1": "search stopped once the support is complete "
    "(oracle stop: the answer key decides; the reference's protocol)",
    "threshold_fact_f1": "learned stop: search stopped when the best Q falls below a threshold "
    "chosen on validation questions (no oracle)",
    "fact_f1": "all T picks, no stop, no oracle",
}


def protocol_means(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Means of the per-question metrics of every evaluation protocol."""
    return {key: mean([r[key] for r in records]) for key in PROTOCOL_KEYS}


def evaluate(
    retriever: Retriever,
    samples: Sequence[Sample],
    tokenized: Sequence[TokenizedSample],
    cfg: SearchConfig,
    extra: dict[str, Any] | None = None,
    credit: str = "chunk",
) -> EvalResult:
    t0 = time.perf_counter()
    retrievals = retriever.retrieve(tokenized, cfg)
    seconds = time.perf_counter() - t0
    records = score_retrievals(samples, retrievals, credit)
    summary = {
        **protocol_means(records),
        "credit": credit,
        "stop": "threshold" if cfg.stop_threshold is not None else "none",
        "num_samples": len(records),
        "avg_steps": mean([r["steps"] for r in records]),
        "seconds": seconds,
        "seconds_per_question": seconds / max(1, len(records)),
        "search": to_dict(cfg),
        **(extra or {}),
    }
    return EvalResult(summary, records)


def evaluate_checkpoint(
    checkpoint: str,
    cfg=None,
    overrides: list[str] | None = None,
    *,
    split: str = "dev",
    limit: int | None = None,
    device: str = "auto",
    out: str | Path | None = None,
    answer: str | None = None,
    data: str | None = None,
    dataset: str | None = None,
    allow_train_questions: bool = False,
    label: str | None = None,
) -> dict[str, Any]:
    """Evaluate a checkpoint directory, or the untrained encoder: ``"none"`` scores with its own
    similarity, the full-vector cosine of the pooled embeddings (the paper's "multi-step RAG w/o
    FT"); ``"none:twin"`` with the mean of two half-vector cosines (a labelled extra).

    Without ``cfg`` the run's own config (saved in the checkpoint) is used, with ``overrides``
    applied: the data, chunking and search of training unless told otherwise. ``data`` and
    ``dataset`` (``qrag eval --data/--dataset``) choose the data for any checkpoint
    (:func:`qrag.evaluation.eval_data.eval_data_config`). Questions from sources the checkpoint
    trained on are refused unless ``allow_train_questions`` (:mod:`qrag.evaluation.trained`); the
    summary's ``train_questions`` records the check. ``answer`` (none | local | openai; default
    ``cfg.answer.backend``) also has a reader LLM answer from the retrieved chunks: the summary
    gains ``ans_em``, ``ans_f1``, ``answer_errors``, ``reader_model``. ``label`` names the method in
    the summary (a Table 3 row, say; default: the untrained baseline's name, else none).
    """
    from dataclasses import replace

    from qrag.evaluation.eval_data import eval_data_config
    from qrag.evaluation.trained import Guard
    from qrag.model.checkpoint import baseline_label, baseline_qnet, is_untrained, load_qnet
    from qrag.config import apply_overrides, from_dict, TrainConfig
    from qrag.data.chunking import tokenizer_counter
    from qrag.model.encoder import pick_device
    from qrag.data.tokens import tokenize_samples
    from qrag.integrations.provenance import git_fields

    dev = pick_device(device)
    if is_untrained(checkpoint):
        if cfg is None:
            raise ValueError("evaluating the untrained encoder needs a config")
        qnet, tokenizer, layout = baseline_qnet(cfg.model, dev, checkpoint)
        trained_on, run_cfg = None, None
        label = label or baseline_label(qnet.cfg.similarity)
    else:
        qnet, tokenizer, layout, run_cfg = load_qnet(checkpoint, dev, with_targets=False)
        if cfg is None:
            cfg = from_dict(TrainConfig, apply_overrides(to_dict(run_cfg), overrides or []))
        trained_on = run_cfg.data.dataset
    cfg = replace(cfg, data=eval_data_config(cfg.data, data, dataset))
    samples = split_samples(cfg.data, split, tokenizer_counter(tokenizer))
    if limit is not None:
        samples = samples[:limit]
    guard = Guard(checkpoint, allow_train_questions)
    guard.check(samples)
    tokenized = tokenize_samples(
        samples, tokenizer, layout, chunk_tokens=cfg.data.chunk_tokens, question_tokens=cfg.data.question_tokens
    )
    retriever = Retriever(qnet, layout, dev, cfg.learner.encode_tokens)
    result = evaluate(
        retriever,
        samples,
        tokenized,
        cfg.search,
        extra={
            "checkpoint": checkpoint,
            "dataset": cfg.data.dataset,
            "split": split,
            "device": str(dev),
            "data": {"path": cfg.data.path, "hub": cfg.data.hub, "sources": cfg.data.sources},
            "train_questions": guard.record(),
            "positions": qnet.cfg.positions,
            "similarity": qnet.cfg.similarity,
            "train_dataset": trained_on,
            "objective": run_cfg.learner.objective if run_cfg else None,
            **({"label": label} if label else {}),
            "selected_on": checkpoint_selection(checkpoint, run_cfg),
            **git_fields(),
        },
    )
    backend = answer or cfg.answer.backend
    if backend != "none":
        _answer(result, samples, cfg, backend)
    if out:
        result.write(out)
    return result.summary


def split_samples(data_cfg: DataConfig, split: str, count: TokenCounter) -> list[Sample]:
    """``split`` (train | dev | all) of the data, or ``val``: the validation part of train that a
    run trained with this data held out (``data.val_fraction``, drawn by source as training draws it),
    the split that a choice among checkpoints, settings or objectives is made on."""
    from qrag.data import load_samples
    from qrag.data.splits import split_validation

    if split != "val":
        return load_samples(data_cfg, split, count)
    if not data_cfg.val_fraction:
        raise DataError("split val: data.val_fraction is 0, so no validation part of train is held out")
    val = split_validation(load_samples(data_cfg, "train", count), data_cfg.val_fraction)[1]
    if not val:
        raise DataError(
            f"split val: no train record falls in the validation part (data.val_fraction={data_cfg.val_fraction})"
        )
    return val


def checkpoint_selection(checkpoint: str, run_cfg) -> str:
    """What the evaluated checkpoint (``run_cfg`` None: the untrained encoder) was chosen on, from
    where it lies in its run (``best/``: keep_best's choice on the run's periodic evaluation split;
    ``final/``: the run's end; a periodic ``update_N``: given, its choice not known here)."""
    if run_cfg is None:
        return "nothing: the untrained encoder"
    name = Path(checkpoint.rstrip("/")).name
    if name == "best":
        split = (
            f"the validation part of train (data.val_fraction={run_cfg.data.val_fraction}, held out by source)"
            if run_cfg.data.val_fraction
            else "the dev split (data.val_fraction=0: optimistic)"
        )
        return (
            f"checkpoint: keep_best's, the best periodic Fact F1 on {split} (ties: Fact EM); "
            "dev: never used for choosing"
        )
    if name == "final":
        return "checkpoint: the run's last (no choice among checkpoints)"
    return f"checkpoint: {name}, given (what chose it is not recorded in it)"


class ReaderHook:
    """A reader LLM (loaded once) that answers eval records from their retrieved chunks and scores
    each answer by its benchmark's own rule (:func:`qrag.metrics.score_answer`: RULER's share of
    needle values found for NIAH, BabiLong's label match, HotpotQA's EM/F1 elsewhere)."""

    def __init__(self, cfg, backend: str):
        from qrag.answers.backends import make_answerer

        self.cfg = cfg  # an AnswerConfig
        self.backend = backend
        self.answerer = make_answerer(cfg, backend)
        self._templates: dict[str, Any] = {}

    def template(self, dataset: str):
        from qrag.answers.reader import load_prompt

        if dataset not in self._templates:
            self._templates[dataset] = load_prompt(self.cfg.prompt, dataset)
        return self._templates[dataset]

    def __call__(self, records: list[dict[str, Any]], samples: Sequence[Sample], dataset: str) -> dict[str, Any]:
        """Answer ``records`` (of ``samples``) in place; returns the summary fields (ans_em, ...)."""
        from qrag.answers.reader import answer_records, attach_reader_inputs

        template = self.template(dataset)
        attach_reader_inputs(records, samples, self.cfg.full_passages)
        return answer_records(records, self.answerer, template, dataset)


def _answer(result: EvalResult, samples: Sequence[Sample], cfg, backend: str) -> None:
    """Have the reader answer from each question's retrieved chunks; scores go into the records
    and the summary (questions whose request failed are counted, not scored)."""
    from qrag.answers.reader import load_prompt, public_config

    load_prompt(cfg.answer.prompt, cfg.data.dataset)  # a bad prompt fails before the reader loads
    reader = ReaderHook(cfg.answer, backend)
    t0 = time.perf_counter()
    result.summary.update(reader(result.records, samples, cfg.data.dataset))
    result.summary["answer_seconds"] = time.perf_counter() - t0
    result.summary["answer"] = public_config(cfg.answer, backend)
