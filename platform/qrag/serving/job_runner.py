"""Indexing jobs of one replica: admitted against bounds shared by every replica (their records
live on the shared storage, :mod:`qrag.index.jobs`), run a few at a time, heart-beaten while
they run, and always ended ``done`` or ``failed`` with a reason."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from qrag.data.sample import DataError
from qrag.index.jobs import Job, JobBoard, new_job_id
from qrag.index.store import CorpusStore, StoreError
from qrag.serving.errors import ServiceError, data_error, os_error, store_error
from qrag.serving.service_config import ServeConfig

log = logging.getLogger("qrag.service")

Work = Callable[[Job], Awaitable[None]]


class JobRunner:
    def __init__(self, cfg: ServeConfig, store: CorpusStore, summary: Callable[[str], dict[str, Any] | None]):
        """``summary(corpus)``: the corpus as a job's answer shows it (None: not there)."""
        self.cfg, self.store, self.summary = cfg, store, summary
        self.board = JobBoard(store.root, stale_s=cfg.job_stale_s)
        self.jobs: OrderedDict[str, Job] = OrderedDict()  # this replica's jobs (fresher than their records)
        self._tasks: set[asyncio.Task] = set()
        self._workers: asyncio.Semaphore | None = None  # made in the serving event loop
        self._workers_loop: asyncio.AbstractEventLoop | None = None
        self._heartbeat: asyncio.Task | None = None

    async def submit(self, corpus: str, kind: str, documents: int, work: Work, wait: bool) -> dict[str, Any]:
        """Admit a job (429 past the bounds), start it, and with ``wait`` answer when it ends or
        after ``job_wait_s`` (then 202: it goes on). A client that goes away does not stop it."""
        job = await asyncio.to_thread(self._admit, corpus, kind, documents)
        self.jobs[job.id] = job  # in the event loop: _beat iterates this dict there
        while len(self.jobs) > self.cfg.jobs_kept and not next(iter(self.jobs.values())).active:
            self.jobs.popitem(last=False)
        task = self._start(job, work(job))
        if wait:
            # Answer (202) before the request deadline does (503); waiting never cancels the job.
            await asyncio.wait({task}, timeout=min(self.cfg.job_wait_s, 0.8 * self.cfg.request_timeout_s))
            if job.state == "failed":
                raise ServiceError(job.error["status"], job.error["field"], job.error["message"])
        summary = self.summary(corpus) if job.state == "done" or kind != "create" else None
        return {"corpus": summary, "job": job.as_dict()}

    def _admit(self, corpus: str, kind: str, documents: int) -> Job:
        c = self.cfg
        with self.board.admission():
            active = []
            for j in self.board.active():
                if self.jobs.get(j.id) is None and self.board.stale(j):
                    self._settle(j)
                else:
                    active.append(j)
            mine = [j for j in active if j.corpus == corpus]
            running = next((j for j in mine if j.kind == "reindex"), None)
            if kind == "reindex" and running is not None:
                raise ServiceError(409, "corpus", f"corpus {corpus!r} is being re-indexed already (job {running.id})")
            if len(mine) >= c.max_jobs_per_corpus:
                raise ServiceError(
                    429,
                    "corpus",
                    f"{len(mine)} indexing jobs of corpus {corpus!r} are queued or running; at most "
                    f"{c.max_jobs_per_corpus} (max_jobs_per_corpus): retry later",
                    {"Retry-After": str(c.retry_after_s)},
                )
            if len(active) >= c.max_jobs:
                raise ServiceError(
                    429,
                    None,
                    f"{len(active)} indexing jobs are queued or running; at most {c.max_jobs} (max_jobs): retry later",
                    {"Retry-After": str(c.retry_after_s)},
                )
            job = Job(new_job_id(), corpus, kind, documents=documents)
            self.board.save(job)
        return job

    def _settle(self, job: Job) -> Job:
        """A stale record (its server stopped): done if its batch reached the corpus, else failed."""
        latest = self.board.get(job.id)
        if latest is not None and not latest.active:
            return latest  # it ended after all (the record read was a leftover)
        batch = None
        if job.kind in ("create", "append"):
            try:
                batch = self.store.job_batch(self.store.read(job.corpus), job.id)
            except StoreError:
                batch = None
        if batch is not None:
            job.state, job.chunks_done = "done", job.chunks_total
        else:
            nothing = (
                "nothing of it was stored"
                if job.kind != "reindex"
                else f"the corpus keeps its old vectors; POST /v1/corpora/{job.corpus}/reindex "
                "goes on from the segments already re-embedded"
            )
            job.state = "failed"
            job.error = ServiceError(
                503,
                None,
                f"interrupted: the server running this job stopped (restart or crash) before it finished; {nothing}",
            ).body()["error"]
        job.finished = time.time()
        self.board.save(job)
        return job

    def _start(self, job: Job, work: Awaitable[None]) -> asyncio.Task:
        loop = asyncio.get_running_loop()
        if self._workers is None or self._workers_loop is not loop:  # (tests run several loops)
            self._workers, self._workers_loop = asyncio.Semaphore(max(1, self.cfg.job_workers)), loop
        task = asyncio.ensure_future(self._run(job, work))
        self._tasks.add(task)  # keep a reference: a running job must not be garbage-collected
        task.add_done_callback(self._tasks.discard)
        if self._heartbeat is None or self._heartbeat.done():
            self._heartbeat = asyncio.ensure_future(self._beat())
        return task

    async def _run(self, job: Job, work: Awaitable[None]) -> None:
        try:
            async with self._workers:
                job.state, job.started = "running", time.time()
                await asyncio.to_thread(self.board.save, job)
                await work
                job.state = "done"
        except ServiceError as exc:
            job.state, job.error = "failed", exc.body()["error"]
        except StoreError as exc:
            job.state, job.error = "failed", store_error(exc, job.corpus).body()["error"]
        except DataError as exc:
            job.state, job.error = "failed", data_error(exc).body()["error"]
        except OSError as exc:  # disk full, storage gone
            job.state, job.error = "failed", os_error(exc).body()["error"]
        except asyncio.CancelledError:
            job.state, job.error = (
                "failed",
                ServiceError(503, None, "cancelled: the server is shutting down").body()["error"],
            )
            raise
        except Exception as exc:  # a bug or an unexpected backend failure: still an ending, with a reason
            log.exception("indexing job %s failed", job.id)
            job.state, job.error = (
                "failed",
                ServiceError(500, None, f"internal error: {type(exc).__name__}").body()["error"],
            )
        finally:
            if job.state == "done":
                job.chunks_done = job.chunks_total
            job.finished = time.time()
            # The record's durable write (fsyncs) in a thread, off the event loop; shielded, so a
            # cancellation (shutdown) never stops it half way: the thread finishes it regardless.
            ending = asyncio.ensure_future(asyncio.to_thread(self._record_end, job))
            try:
                await asyncio.shield(ending)
            except asyncio.CancelledError:
                pass  # (being cancelled already: the thread goes on writing)

    def _record_end(self, job: Job) -> None:
        try:
            self.board.save(job)
        except OSError:
            log.exception("cannot record the end of job %s", job.id)
        self.board.prune(self.cfg.jobs_kept)

    async def _beat(self) -> None:
        """Rewrite this replica's active job records (progress, and proof that it is alive)."""
        while any(j.active for j in list(self.jobs.values())):
            await asyncio.sleep(self.cfg.job_heartbeat_s)
            for job in [j for j in list(self.jobs.values()) if j.active]:
                await asyncio.to_thread(self.board.save, job)

    def job(self, job_id: str) -> dict[str, Any]:
        job = self.jobs.get(job_id)
        if job is None:
            job = self.board.get(job_id)
            if job is not None and self.board.stale(job):
                job = self._settle(job)
        if job is None:
            raise ServiceError(
                404, "job", f"unknown job {job_id!r} (the last {self.cfg.jobs_kept} finished jobs are kept)"
            )
        return job.as_dict()

    def corpus_jobs(self, name: str) -> dict[str, Any]:
        jobs = {j.id: j for j in self.board.recent(name, self.cfg.jobs_kept)}
        jobs.update(
            {j.id: j for j in list(self.jobs.values()) if j.corpus == name}
        )  # (a snapshot: this runs in a thread)
        out = [self._settle(j) if self.board.stale(j) and j.id not in self.jobs else j for j in jobs.values()]
        return {"corpus": name, "jobs": [j.as_dict() for j in sorted(out, key=lambda j: j.created, reverse=True)]}
