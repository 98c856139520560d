"""Indexing jobs on the shared storage, so that every replica (and a restarted server) answers
for every job, and the number of jobs in flight is bounded across replicas.

On disk, beside the corpora::

    .jobs/active/<id>.json   queued or running: the owner rewrites it (progress, heartbeat)
    .jobs/done/<id>.json     done or failed, with the reason; the oldest are pruned

A record whose owner stopped heart-beating (the process was killed or restarted) is stale; the
service settles it as failed (or done, when the corpus shows its batch) the next time anyone
looks at it, so no job stays "running" forever. Every record is written durably (temp file
fsynced, renamed, directory fsynced: :func:`qrag.index.store.write_atomic`) before the job is
answered or goes on, so a crash or power loss leaves each record at its last state or the one
before, never torn or gone.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from qrag.file_lock import file_lock
from qrag.index.store import make_dir, remove_file, write_atomic

JOB_ID = re.compile(r"[0-9a-f]{16}")
ACTIVE = ("queued", "running")
OWNER = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"  # this process, this boot


@dataclass
class Job:
    """One append, create or re-index request and how it went."""

    id: str
    corpus: str
    kind: str  # create | append | reindex
    state: str = "queued"  # queued | running | done | failed
    documents: int = 0
    chunks_total: int = 0
    chunks_done: int = 0
    error: dict[str, Any] | None = None  # {"status", "field", "message"} of a failed job
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    heartbeat: float = field(default_factory=time.time)
    owner: str = OWNER

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["owner"], d["heartbeat"]
        d["progress"] = (
            round(self.chunks_done / self.chunks_total, 4)
            if self.chunks_total
            else (1.0 if self.state == "done" else 0.0)
        )
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Job:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def new_job_id() -> str:
    return secrets.token_hex(8)


class JobBoard:
    """Job records under ``<storage>/.jobs``; admission happens under one file lock."""

    def __init__(self, root: str | Path, stale_s: float = 30.0):
        self.root = Path(root) / ".jobs"
        self.stale_s = stale_s
        make_dir(self.root)
        for sub in ("active", "done"):
            make_dir(self.root / sub)

    @contextmanager
    def admission(self) -> Iterator[None]:
        """Serialises admission across processes: count the jobs in flight, then add one."""
        with file_lock(self.root / "admission.lock"):
            yield

    def _path(self, job_id: str, active: bool) -> Path:
        return self.root / ("active" if active else "done") / f"{job_id}.json"

    def save(self, job: Job) -> None:
        """Write the record where its state belongs, durable when this returns: a queued job's id
        is answered to its client, and a record renamed over its predecessor before its bytes
        reach the disk could be empty after a power loss (the heartbeat's few fsyncs are cheap)."""
        job.heartbeat = time.time()
        data = json.dumps(asdict(job)).encode("utf-8")
        if job.active:
            done = self._path(job.id, False)
            if done.exists():  # a late heartbeat of a job that has ended: the ending stands
                return
            write_atomic(self._path(job.id, True), data)
            if done.exists():  # it ended while this was written
                remove_file(self._path(job.id, True))
        else:
            write_atomic(self._path(job.id, False), data)
            remove_file(self._path(job.id, True))

    def get(self, job_id: str) -> Job | None:
        if not JOB_ID.fullmatch(job_id):
            return None
        for active in (False, True):  # done first: a job may move between the two reads
            job = self._read(self._path(job_id, active))
            if job is not None:
                return job
        return None

    @staticmethod
    def _read(path: Path) -> Job | None:
        try:
            return Job.from_dict(json.loads(path.read_bytes()))
        except (FileNotFoundError, ValueError, TypeError):
            return None  # gone, or a record torn by a crash (it is rewritten or settled later)

    def active(self) -> list[Job]:
        out = []
        for path in (self.root / "active").glob("*.json"):
            if (self.root / "done" / path.name).exists():  # ended: a leftover of a late heartbeat
                path.unlink(missing_ok=True)
                continue
            job = self._read(path)
            if job is not None and job.active:
                out.append(job)
        return out

    def stale(self, job: Job, now: float | None = None) -> bool:
        """An active record nobody has heart-beaten for ``stale_s``: its owner is gone."""
        return job.active and ((now or time.time()) - job.heartbeat > self.stale_s)

    def recent(self, corpus: str, limit: int) -> list[Job]:
        jobs = [
            j
            for j in (
                self._read(p) for p in [*(self.root / "active").glob("*.json"), *(self.root / "done").glob("*.json")]
            )
            if j is not None and j.corpus == corpus
        ]
        return sorted(jobs, key=lambda j: j.created, reverse=True)[:limit]

    def prune(self, keep: int) -> None:
        """Keep the newest ``keep`` finished records."""
        done = sorted((self.root / "done").glob("*.json"), key=_mtime)
        for path in done[: max(0, len(done) - keep)]:
            path.unlink(missing_ok=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # pruned by another replica meanwhile
        return 0.0
