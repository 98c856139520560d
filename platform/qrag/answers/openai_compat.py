"""The ``openai`` reader backend: any OpenAI-compatible ``/v1/chat/completions`` endpoint (vLLM,
llama.cpp's server, a hosted API).

Greedy (temperature 0). Requests run on a thread pool (``answer.concurrency`` in flight). A
timeout, a connection error, HTTP 429 or 5xx is retried ``answer.retries`` times with exponential
back-off; any other failure, or the last retry's, becomes that question's error. Standard library
only (urllib), so the reader adds no dependency.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from qrag.config import AnswerConfig
from qrag.answers.reader import Answer, AnswerSetupError, ChatRequest

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class _Retryable(Exception):
    pass


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
    ):
        if not base_url.startswith(("http://", "https://")):
            raise AnswerSetupError(f"answer.base_url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout, self.retries, self.backoff = timeout, max(0, retries), backoff
        self.concurrency, self.max_tokens = max(1, concurrency), max_tokens
        self.model = model or self._first_model()
        self.name = f"{self.model} (OpenAI-compatible endpoint {self.base_url})"

    @classmethod
    def from_config(cls, cfg: AnswerConfig) -> "OpenAIAnswerer":
        base_url = cfg.base_url or os.environ.get("QRAG_ANSWER_BASE_URL") or os.environ.get("OPENAI_BASE_URL")
        if not base_url:
            raise AnswerSetupError("the openai answer backend needs an endpoint: set answer.base_url=http://HOST:PORT/v1 "
                                   "or QRAG_ANSWER_BASE_URL / OPENAI_BASE_URL")
        return cls(base_url, cfg.model or os.environ.get("QRAG_ANSWER_MODEL"), cfg.api_key or os.environ.get("OPENAI_API_KEY"),
                   timeout=cfg.timeout, retries=cfg.retries, concurrency=cfg.concurrency, max_tokens=cfg.max_tokens)

    # -- HTTP -------------------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One HTTP exchange; raises _Retryable for transient failures, RuntimeError otherwise."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, headers=self._headers(), method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode("utf-8", "replace").strip()
            message = f"HTTP {exc.code} from {path}" + (f": {detail}" if detail else "")
            if exc.code in RETRY_STATUS:
                raise _Retryable(message) from None
            raise RuntimeError(message) from None
        except (TimeoutError, socket.timeout):
            raise _Retryable(f"timed out after {self.timeout:g} s") from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, (TimeoutError, socket.timeout)):
                raise _Retryable(f"timed out after {self.timeout:g} s") from None
            raise _Retryable(f"cannot reach {self.base_url}: {exc.reason}") from None
        except (ConnectionError, OSError) as exc:
            raise _Retryable(f"connection to {self.base_url} failed: {exc}") from None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise RuntimeError(f"{path} returned a body that is not JSON: {raw[:200]!r}") from None

    def _first_model(self) -> str:
        try:
            listing = self._call("GET", "/models")
            return str(listing["data"][0]["id"])
        except (_Retryable, RuntimeError, KeyError, IndexError, TypeError) as exc:
            raise AnswerSetupError(f"no answer.model given and {self.base_url}/models lists none ({exc}); "
                                   "set answer.model or QRAG_ANSWER_MODEL") from None

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
                    return Answer(request.id, None, f"{exc} (after {attempt} attempts)", time.perf_counter() - t0, attempt)
                time.sleep(self.backoff * 2 ** (attempt - 1))
            except RuntimeError as exc:
                return Answer(request.id, None, str(exc), time.perf_counter() - t0, attempt)
        raise AssertionError("unreachable")

    def answer(self, requests: Sequence[ChatRequest]) -> list[Answer]:
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(requests)), thread_name_prefix="qrag-answer") as pool:
            return list(pool.map(self._one, requests))
