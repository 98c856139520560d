"""The ``openai`` reader backend: any OpenAI-compatible ``/v1/chat/completions`` endpoint (vLLM,
llama.cpp's server, a hosted API).

Greedy (temperature 0). Requests run on a thread pool (``answer.concurrency`` in flight) over one
httpx client per reader, whose connections stay open between requests (no TCP/TLS handshake per
question). A timeout, a connection error, HTTP 429 or 5xx is retried ``answer.retries`` times:
after the server's ``Retry-After`` on 429/503 (up to ``answer.retry_after_max_s``; a longer wait
fails the question at once), else with exponential back-off. Any other failure, or the last
retry's, becomes that question's error.
"""

from __future__ import annotations

import email.utils
import json
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from qrag import progress
from qrag.config import AnswerConfig
from qrag.answers.reader import Answer, AnswerSetupError, ChatRequest

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
RETRY_AFTER_STATUS = {429, 503}  # the statuses whose Retry-After says when to come back


class _Retryable(Exception):
    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


def retry_after_seconds(value: str | None) -> float | None:
    """A ``Retry-After`` header's wait (delta-seconds or an HTTP date), or None."""
    if value is None:
        return None
    if value.strip().isdigit():
        return float(value)
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


class OpenAIAnswerer:
    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        retries: int = 2,
        concurrency: int = 8,
        max_tokens: int = 32,
        backoff: float = 0.5,
        retry_after_max_s: float = 60.0,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise AnswerSetupError(f"answer.base_url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout, self.retries, self.backoff = timeout, max(0, retries), backoff
        self.retry_after_max_s = retry_after_max_s
        self.concurrency, self.max_tokens = max(1, concurrency), max_tokens
        # One pool of kept-alive connections, as many as requests in flight.
        self.http = httpx.Client(
            headers=self._headers(),
            timeout=timeout,
            limits=httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency),
        )
        self.model = model or self._first_model()
        self.name = f"{self.model} (OpenAI-compatible endpoint {self.base_url})"

    @classmethod
    def from_config(cls, cfg: AnswerConfig) -> "OpenAIAnswerer":
        base_url = cfg.base_url or os.environ.get("QRAG_ANSWER_BASE_URL") or os.environ.get("OPENAI_BASE_URL")
        if not base_url:
            raise AnswerSetupError(
                "the openai answer backend needs an endpoint: set answer.base_url=http://HOST:PORT/v1 "
                "or QRAG_ANSWER_BASE_URL / OPENAI_BASE_URL"
            )
        return cls(
            base_url,
            cfg.model or os.environ.get("QRAG_ANSWER_MODEL"),
            cfg.api_key or os.environ.get("OPENAI_API_KEY"),
            timeout=cfg.timeout,
            retries=cfg.retries,
            concurrency=cfg.concurrency,
            max_tokens=cfg.max_tokens,
            retry_after_max_s=cfg.retry_after_max_s,
        )

    def close(self) -> None:
        self.http.close()

    # -- HTTP -------------------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One HTTP exchange; raises _Retryable for transient failures, RuntimeError otherwise."""
        try:
            resp = self.http.request(method, self.base_url + path, json=body)
        except httpx.TimeoutException:
            raise _Retryable(f"timed out after {self.timeout:g} s") from None
        except httpx.ConnectError as exc:
            raise _Retryable(f"cannot reach {self.base_url}: {exc}") from None
        except httpx.TransportError as exc:
            raise _Retryable(f"connection to {self.base_url} failed: {type(exc).__name__}: {exc}") from None
        if resp.status_code >= 400:
            detail = resp.text[:300].strip()
            message = f"HTTP {resp.status_code} from {path}" + (f": {detail}" if detail else "")
            if resp.status_code in RETRY_STATUS:
                wait = (
                    retry_after_seconds(resp.headers.get("retry-after"))
                    if resp.status_code in RETRY_AFTER_STATUS
                    else None
                )
                raise _Retryable(message, wait)
            raise RuntimeError(message)
        try:
            return resp.json()
        except json.JSONDecodeError:
            raise RuntimeError(f"{path} returned a body that is not JSON: {resp.content[:200]!r}") from None

    def _first_model(self) -> str:
        try:
            listing = self._call("GET", "/models")
            return str(listing["data"][0]["id"])
        except (_Retryable, RuntimeError, KeyError, IndexError, TypeError) as exc:
            raise AnswerSetupError(
                f"no answer.model given and {self.base_url}/models lists none ({exc}); "
                "set answer.model or QRAG_ANSWER_MODEL"
            ) from None

    # -- answering --------------------------------------------------------------------------------

    def _one(self, request: ChatRequest) -> Answer:
        body = {"model": self.model, "messages": request.messages, "temperature": 0.0, "max_tokens": self.max_tokens}
        t0 = time.perf_counter()
        for attempt in range(1, self.retries + 2):
            try:
                reply = self._call("POST", "/chat/completions", body)
                try:
                    text = reply["choices"][0]["message"]["content"]
                except (KeyError, IndexError, TypeError):
                    raise RuntimeError(f"reply has no choices[0].message.content: {json.dumps(reply)[:200]}") from None
                if not isinstance(text, str):
                    raise RuntimeError(f"choices[0].message.content is {type(text).__name__}, not text")
                return Answer(request.id, text, seconds=time.perf_counter() - t0, attempts=attempt)
            except _Retryable as exc:
                if attempt > self.retries:
                    return Answer(
                        request.id, None, f"{exc} (after {attempt} attempts)", time.perf_counter() - t0, attempt
                    )
                if exc.retry_after is not None and exc.retry_after > self.retry_after_max_s:
                    return Answer(
                        request.id,
                        None,
                        f"{exc} (Retry-After {exc.retry_after:g} s is beyond answer.retry_after_max_s="
                        f"{self.retry_after_max_s:g})",
                        time.perf_counter() - t0,
                        attempt,
                    )
                time.sleep(self.backoff * 2 ** (attempt - 1) if exc.retry_after is None else exc.retry_after)
            except RuntimeError as exc:
                return Answer(request.id, None, str(exc), time.perf_counter() - t0, attempt)
        raise AssertionError("unreachable")

    def answer(self, requests: Sequence[ChatRequest]) -> list[Answer]:
        if not requests:
            return []
        answers = []
        with (
            ThreadPoolExecutor(
                max_workers=min(self.concurrency, len(requests)), thread_name_prefix="qrag-answer"
            ) as pool,
            progress.bar(len(requests), "answer", "q") as shown,
        ):
            for answer in pool.map(self._one, requests):
                answers.append(answer)
                shown.update()
        return answers
