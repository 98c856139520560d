"""Plant small bugs one at a time, run the test files that should catch each, put the code back.

Each bug is one exact text replacement in one file. For every bug the harness writes the planted
text, runs pytest on the bug's test files (``--phase before``: the tests that existed; ``after``:
with the tests written for the bugs the first phase let through), records which tests failed,
and restores the file. The restore puts back only the planted text, so an edit someone else
made to the file meanwhile survives. Results merge into ``bench/results/planted_bugs.json``.

    .venv/bin/python bench/planted_bugs.py --phase before
    .venv/bin/python bench/planted_bugs.py --phase after
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "planted_bugs.json"

LEARNER = ["tests/test_learner.py", "tests/test_learner_targets.py", "tests/test_learning_signal.py"]
TRAIN = ["tests/test_checkpoint.py", "tests/test_learning_signal.py", "tests/test_longctx_bench.py"]
METRICS = ["tests/test_metrics.py", "tests/test_answer_metrics.py"]
SPLITS = [
    "tests/test_data_hotpotqa.py",
    "tests/test_data_cache.py",
    "tests/test_distributed_units.py",
    "tests/test_longctx_data.py",
    "tests/test_data_musique.py",
]
STORE = ["tests/test_index.py", "tests/test_store_crash.py", "tests/test_store_faults.py"]
SCORING = ["tests/test_early_stopping.py", "tests/test_search.py", "tests/test_multistep.py"]


PROTOCOL = (
    "one bug planted at a time, pytest -x on the bug's test files, the file restored; 'before': the test files that "
    "existed (issue 33's bugs: the review found every test passing with them), 'after': with the tests written for "
    "the bugs 'before' let through; 'by': the first failing test"
)


@dataclass(frozen=True)
class Bug:
    id: str
    origin: str  # "issue" (the review's, issue 33) or "own" (planted for this round)
    file: str
    old: str
    new: str
    description: str
    tests: list[str]
    new_tests: list[str] = field(default_factory=list)


BUGS = [
    # -- the review's bugs that every test passed (issue 33) ----------------------------------------
    Bug(
        "ema-skips-action-target",
        "issue",
        "platform/qrag/model/qnet.py",
        "pairs = [(self.target_state_encoder, self.state_encoder), (self.target_action_encoder, self.action_encoder)]",
        "pairs = [(self.target_state_encoder, self.state_encoder)]",
        "the target EMA skips the action encoder's target",
        LEARNER + ["tests/test_checkpoint.py"],
        ["tests/test_learner_guards.py"],
    ),
    Bug(
        "value-top-k-ignored",
        "issue",
        "platform/qrag/rl/learner.py",
        "value_top_k = cfg.value_top_k or cfg.top_k",
        "value_top_k = cfg.top_k",
        "learner.value_top_k ignored (V over top_k)",
        LEARNER,
        ["tests/test_learner_guards.py"],
    ),
    Bug(
        "oracle-stop-late",
        "issue",
        "platform/qrag/evaluation/evaluate.py",
        "oracle = picks[:complete] if complete is not None else picks",
        "oracle = picks[:complete + 1] if complete is not None else picks",
        "oracle-stop picks cut one step late",
        SCORING + ["tests/test_lengths.py"],
        ["tests/test_scoring.py"],
    ),
    Bug(
        "validation-ignores-source",
        "issue",
        "platform/qrag/data/splits.py",
        'return str(meta.get("story_id") or meta.get("source_id") or sample.id)',
        "return str(sample.id)",
        "validation split ignores the source (story) id: held-out bAbI stories leak into train",
        SPLITS,
        ["tests/test_held_out.py"],
    ),
    Bug(
        "hard-negatives-in-dev-and-val",
        "issue",
        "platform/qrag/data/babilong.py",
        'hard_negatives=cfg.hard_negatives if split == "train" else 0',
        "hard_negatives=cfg.hard_negatives",
        "hard negatives added to dev and val contexts",
        ["tests/test_longctx_data.py"],
        ["tests/test_held_out.py"],
    ),
    Bug(
        "metrics-weighted-by-parts",
        "issue",
        "platform/qrag/rl/learner.py",
        "weight = len(part) / len(episodes)",
        "weight = 1 / len(parts)",
        "micro-batch metrics weighted by part count, not by their share of the episodes",
        LEARNER,
        ["tests/test_learner_guards.py"],
    ),
    Bug(
        "clip-before-divide",
        "issue",
        "platform/qrag/rl/learner.py",
        """        params = self.qnet.online_parameters()
        # The loss is the mean over every transition of the update, however micro-batches split it.
        for p in params:
            if p.grad is not None:
                p.grad.div_(max(1.0, sums["transitions"]))
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)""",
        """        params = self.qnet.online_parameters()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        # The loss is the mean over every transition of the update, however micro-batches split it.
        for p in params:
            if p.grad is not None:
                p.grad.div_(max(1.0, sums["transitions"]))""",
        "the gradient clipped before it is divided by the transition count",
        LEARNER,
        ["tests/test_learner_guards.py"],
    ),
    # -- planted for this round ---------------------------------------------------------------
    Bug(
        "lambda-swapped",
        "own",
        "platform/qrag/rl/learner.py",
        "boot = (1.0 - lam) * next_values[:, t] + lam * g_next",
        "boot = lam * next_values[:, t] + (1.0 - lam) * g_next",
        "λ-return mixes V and G^λ with λ and 1 − λ swapped",
        LEARNER,
    ),
    Bug(
        "soft-value-unmasked",
        "own",
        "platform/qrag/rl/learner.py",
        'masked = q.masked_fill(~available, float("-inf"))\n    k = min(top_k, masked.shape[1])',
        "masked = q\n    k = min(top_k, masked.shape[1])",
        "soft value V counts already selected chunks",
        LEARNER,
    ),
    Bug(
        "warmup-starts-at-zero",
        "own",
        "platform/qrag/rl/learner.py",
        "return (update + 1) / warmup",
        "return update / warmup",
        "the first warm-up update runs with learning rate 0",
        LEARNER,
    ),
    Bug(
        "entropy-mean-not-sum",
        "own",
        "platform/qrag/rl/learner.py",
        "entropy = -(probs * logp.masked_fill(probs == 0, 0.0)).sum(1)",
        "entropy = -(probs * logp.masked_fill(probs == 0, 0.0)).mean(1)",
        "policy entropy diagnostic averaged over the top-k instead of summed",
        LEARNER,
        ["tests/test_learner_guards.py"],
    ),
    Bug(
        "periodic-eval-on-dev",
        "own",
        "platform/qrag/rl/train.py",
        'return "val" if self.val_tok else "dev"',
        'return "dev"',
        "periodic evaluation and keep_best choose on dev though a validation split exists",
        TRAIN,
        ["tests/test_run_guards.py"],
    ),
    Bug(
        "sampler-never-reshuffles",
        "own",
        "platform/qrag/rl/train.py",
        "self.perm, self.pos, self.epoch = self.rng.permutation(self.n), 0, self.epoch + 1",
        "self.perm, self.pos, self.epoch = self.perm, 0, self.epoch + 1",
        "every epoch repeats the first epoch's order",
        TRAIN,
        ["tests/test_run_guards.py"],
    ),
    Bug(
        "best-reports-final-action-encoder",
        "own",
        "platform/qrag/rl/train.py",
        "            self.qnet.action_encoder.load_state_dict(best_qnet.action_encoder.state_dict())\n",
        "",
        "keep_best's reported evaluation keeps the final action encoder",
        TRAIN,
        ["tests/test_run_guards.py"],
    ),
    Bug(
        "f1-empty-empty",
        "own",
        "platform/qrag/metrics.py",
        "    if not g and not r:\n        return 1.0",
        "    if not g and not r:\n        return 0.0",
        "Fact F1 of no gold and no picks is 0",
        METRICS,
        ["tests/test_metric_guards.py"],
    ),
    Bug(
        "normalise-keeps-an",
        "own",
        "platform/qrag/metrics.py",
        r'text = re.sub(r"\b(a|an|the)\b", " ", text)',
        r'text = re.sub(r"\b(a|the)\b", " ", text)',
        "answer normalisation keeps the article 'an'",
        METRICS,
    ),
    Bug(
        "val-hash-is-dev-hash",
        "own",
        "platform/qrag/data/splits.py",
        'return val_fraction > 0 and dev_score("val:" + record_id) < val_fraction',
        "return val_fraction > 0 and dev_score(record_id) < val_fraction",
        "the validation draw reuses the dev draw's hash (validation then holds only dev records)",
        SPLITS,
        ["tests/test_split_guards.py"],
    ),
    Bug(
        "hub-splits-rehashed",
        "own",
        "platform/qrag/data/splits.py",
        "if by_hash and isinstance(rid, str) and not in_split(rid, split, dev_fraction):",
        "if isinstance(rid, str) and not in_split(rid, split, dev_fraction):",
        "records of an explicit train/dev file or hub split are split again by hash",
        SPLITS + ["tests/test_data_hf.py"],
    ),
    Bug(
        "shard-rows-floor",
        "own",
        "platform/qrag/index/store.py",
        "return max(0, -(-(n_total - shard) // n_shards))",
        "return max(0, (n_total - shard) // n_shards)",
        "a shard's row count rounded down (its last row lost)",
        STORE,
    ),
    Bug(
        "unchecked-file-hash",
        "own",
        "platform/qrag/index/store.py",
        "return data if _sha256(data) == sha else None",
        "return data",
        "a stored file is read without checking its SHA-256",
        STORE,
    ),
]


def run_tests(files: list[str], timeout: int) -> tuple[bool, list[str], float]:
    """(all passed, failing test ids, seconds)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rf", *files]
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, ["(timed out)"], time.perf_counter() - t0
    failed = re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", out.stdout, flags=re.MULTILINE)
    return out.returncode == 0, failed, time.perf_counter() - t0


