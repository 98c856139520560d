"""The median of each row's repeats in a folder of bench/train_speed.py results.

    python bench/speed_medians.py DIR [DIR ...] --out DIR/summary.json

On a machine whose host speed moves between processes (the learner's update is bound by its host),
one run per setting can order two settings either way; bench/learner_switches.sh with REPEATS=N
runs every row N times, interleaved, as LABEL_r1 ... LABEL_rN. This groups the files by LABEL (the
name less its ``_rN``), and gives each group its runs, median, range, and the GPU's and host's
seconds per update where the rows were profiled, with the commits the runs were made at.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from bench_common import write_result

REPEAT = re.compile(r"_r\d+$")


def row_label(path: Path) -> str:
    """A result file's row: its name less the repeat suffix."""
    return REPEAT.sub("", path.stem)


def _spread(values: list[float]) -> dict[str, float | list[float] | None]:
    if not values:
        return {"runs": [], "median": None, "min": None, "max": None}
    return {
        "runs": [round(v, 4) for v in values],
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def summarise(paths: list[Path]) -> dict[str, dict]:
    """Each row's figures over its repeats, rows in the order they first appear."""
    groups: dict[str, list[tuple[Path, dict]]] = {}
    for path in paths:
        try:
            result = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"{path}: not a readable JSON result ({exc})") from None
        if result.get("benchmark") != "train_speed":
            continue  # another benchmark's file in the same folder
        groups.setdefault(row_label(path), []).append((path, result))
    rows = {}
    for label, results in groups.items():
        profiles = [r.get("profile") or {} for _, r in results]
        rows[label] = {
            "config": results[0][1].get("config"),
            "overrides": results[0][1].get("overrides"),
            "episodes_per_s": _spread([r["episodes_per_s"] for _, r in results]),
            "gpu_s_per_update_profiled": _spread(
                [p["gpu_busy_s_per_update"] for p in profiles if p.get("gpu_busy_s_per_update")]
            ),
            "host_self_s_per_update_profiled": _spread(
                [p["host_self_s_per_update"] for p in profiles if p.get("host_self_s_per_update")]
            ),
            "commits": sorted({str(r.get("commit")) for _, r in results}),
            "files": [p.name for p, _ in results],
        }
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path, help="folders of train_speed.py JSON results")
    ap.add_argument("--out", help="write the summary here")
    args = ap.parse_args()
    paths = sorted(p for d in args.dirs for p in d.glob("*.json") if p.name != "summary.json")
    if not paths:
        print(f"no JSON results in {', '.join(map(str, args.dirs))}", file=sys.stderr)
        return 2
    rows = summarise(paths)
    first = json.loads(paths[0].read_text())
    summary = {
        "benchmark": "speed_medians",
        "selected_on": "nothing (speed only)",
        "machine": first.get("machine"),
        "cpu_count": first.get("cpu_count"),
        "gpu": first.get("gpu"),
        "torch": first.get("torch"),
        "date": first.get("date"),
        "rows": rows,
    }
    for label, row in rows.items():
        e = row["episodes_per_s"]
        print(f"{label}: median {e['median']:.0f} episodes/s over {len(e['runs'])} ({e['min']:.0f}-{e['max']:.0f})")
    if args.out:
        write_result(args.out, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
