"""Start-up time of a training run: process start -> data ready (and optionally -> first update).

Each measurement is a fresh Python process that builds ``TrainingRun`` for
``configs/hotpot.yaml device=cpu updates=1`` (model and data load side by side, as ``qrag train``
does). Three kinds of run:

* ``before``: the code of ``--before`` (a commit without the data cache), extracted with
  ``git archive`` and put first on ``PYTHONPATH``;
* ``first``: this checkout with an empty data cache (parse, chunk, tokenise, write the cache);
* ``cached``: this checkout again, reading the cache the ``first`` run wrote.

Runs are interleaved (before, first, cached; first, before, cached; ...: each round with a new,
empty cache) so that the load of a shared machine falls on all of them alike; the machine's load
average is recorded with every run.

    python bench/startup.py --before 0a3f7b0 --repeats 3 --out bench/results/startup_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import ROOT, machine_info, write_result  # noqa: E402

CHILD = r"""
import json, os, sys, time
t0 = float(os.environ["QRAG_BENCH_T0"])
import qrag, qrag.rl.train
from qrag.config import load_config
imported = time.time() - t0
cfg = load_config(sys.argv[1], sys.argv[3:])
if sys.argv[2] == "data":  # the data path alone: tokenizer, then TrainingRun.load_data, no model
    from qrag.model.encoder import load_tokenizer, resolve_encoder
    from qrag.data.tokens import TokenLayout
    run = object.__new__(qrag.rl.train.TrainingRun)
    run.cfg, run.timings = cfg, {}
    run.tokenizer = load_tokenizer(resolve_encoder(cfg.model.encoder))
    run.layout = TokenLayout.from_tokenizer(run.tokenizer, cfg.model.max_state_tokens)
    run.load_data()
else:
    run = qrag.rl.train.TrainingRun(cfg)
ready = time.time() - t0
out = {"qrag": qrag.__file__, "import_s": imported, "ready_s": ready, **run.timings,
       "train": len(run.train_tok), "val": len(run.val_tok), "dev": len(run.dev_tok)}
if sys.argv[2] == "update":  # TrainingRun, then one optimiser update
    run.learner.train_update(run.local_source().next_batch())
    out["first_update_s"] = time.time() - t0
print("QRAG_BENCH " + json.dumps(out), flush=True)
"""


def measure(code_root: Path, overrides: list[str], cache: Path, mode: str) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=str(code_root / "platform"),
        QRAG_DATA_CACHE=str(cache),
        TOKENIZERS_PARALLELISM="false",
        QRAG_BENCH_T0=repr(time.time()),
    )
    cmd = [sys.executable, "-c", CHILD, str(ROOT / "configs" / "hotpot.yaml"), mode, *overrides]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("QRAG_BENCH ")]
    if proc.returncode or not lines:
        raise SystemExit(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1].removeprefix("QRAG_BENCH "))
    result["load_average_1m"] = os.getloadavg()[0]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="commit whose code has no data cache")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of (before, first, cached)")
    ap.add_argument(
        "--modes",
        default="ready,data",
        help="ready (TrainingRun), data (load_data alone), update (+ first update: minutes on CPU)",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "startup_cpu.json"))
    args = ap.parse_args()
    overrides = ["device=cpu", "updates=1"]
    with tempfile.TemporaryDirectory(prefix="qrag-startup-") as tmp:
        before_root = Path(tmp) / "before"
        archive = subprocess.run(
            ["git", "archive", args.before, "platform"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        before_root.mkdir()
        (Path(tmp) / "before.tar").write_bytes(archive)
        with tarfile.open(Path(tmp) / "before.tar") as tar:
            tar.extractall(before_root, filter="data")
        runs = []

        def add(kind: str, root: Path, cache: Path, mode: str) -> None:
            r = {"kind": kind, "mode": mode, **measure(root, overrides, cache, mode)}
            assert r["qrag"].startswith(str(root)), r["qrag"]  # the intended code ran
            print(json.dumps(r), flush=True)
            runs.append(r)

        for mode in args.modes.split(","):
            for i in range(args.repeats):
                cache = Path(tmp) / f"cache-{mode}-{i}"  # empty: the first run of this round builds it
                if i % 2:  # alternate which of before / first runs first in a round
                    add("first", ROOT, cache, mode)
                    add("before", before_root, cache, mode)
                else:
                    add("before", before_root, cache, mode)
                    add("first", ROOT, cache, mode)
                add("cached", ROOT, cache, mode)

    def med(mode: str, kind: str, key: str) -> float | None:
        values = [r[key] for r in runs if r["mode"] == mode and r["kind"] == kind and key in r]
        return round(statistics.median(values), 2) if values else None

    keys = ("ready_s", "data_s", "model_s", "first_update_s")
    summary = {
        mode: {
            kind: {key: med(mode, kind, key) for key in keys if med(mode, kind, key) is not None}
            for kind in ("before", "first", "cached")
        }
        for mode in args.modes.split(",")
    }
    result = {
        "what": "start-up of `qrag train --config configs/hotpot.yaml device=cpu updates=1`, median seconds over runs. "
        "mode 'ready': from process start until TrainingRun is built (model and data load side by side, as "
        "qrag train does; data_s = the data thread, which shares the GIL with the model load); mode 'data': "
        "process start -> tokenizer -> TrainingRun.load_data done, no model (the data path alone). "
        "before = the code without the cache; first = empty cache (builds it); cached = the next start",
        "before_commit": args.before,
        "machine": machine_info(),
        "summary": summary,
        "runs": runs,
    }
    write_result(args.out, result)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
