"""A Python client of the qrag retrieval service (``qrag serve``, the Ray Serve app): one method
per route, answers parsed into the service's own models (:mod:`qrag.serving.api_models`), errors
raised as :class:`ApiError` with the status, the field at fault and the message.

>>> from qrag.client import Client
>>> with Client("http://127.0.0.1:8000", key="<write key>") as c:
...     c.create_corpus("books", [{"id": "d1", "text": "..."}])
...     answer = c.retrieve("who met the painter?", corpus="books", max_steps=2)

``AsyncClient`` has the same methods, to be awaited. Answers 429 (too many indexing jobs) are
retried after their ``Retry-After``; 503 (overload, a restarting backend) too for the calls that
change nothing (reads and retrieval), since a write that timed out may still go on. Retries stop
once their waits would pass ``RetryPolicy.max_wait_s`` in all. Neither torch nor the server is imported.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from qrag.answers.openai_compat import retry_after_seconds
from qrag.serving.api_models import CorpusJobs, CorpusList, CorpusStats, Deleted, Health, Job, JobAnswer, RetrieveAnswer

M = TypeVar("M", bound=BaseModel)
DONE_STATES = ("done", "failed")


class ApiError(Exception):
    """A 4xx/5xx answer: ``status``, the request ``field`` at fault (or None) and the message."""

    def __init__(self, status: int, field: str | None, message: str, retry_after_s: float | None = None):
        super().__init__(f"{status} {field or '-'}: {message}")
        self.status, self.field, self.message, self.retry_after_s = status, field, message, retry_after_s

    @classmethod
    def of(cls, response: httpx.Response) -> ApiError:
        """The service's ``{"error": {status, field, message}}``, or a proxy's plain answer."""
        try:
            err = response.json()["error"]
            field, message = err.get("field"), str(err.get("message"))
        except (ValueError, KeyError, TypeError, AttributeError):
            field, message = None, response.text[:500] or response.reason_phrase
        return cls(response.status_code, field, message, retry_after(response))


def retry_after(response: httpx.Response) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), or None."""
    return retry_after_seconds(response.headers.get("retry-after"))


@dataclass
class Call(Generic[M]):
    """One request: what to send, what the answer is, and whether a 503 may be retried."""

    method: str
    path: str
    model: type[M]
    body: dict[str, Any] | None = None
    changes_nothing: bool = True


@dataclass
class RetryPolicy:
    """Retries of 429 (and of 503 for calls that change nothing): at most ``attempts`` in all,
    waiting ``Retry-After`` (else ``backoff_s`` doubling), ``max_wait_s`` at most in all."""

    attempts: int = 5
    max_wait_s: float = 30.0
    backoff_s: float = 0.5

    def delay(self, call: Call, response: httpx.Response, attempt: int, waited_s: float) -> float | None:
        """How long to wait before the next try, or None to give up with this answer."""
        retryable = response.status_code == 429 or (response.status_code == 503 and call.changes_nothing)
        if not retryable or attempt + 1 >= self.attempts:
            return None
        wait = retry_after(response)
        wait = self.backoff_s * 2**attempt if wait is None else wait
        return wait if waited_s + wait <= self.max_wait_s else None


def _answer(call: Call[M], response: httpx.Response) -> M:
    if response.status_code >= 400:
        raise ApiError.of(response)
    return call.model.model_validate(response.json())


def _name(value: str) -> str:
    return quote(str(value), safe="")


