"""The default MLflow store (SQLite under out_dir) shared by runs that start at the same moment,
as training seeds side by side do (bench/hotpot_seeds.sh): each must open it, none may fail while
another creates its tables."""

from __future__ import annotations

import multiprocessing as mp


def _open_store(uri: str, start, errors) -> None:
    from qrag.integrations.tracking import client_for

    start.wait()  # every process past its imports: they reach the empty database together
    try:
        client_for(uri).search_experiments(max_results=1)
    except Exception as exc:  # reported to the parent, which names it
        errors.put(f"{type(exc).__name__}: {exc}"[:300])


def test_runs_starting_together_share_a_new_sqlite_store(tmp_path):
    ctx = mp.get_context("spawn")
    uri = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    start, errors = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_open_store, args=(uri, start, errors)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    found = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not found, found
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
