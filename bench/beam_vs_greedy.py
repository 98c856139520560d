"""Greedy vs beam search over Q on the validation part of train (no training, no Ray).

Takes a trained checkpoint and evaluates, on the questions its run held out of training
(``data.val_fraction`` of the train split: never trained on, never the reported dev split),
greedy search and beam search with every path-scoring rule of ``qrag.retrieval.multistep.BEAM_SCORES`` at each
width. All searches embed the same chunks; only the search differs.

    python bench/beam_vs_greedy.py --checkpoint /tmp/beamrun/smoke/final --out bench/results/beam_vs_greedy_cpu.json
    python bench/beam_vs_greedy.py --checkpoint runs/hotpot/best --widths 2,4,8 --out $OUT/beam_vs_greedy_h100.json

A checkpoint trained with ``data.val_fraction: 0`` has no held-out part of train and is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from bench_common import machine_info, write_result  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="a trained checkpoint directory")
    ap.add_argument("--widths", default="2,4", help="beam widths, comma-separated (default 2,4)")
    ap.add_argument(
        "--rules", default="", help="path-scoring rules (default: every rule in qrag.retrieval.multistep.BEAM_SCORES)"
    )
    ap.add_argument("--steps", type=int, help="retrieval steps T (default: the run's search.max_steps)")
    ap.add_argument("--limit", type=int, help="use the first N validation questions")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", help="write the result JSON here (e.g. bench/results/beam_vs_greedy_cpu.json)")
    return ap.parse_args(argv)


def validation_part(cfg, tokenizer):
    """The held-out part of train the run never trained on."""
    from qrag.data import load_samples
    from qrag.data.chunking import tokenizer_counter
    from qrag.data.splits import split_validation

    if cfg.data.val_fraction <= 0:
        raise SystemExit(
            "the checkpoint's run trained on all of train (data.val_fraction=0): no validation part to compare on"
        )
    return split_validation(load_samples(cfg.data, "train", tokenizer_counter(tokenizer)), cfg.data.val_fraction)[1]


def memo_retriever(qnet, layout, dev, encode_tokens: int):
    """A Retriever that embeds each distinct state and chunk once over all the searches compared
    (they differ only in which paths they follow): the comparison costs little more than one run."""
    import torch

    from qrag.retrieval.search import Retriever

    class MemoRetriever(Retriever):
        cache: dict[tuple[str, bytes], torch.Tensor] = {}

        def _encode(self, model, seqs, kind):
            keys = [(kind, s.tobytes()) for s in seqs]
            missing = [i for i, k in enumerate(keys) if k not in self.cache]
            if missing:
                fresh = super()._encode(model, [seqs[i] for i in missing], kind)
                self.cache.update((keys[i], v) for i, v in zip(missing, fresh))
            if not keys:
                return super()._encode(model, seqs, kind)
            return torch.stack([self.cache[k] for k in keys])

    return MemoRetriever(qnet, layout, dev, encode_tokens)


def compare(
    checkpoint: str, widths: list[int], rules: list[str], steps: int | None, limit: int | None, device: str
) -> dict:
    from qrag.model.checkpoint import load_qnet
    from qrag.model.encoder import pick_device
    from qrag.evaluation.evaluate import evaluate
    from qrag.retrieval.multistep import BEAM_SCORES
    from qrag.data.tokens import tokenize_samples

    dev = pick_device(device)
    qnet, tokenizer, layout, cfg = load_qnet(checkpoint, dev, with_targets=False)
    samples = validation_part(cfg, tokenizer)[:limit]
    tokenized = tokenize_samples(
        samples, tokenizer, layout, chunk_tokens=cfg.data.chunk_tokens, question_tokens=cfg.data.question_tokens
    )
    retriever = memo_retriever(qnet, layout, dev, cfg.learner.encode_tokens)
    base = dataclasses.replace(cfg.search, stop_threshold=None, max_steps=steps or cfg.search.max_steps)
    runs: dict[str, dict] = {}
    greedy = evaluate(retriever, samples, tokenized, dataclasses.replace(base, beam_width=1))
    runs["greedy"] = _row(greedy.summary)
    per_question: dict[str, list[float]] = {"greedy": [r["fact_em"] for r in greedy.records]}
    for rule in rules or list(BEAM_SCORES):
        for width in widths:
            result = evaluate(
                retriever, samples, tokenized, dataclasses.replace(base, beam_width=width, beam_score=rule)
            )
            name = f"beam{width}_{rule}"
            runs[name] = _row(result.summary)
            per_question[name] = [r["fact_em"] for r in result.records]
            # Questions the beam gets right and greedy wrong, and the reverse: the size of the gap
            # in questions, not only in means.
            wins = sum(b > g for b, g in zip(per_question[name], per_question["greedy"]))
            losses = sum(b < g for b, g in zip(per_question[name], per_question["greedy"]))
            runs[name].update(em_wins_vs_greedy=wins, em_losses_vs_greedy=losses)
    return {
        "checkpoint": checkpoint,
        "dataset": cfg.data.dataset,
        "split": f"validation part of train (data.val_fraction={cfg.data.val_fraction}; held out of training, not dev)",
        "questions": len(samples),
        "max_steps": base.max_steps,
        "trained": {
            "updates": cfg.updates,
            "episodes_per_update": cfg.learner.episodes_per_update,
            "encoder": cfg.model.encoder,
            "positions": cfg.model.positions,
            "env_max_steps": cfg.env.max_steps,
            "config_name": cfg.name,
        },
        "runs": runs,
    }


def _row(summary: dict) -> dict:
    keys = ("fact_em", "fact_f1", "avg_steps", "seconds_per_question")
    return {k: summary[k] for k in keys if k in summary}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    widths = [int(w) for w in args.widths.split(",") if w.strip()]
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    result = {
        "benchmark": "beam_vs_greedy",
        **compare(args.checkpoint, widths, rules, args.steps, args.limit, args.device),
        "seconds": round(time.perf_counter() - t0, 1),
        "machine": machine_info(),
    }
    for name, row in result["runs"].items():
        extra = (
            f"  (+{row['em_wins_vs_greedy']}/-{row['em_losses_vs_greedy']} questions vs greedy)"
            if "em_wins_vs_greedy" in row
            else ""
        )
        print(f"{name:>14}: Fact EM {row['fact_em']:.3f}  F1 {row['fact_f1']:.3f}{extra}")
    if args.out:
        print(f"wrote {write_result(args.out, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
