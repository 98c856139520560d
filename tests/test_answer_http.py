"""The OpenAI-compatible reader over HTTP/1.1 on 127.0.0.1: one kept-alive connection per request
in flight (not one per question), and ``Retry-After`` on 429/503 honoured with bounded retries."""

from __future__ import annotations

import email.utils
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from qrag.answers.openai_compat import OpenAIAnswerer, retry_after_seconds
from qrag.answers.reader import ChatRequest
from test_answer import FakeChatServer  # its start and stop


class KeepAliveServer(FakeChatServer):
    """A chat endpoint speaking HTTP/1.1 (connections stay open). ``busy[q]``: (status, Retry-After
    header) answered to question ``q`` that many times first; every request and connection is recorded."""

    def __init__(self, busy: dict[str, tuple[int, str | None, int]] | None = None):
        self.busy = dict(busy or {})
        self.connections = 0
        self.times: dict[str, list[float]] = {}
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def setup(self):
                super().setup()
                with server.lock:
                    server.connections += 1

            def _send(self, code: int, body: dict, headers: dict[str, str] | None = None):
                raw = json.dumps(body).encode()
                self.send_response(code)
                for k, v in {
                    "Content-Type": "application/json",
                    "Content-Length": str(len(raw)),
                    **(headers or {}),
                }.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(raw)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                question = body["messages"][-1]["content"]
                with server.lock:
                    server.times.setdefault(question, []).append(time.monotonic())
                    status, retry_after, left = server.busy.get(question, (200, None, 0))
                    if left:
                        server.busy[question] = (status, retry_after, left - 1)
                if left:
                    self._send(status, {"error": "busy"}, {"Retry-After": retry_after} if retry_after else None)
                    return
                self._send(
                    200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": f"re: {question}"}}]}
                )

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)


def ask(*questions: str) -> list[ChatRequest]:
    return [ChatRequest(str(i), [{"role": "user", "content": q}]) for i, q in enumerate(questions)]


def test_connections_are_kept_alive():
    with KeepAliveServer() as server:
        reader = OpenAIAnswerer(server.url, model="m", concurrency=1)
        answers = reader.answer(ask(*(f"q{i}" for i in range(12))))
        answers += reader.answer(ask("again"))  # a later call reuses the same connection too
        reader.close()
    assert [a.text for a in answers] == [f"re: q{i}" for i in range(12)] + ["re: again"]
    assert server.connections == 1


def test_concurrent_requests_use_at_most_concurrency_connections():
    with KeepAliveServer() as server:
        reader = OpenAIAnswerer(server.url, model="m", concurrency=3)
        assert all(a.text for a in reader.answer(ask(*(f"q{i}" for i in range(30)))))
        reader.close()
    assert 1 <= server.connections <= 3


@pytest.mark.parametrize("status", [429, 503])
def test_retry_after_is_waited_for(status):
    """backoff is tiny: the ~1 s between the two attempts is the server's Retry-After."""
    with KeepAliveServer({"busy": (status, "1", 1)}) as server:
        reader = OpenAIAnswerer(server.url, model="m", retries=2, backoff=0.01)
        [answer] = reader.answer(ask("busy"))
    first, second = server.times["busy"]
    assert answer.text == "re: busy" and answer.attempts == 2
    assert second - first >= 0.95


def test_retry_after_as_an_http_date():
    assert retry_after_seconds("7") == 7.0
    assert retry_after_seconds(None) is None and retry_after_seconds("soon") is None
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 28 <= retry_after_seconds(later) <= 31
    assert retry_after_seconds(email.utils.formatdate(time.time() - 30, usegmt=True)) == 0.0


def test_retries_are_bounded_and_a_long_retry_after_fails_at_once():
    with KeepAliveServer({"always": (429, "0", 99), "later": (503, "3600", 99)}) as server:
        reader = OpenAIAnswerer(server.url, model="m", retries=2, backoff=0.01, retry_after_max_s=5)
        t0 = time.monotonic()
        always, later = reader.answer(ask("always", "later"))
        elapsed = time.monotonic() - t0
    assert always.text is None and always.attempts == 3 and "HTTP 429" in always.error and "3 attempts" in always.error
    assert (
        later.text is None
        and later.attempts == 1
        and "Retry-After 3600 s is beyond answer.retry_after_max_s=5" in later.error
    )
    assert len(server.times["always"]) == 3 and len(server.times["later"]) == 1
    assert elapsed < 3
