"""Bulk indexing as a Ray job: `qrag index` with the same options and the same choice of path, e.g.
from the repository root:

    ray job submit --working-dir . -- python jobs/index_corpus.py --corpus books \
        --input 's3://bucket/books/*.jsonl' --storage /mnt/qrag/indexes

`ray job submit` sets $RAY_ADDRESS, so the job indexes on that cluster: in lanes on one GPU node
(a Ray task holding the node's GPUs) when the cluster has GPU nodes, else through Ray Data
(`--path lanes|ray` forces either). The storage and the inputs must be reachable from the nodes.
Rerunning after a crash resumes: committed documents are skipped, never embedded again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from qrag.cli.index import index_args, run_index  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="index_corpus", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    index_args(parser)
    return run_index(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
