"""`qrag export --format sentence-transformers`: the export loads with sentence_transformers and
its query/document vectors are the state/chunk encoder vectors qrag scores with."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT

pytest.importorskip("sentence_transformers")

QUESTIONS = ["Which river flows through the capital of France?", "Who painted the castle by the forest?"]
CHUNKS = [
    "Paris is the capital of France.",
    "The Seine flows through Paris and into the sea " * 8,
    "Bananas are yellow.",
]


def make_checkpoint(tmp_path, tiny_encoder, overrides: list[str]):
    from qrag.model.checkpoint import save_checkpoint, untrained_qnet
    from qrag.config import load_config

    cfg = load_config(
        None, [f"model.encoder={tiny_encoder}", "data.question_tokens=12", "data.chunk_tokens=24", *overrides]
    )
    qnet, tokenizer, _ = untrained_qnet(cfg.model, torch.device("cpu"))
    with torch.no_grad():  # the two encoders must differ, so that routing shows
        for p in qnet.action_encoder.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = save_checkpoint(tmp_path / "final", qnet, tokenizer, cfg)
    (tmp_path / "eval.json").write_text(json.dumps({"fact_em": 0.5, "fact_f1": 0.75, "num_samples": 4}))
    return path, cfg


def qrag_vectors(checkpoint, cfg):
    from qrag.model.checkpoint import load_qnet
    from qrag.retrieval.embedder import Tokenization
    from qrag.retrieval.search import Retriever

    qnet, tokenizer, layout, _ = load_qnet(checkpoint, torch.device("cpu"), with_targets=False)
    tok = Tokenization(tokenizer, layout, cfg.data.question_tokens)
    retriever = Retriever(qnet, layout, torch.device("cpu"))
    states = retriever.embed_states([tok.tokenize_question(q) for q in QUESTIONS]).numpy()
    chunks = retriever.embed_chunks(tok.tokenize_chunks(CHUNKS, cfg.data.chunk_tokens)).numpy()
    return states, chunks


@pytest.mark.parametrize(
    "overrides,remote_code",
    [([], True), (["model.similarity=cosine"], False), (["model.normalize=false"], False)],
    ids=["twin", "cosine", "raw"],
)
def test_export_gives_our_vectors(tmp_path, tiny_encoder, overrides, remote_code):
    from sentence_transformers import SentenceTransformer

    checkpoint, cfg = make_checkpoint(tmp_path, tiny_encoder, overrides)
    out = tmp_path / "st"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "qrag",
            "export",
            "--checkpoint",
            str(checkpoint),
            "--format",
            "sentence-transformers",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT / "platform"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    model = SentenceTransformer(str(out), trust_remote_code=remote_code, device="cpu")
    states, chunks = qrag_vectors(checkpoint, cfg)
    q = model.encode_query(QUESTIONS, convert_to_numpy=True)
    d = model.encode_document(CHUNKS, convert_to_numpy=True)
    np.testing.assert_allclose(q, states, atol=2e-5)
    np.testing.assert_allclose(d, chunks, atol=2e-5)  # the long chunk is cut at data.chunk_tokens, as in training
    assert not np.allclose(model.encode_document(QUESTIONS), q, atol=1e-3)  # two encoders, routed
    card = (out / "README.md").read_text()
    assert "fact_f1 | 0.75" in card and "data:" in card and "chunk_tokens: 24" in card
    assert ("trust_remote_code=True" in card) == remote_code


def test_export_refuses_positions(tmp_path, tiny_encoder):
    from qrag.model.checkpoint import CheckpointError
    from qrag.integrations.st_export import export_sentence_transformers

    checkpoint, _ = make_checkpoint(tmp_path, tiny_encoder, ["model.positions=relative"])
    with pytest.raises(CheckpointError, match="no chunk positions"):
        export_sentence_transformers(checkpoint, tmp_path / "st")