def plant(bug: Bug) -> str:
    path = ROOT / bug.file
    text = path.read_text()
    if text.count(bug.old) != 1:
        raise SystemExit(f"{bug.id}: the text to replace occurs {text.count(bug.old)} times in {bug.file}")
    path.write_text(text.replace(bug.old, bug.new))
    return text


def restore(bug: Bug, original: str) -> None:
    """Take the planted text out again; another engineer's edit of the file meanwhile stays."""
    path = ROOT / bug.file
    now = path.read_text()
    if now == original.replace(bug.old, bug.new):
        path.write_text(original)
    elif bug.new and now.count(bug.new) == 1:
        path.write_text(now.replace(bug.new, bug.old))
    else:
        raise SystemExit(f"{bug.id}: cannot take the planted text out of {bug.file}: restore it by hand")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=("before", "after"), required=True)
    p.add_argument("--only", nargs="*", help="bug ids (default: all)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per pytest run")
    args = p.parse_args(argv)
    results = json.loads(OUT.read_text()) if OUT.is_file() else {"bugs": {}}
    for bug in BUGS:
        if args.only and bug.id not in args.only:
            continue
        files = bug.tests + (bug.new_tests if args.phase == "after" else [])
        original = plant(bug)
        try:
            passed, failed, seconds = run_tests(files, args.timeout)
        finally:
            restore(bug, original)
        entry = results["bugs"].setdefault(
            bug.id, {"file": bug.file, "origin": bug.origin, "description": bug.description}
        )
        entry[args.phase] = {"caught": not passed, "by": failed, "test_files": files, "seconds": round(seconds, 1)}
        print(json.dumps({"bug": bug.id, "phase": args.phase, "caught": not passed, "by": failed}), flush=True)
    results["protocol"] = PROTOCOL
    results["bugs"] = {b.id: results["bugs"][b.id] for b in BUGS if b.id in results["bugs"]}
    results["summary"] = summary(results["bugs"])
    results["updated"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=1) + "\n")
    return 0


def summary(bugs: dict) -> dict:
    out = {}
    for origin in ("issue", "own"):
        for phase in ("before", "after"):
            runs = [b[phase]["caught"] for b in bugs.values() if b["origin"] == origin and phase in b]
            if runs:
                out[f"{origin}_{phase}"] = f"{sum(runs)}/{len(runs)} caught"
    return out


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
