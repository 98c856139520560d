"""The answerer interface and its OpenAI-compatible backend, against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import make_hotpot_records
from qrag.answers.backends import make_answerer
from qrag.answers.reader import (
    AnswerSetupError,
    ChatRequest,
    answer_records,
    attach_reader_inputs,
    clean_answer,
    load_prompt,
    parse_prompt,
    public_config,
)
from qrag.answers.openai_compat import OpenAIAnswerer
from qrag.config import AnswerConfig
from qrag.data.sample import Sample


class FakeChatServer:
    """An OpenAI-compatible chat endpoint. The reply depends on the question in the prompt:
    known questions get their gold answer; "SLOW" sleeps past any test timeout, "FAIL500"
    always fails, "FLAKY" fails with 503 once per question, "BAD400" is a client error."""

    def __init__(self, answers: dict[str, str] | None = None, delay: float = 0.0):
        self.answers = answers or {}
        self.delay = delay
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.flaky_seen: set[str] = set()
        self.fail: set[str] = set()  # questions that always get HTTP 500
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def _send(self, code: int, body: dict):
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                try:
                    self.wfile.write(raw)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": "fake-reader", "object": "model"}]})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                if self.path != "/v1/chat/completions":
                    self._send(404, {"error": "not found"})
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(body)
                    server.headers.append(dict(self.headers))
                prompt = body["messages"][-1]["content"]
                question = prompt.rsplit("Question:", 1)[-1].split("\n")[0].strip()
                if "SLOW" in question:
                    time.sleep(3.0)
                elif server.delay:
                    time.sleep(server.delay)
                if "FAIL500" in question or question in server.fail:
                    self._send(500, {"error": "internal"})
                    return
                if "BAD400" in question:
                    self._send(400, {"error": {"message": "bad request: context too long"}})
                    return
                if "FLAKY" in question:
                    with server.lock:
                        first = question not in server.flaky_seen
                        server.flaky_seen.add(question)
                    if first:
                        self._send(503, {"error": "busy"})
                        return
                text = server.answers.get(question, "I do not know")
                self._send(
                    200,
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "model": body["model"],
                        "choices": [
                            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                        ],
                    },
                )

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def _records(questions: list[tuple[str, str]]) -> list[dict]:
    return [
        {"id": f"r{i}", "question": q, "passages": [f"Passage about {q}."], "gold_answers": [a]}
        for i, (q, a) in enumerate(questions)
    ]


def test_openai_backend_scores_answers_and_counts_errors_separately():
    questions = [
        ("Who wrote Hamlet?", "William Shakespeare"),
        ("Capital of France?", "Paris"),
        ("FLAKY capital of Spain?", "Madrid"),
        ("SLOW question?", "x"),
        ("FAIL500 question?", "y"),
        ("BAD400 question?", "z"),
        ("Unknown question?", "Berlin"),
    ]
    answers = {q: f"Answer: {a}." for q, a in questions[:3]}
    with FakeChatServer(answers) as server:
        reader = OpenAIAnswerer(
            server.url, api_key="sk-test", timeout=0.8, retries=1, concurrency=4, max_tokens=16, backoff=0.05
        )
        assert reader.model == "fake-reader"  # taken from GET /v1/models
        records = _records(questions)
        summary = answer_records(records, reader, load_prompt("", "hotpotqa"), "hotpotqa")
    by_q = {r["question"]: r for r in records}
    # Errors: the slow one timed out, 500 exhausted its retry, 400 is not retried.
    assert summary["answer_errors"] == 3 and summary["answered"] == 4
    assert "timed out" in by_q["SLOW question?"]["answer_error"]
    assert (
        "HTTP 500" in by_q["FAIL500 question?"]["answer_error"]
        and "2 attempts" in by_q["FAIL500 question?"]["answer_error"]
    )
    assert (
        "HTTP 400" in by_q["BAD400 question?"]["answer_error"]
        and "context too long" in by_q["BAD400 question?"]["answer_error"]
    )
    for q in ("SLOW question?", "FAIL500 question?", "BAD400 question?"):
        assert by_q[q]["ans_em"] is None and by_q[q]["prediction"] is None
    # The flaky one succeeded on its retry; failed questions are not scored as wrong answers.
    assert (
        by_q["FLAKY capital of Spain?"]["prediction"] == "Madrid" and by_q["FLAKY capital of Spain?"]["ans_em"] == 1.0
    )
    assert summary["ans_em"] == pytest.approx(3 / 4)  # 3 right, "Unknown question?" wrong, errors excluded
    assert by_q["Who wrote Hamlet?"]["reader_output"] == "Answer: William Shakespeare."
    assert "fake-reader" in summary["reader_model"] and summary["prompt"] == "hotpotqa"
    # What went over the wire: greedy decoding, the model, the key, the prompt with passage and question.
    body = server.requests[0]
    assert body["temperature"] == 0.0 and body["model"] == "fake-reader" and body["max_tokens"] == 16
    assert any(h.get("Authorization") == "Bearer sk-test" for h in server.headers)
    user = body["messages"][-1]["content"]
    assert "Passage about" in user and "Question:" in user


def test_openai_requests_run_concurrently():
    questions = [(f"Question number {i}?", str(i)) for i in range(8)]
    with FakeChatServer({q: a for q, a in questions}, delay=0.5) as server:
        reader = OpenAIAnswerer(server.url, model="m", timeout=10, concurrency=8)
        t0 = time.perf_counter()
        answers = reader.answer(
            [ChatRequest(str(i), [{"role": "user", "content": f"Question: {q}"}]) for i, (q, _) in enumerate(questions)]
        )
        elapsed = time.perf_counter() - t0
    assert [a.text for a in answers] == [a for _, a in questions]  # answers come back in request order
    assert elapsed < 8 * 0.5 / 2, elapsed  # serial would take 4 s


def test_openai_setup_errors_are_clear(monkeypatch):
    monkeypatch.delenv("QRAG_ANSWER_BASE_URL", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(AnswerSetupError, match="needs an endpoint"):
        make_answerer(AnswerConfig(), "openai")
    with pytest.raises(AnswerSetupError, match="unknown answer backend"):
        make_answerer(AnswerConfig(), "gpt")
    assert make_answerer(AnswerConfig(), "none") is None
    # Nothing listens on this port: no model can be discovered.
    with pytest.raises(AnswerSetupError, match="set answer.model"):
        OpenAIAnswerer("http://127.0.0.1:9/v1", timeout=1, retries=0)
    # With a model named, an unreachable endpoint is a per-question error, not a crash.
    reader = OpenAIAnswerer("http://127.0.0.1:9/v1", model="m", timeout=1, retries=1, backoff=0.01)
    [ans] = reader.answer([ChatRequest("a", [{"role": "user", "content": "hi"}])])
    assert ans.text is None and "cannot reach" in ans.error and ans.attempts == 2


def test_env_configures_the_endpoint(monkeypatch):
    with FakeChatServer() as server:
        monkeypatch.setenv("QRAG_ANSWER_BASE_URL", server.url)
        monkeypatch.setenv("QRAG_ANSWER_MODEL", "from-env")
        monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
        reader = make_answerer(AnswerConfig(), "openai")
        reader.answer([ChatRequest("a", [{"role": "user", "content": "Question: x"}])])
    assert reader.model == "from-env" and server.requests[0]["model"] == "from-env"
    assert server.headers[0].get("Authorization") == "Bearer sk-env"


def test_eval_with_openai_reader_end_to_end(tiny_encoder, hotpot_file, tmp_path):
    """qrag eval --answer openai: ans_em/ans_f1 in the summary, answers in the records; a question
    whose request fails is counted in answer_errors and left out of the scores."""
    from qrag.cli import main

    records = make_hotpot_records(60)  # the same records as the hotpot_file fixture
    answers = {r["question"]: r["answer"] for r in records}
    failing = records[0]["question"]
    with FakeChatServer(answers) as server:
        server.fail.add(failing)  # this question's request always fails on the server side
        out = tmp_path / "eval.json"
        args = [
            "eval",
            "--checkpoint",
            "none",
            f"model.encoder={tiny_encoder}",
            f"data.path={hotpot_file}",
            "data.chunk_tokens=48",
            "--split",
            "all",
            "--limit",
            "5",
            "--device",
            "cpu",
            "--answer",
            "openai",
            "--out",
            str(out),
            f"answer.base_url={server.url}",
            "answer.model=fake-reader",
            "answer.api_key=sk-secret",
            "answer.retries=0",
        ]
        assert main(args) == 0
    summary = json.loads(out.read_text())
    recs = [json.loads(line) for line in (tmp_path / "eval.records.jsonl").read_text().splitlines()]
    assert summary["num_samples"] == 5 and "fact_f1" in summary
    assert summary["reader_model"].startswith("fake-reader") and summary["answer"]["backend"] == "openai"
    assert "sk-secret" not in out.read_text()  # the key never reaches the outputs
    for rec in recs:
        assert rec["passages"] and rec["gold_answers"] == [rec["answer"]] and "retrieved" in rec
    assert recs[0]["question"] == failing and "HTTP 500" in recs[0]["answer_error"]
    assert summary["answer_errors"] == 1 and summary["answered"] == 4
    assert summary["ans_em"] == 1.0 and summary["ans_f1"] == 1.0  # every answered question was right


def test_prompts_are_files_with_placeholders(tmp_path):
    for name in ("hotpotqa", "musique", "2wiki", "babilong", "niah", "default"):
        tpl = load_prompt(name, "x")
        msgs = tpl.messages("Who {braces}?", ["first passage", "second passage"])
        text = "\n".join(m["content"] for m in msgs)
        assert "Who {braces}?" in text and "first passage" in text and "{passages}" not in text
        assert text.index("first passage") < text.index("second passage")
    assert load_prompt("", "musique").name == "musique"
    assert load_prompt("", "jsonl").name == "default"  # datasets without a prompt of their own
    with pytest.raises(AnswerSetupError, match="unknown prompt 'nope'"):
        load_prompt("nope", "hotpotqa")
    custom = tmp_path / "mine.txt"
    custom.write_text("[user]\nContext: {passages}\nQ: {question}\n")
    tpl = load_prompt(str(custom), "hotpotqa")
    assert tpl.system == "" and tpl.messages("q?", ["p"]) == [{"role": "user", "content": "Context: p\nQ: q?"}]
    with pytest.raises(AnswerSetupError, match="needs"):
        parse_prompt("[user]\nno placeholders here\n", "bad")
    with pytest.raises(AnswerSetupError, match="section header"):
        parse_prompt("just text {question} {passages}", "bad")


def test_clean_answer():
    assert clean_answer("Answer: Paris.\nBecause ...") == "Paris"
    assert clean_answer("It is 3.5") == "It is 3.5"
    assert clean_answer('\n\n  "Berlin"  \n') == "Berlin"
    assert clean_answer("final answer - yes") == "yes"
    assert clean_answer("The answer to this question is: William Shakespeare") == "William Shakespeare"
    assert clean_answer("The answer is Rex.") == "Rex"
    assert clean_answer("Answers vary") == "Answers vary"
    assert clean_answer("") == ""


def test_reader_inputs_are_document_ordered_whole_passages():
    sample = Sample(
        "s1",
        "q?",
        ["c0", "c1 capped", "c2", "c3"],
        [1, 3],
        "Gold",
        meta={"passages": ["p0", "p1 whole paragraph", "p2", "p3"], "answer_aliases": ["Gold", "Alias"]},
    )
    records = [{"id": "s1", "question": "q?", "retrieved": [3, 1]}]
    attach_reader_inputs(records, [sample])
    assert records[0]["passages"] == ["p1 whole paragraph", "p3"]  # document order, not pick order
    assert records[0]["gold_answers"] == ["Gold", "Alias"]
    attach_reader_inputs(records, [sample], full_passages=False)
    assert records[0]["passages"] == ["c1 capped", "c3"]
    with pytest.raises(ValueError, match="attach_reader_inputs"):
        answer_records([{"id": "x", "question": "q"}], None, load_prompt("", "hotpotqa"), "hotpotqa")  # type: ignore[arg-type]


def test_public_config_drops_the_key():
    cfg = AnswerConfig(api_key="sk-123", base_url="http://127.0.0.1:1/v1")
    out = public_config(cfg, "openai")
    assert "api_key" not in out and out["backend"] == "openai" and out["base_url"] == cfg.base_url