def _documents(documents: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    return [{"id": d["id"], "text": d["text"]} for d in documents or []]


class _Routes:
    """The service's routes as calls; :class:`Client` and :class:`AsyncClient` send them."""

    def _send(self, call: Call[M]) -> Any:
        raise NotImplementedError

    def health(self):
        """GET /healthz (the model's details need a read key on a server with keys)."""
        return self._send(Call("GET", "/healthz", Health))

    def list_corpora(self):
        return self._send(Call("GET", "/v1/corpora", CorpusList))

    def create_corpus(
        self,
        name: str,
        documents: list[dict[str, Any]] | None = None,
        chunk_tokens: int | None = None,
        wait: bool = True,
    ):
        body: dict[str, Any] = {"name": name, "documents": _documents(documents), "wait": wait}
        if chunk_tokens is not None:
            body["chunk_tokens"] = chunk_tokens
        return self._send(Call("POST", "/v1/corpora", JobAnswer, body, changes_nothing=False))

    def append(self, name: str, documents: list[dict[str, Any]], wait: bool = True):
        body = {"documents": _documents(documents), "wait": wait}
        return self._send(Call("POST", f"/v1/corpora/{_name(name)}/documents", JobAnswer, body, changes_nothing=False))

    def stats(self, name: str):
        return self._send(Call("GET", f"/v1/corpora/{_name(name)}", CorpusStats))

    def delete_corpus(self, name: str):
        return self._send(Call("DELETE", f"/v1/corpora/{_name(name)}", Deleted, changes_nothing=False))

    def reindex(self, name: str, wait: bool = False):
        return self._send(
            Call("POST", f"/v1/corpora/{_name(name)}/reindex", JobAnswer, {"wait": wait}, changes_nothing=False)
        )

    def corpus_jobs(self, name: str):
        return self._send(Call("GET", f"/v1/corpora/{_name(name)}/jobs", CorpusJobs))

    def job(self, job_id: str):
        return self._send(Call("GET", f"/v1/jobs/{_name(job_id)}", Job))

    def retrieve(self, question: str, corpus: str | None = None, context: str | None = None, **options: Any):
        """POST /v1/retrieve over ``corpus`` or an inline ``context``; ``options``: max_steps,
        beam_width, beam_score, beam_temperature, stop_threshold, alternatives, chunk_tokens, return_chunks."""
        body = {
            "question": question,
            **({"corpus": corpus} if corpus is not None else {}),
            **({"context": context} if context is not None else {}),
            **options,
        }
        return self._send(Call("POST", "/v1/retrieve", RetrieveAnswer, body))


def _headers(key: str | None, headers: dict[str, str] | None) -> dict[str, str]:
    return {**({"authorization": f"Bearer {key}"} if key else {}), **(headers or {})}


class Client(_Routes):
    """The blocking client (httpx.Client underneath; ``transport`` for tests)."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        key: str | None = None,
        *,
        timeout_s: float = 120.0,
        retry: RetryPolicy | None = None,
        headers: dict[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
    ):
        self.retry = retry or RetryPolicy()
        self.http = httpx.Client(
            base_url=base_url, headers=_headers(key, headers), timeout=timeout_s, transport=transport
        )

    def _send(self, call: Call[M]) -> M:
        waited = 0.0
        for attempt in range(self.retry.attempts):
            response = self.http.request(call.method, call.path, json=call.body)
            wait = self.retry.delay(call, response, attempt, waited)
            if wait is None:
                break
            time.sleep(wait)
            waited += wait
        return _answer(call, response)

    def wait_for_job(self, job_id: str, timeout_s: float = 600.0, poll_s: float = 0.2) -> Job:
        """Poll the job until it is done or failed (TimeoutError past ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while (job := self.job(job_id)).state not in DONE_STATES:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.state} after {timeout_s:g} s")
            time.sleep(poll_s)
        return job

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Routes):
    """The asyncio client: the same methods, awaited (httpx.AsyncClient underneath;
    ``transport=httpx.ASGITransport(app)`` calls an app in this process)."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        key: str | None = None,
        *,
        timeout_s: float = 120.0,
        retry: RetryPolicy | None = None,
        headers: dict[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.retry = retry or RetryPolicy()
        self.http = httpx.AsyncClient(
            base_url=base_url, headers=_headers(key, headers), timeout=timeout_s, transport=transport
        )

    async def _send(self, call: Call[M]) -> M:
        waited = 0.0
        for attempt in range(self.retry.attempts):
            response = await self.http.request(call.method, call.path, json=call.body)
            wait = self.retry.delay(call, response, attempt, waited)
            if wait is None:
                break
            await asyncio.sleep(wait)
            waited += wait
        return _answer(call, response)

    async def wait_for_job(self, job_id: str, timeout_s: float = 600.0, poll_s: float = 0.2) -> Job:
        """Poll the job until it is done or failed (TimeoutError past ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while (job := await self.job(job_id)).state not in DONE_STATES:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.state} after {timeout_s:g} s")
            await asyncio.sleep(poll_s)
        return job

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


__all__ = ["ApiError", "AsyncClient", "Client", "RetryPolicy"]
