"""The Arrow cache of chunked, tokenised splits (qrag.data.prepared): same data as a fresh load,
keyed by tokenizer and chunk settings, rebuilt when a source file changes, sharded for runners."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("datasets")

from qrag.config import DataConfig  # noqa: E402
from qrag.data import load_samples  # noqa: E402
from qrag.data import prepared  # noqa: E402
from qrag.data.chunking import tokenizer_counter  # noqa: E402
from qrag.data.splits import split_validation  # noqa: E402
from qrag.data.tokens import TokenLayout, tokenize_samples  # noqa: E402

from conftest import make_hotpot_records  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    from qrag.model.encoder import bundled_minilm_dir, load_tokenizer

    return load_tokenizer(str(bundled_minilm_dir()))


@pytest.fixture
def setup(tmp_path, tok):
    path = tmp_path / "h.json"
    path.write_text(json.dumps(make_hotpot_records(30)))
    cfg = DataConfig(path=str(path), chunk_tokens=24, cache_dir=str(tmp_path / "cache"))
    return cfg, tok, TokenLayout.from_tokenizer(tok, 128)


def fresh(cfg, split, tok, layout):
    samples = load_samples(cfg, split, tokenizer_counter(tok))
    return samples, tokenize_samples(
        samples, tok, layout, chunk_tokens=cfg.chunk_tokens, question_tokens=cfg.question_tokens
    )


def same_tokens(a, b):
    assert [x.id for x in a] == [y.id for y in b]
    for x, y in zip(a, b):
        assert np.array_equal(x.question, y.question) and x.question.dtype == y.question.dtype == np.int32
        assert len(x.chunks) == len(y.chunks)
        assert all(np.array_equal(c, d) and d.dtype == np.int32 for c, d in zip(x.chunks, y.chunks))
        assert np.array_equal(x.support, y.support) and y.support.dtype == np.int64


def test_cached_split_equals_a_fresh_load_and_is_read_back(setup, monkeypatch):
    cfg, tok, layout = setup
    samples, tokenized = fresh(cfg, "train", tok, layout)
    built = prepared.prepare_split(cfg, "train", tok, layout)
    assert [s.__dict__ for s in built.samples()] == [s.__dict__ for s in samples]
    same_tokens(tokenized, built.tokenized())
    [entry] = (p for p in (prepared.cache_folder(cfg)).iterdir() if not p.name.startswith("."))
    assert json.loads((entry / "qrag_manifest.json").read_text())["sources"] == {cfg.path: prepared._stat(cfg.path)}

    def no_loading(*args, **kwargs):
        raise AssertionError("a cached split must not be parsed or tokenised again")

    monkeypatch.setattr(prepared, "load_samples", no_loading)
    monkeypatch.setattr(prepared, "tokenize_samples", no_loading)
    hit = prepared.prepare_split(cfg, "train", tok, layout)
    assert [s.__dict__ for s in hit.samples()] == [s.__dict__ for s in samples]
    same_tokens(tokenized, hit.tokenized())
    # validation part and runner shards: the same draws as the list-based code
    train, val = hit.split_validation(0.3)
    want_train, want_val = split_validation(samples, 0.3)
    assert [s.id for s in train.samples()] == [s.id for s in want_train] and [s.id for s in val.samples()] == [
        s.id for s in want_val
    ]
    for index in range(3):
        assert [t.id for t in train.shard(3, index).tokenized()] == [s.id for s in want_train[index::3]]


def test_key_follows_tokenizer_chunking_and_source_files(setup):
    cfg, tok, layout = setup
    key = prepared.cache_key(cfg, "train", tok, layout)
    assert key == prepared.cache_key(DataConfig(**{**cfg.__dict__, "val_fraction": 0.5}), "train", tok, layout)
    assert key != prepared.cache_key(DataConfig(**{**cfg.__dict__, "chunk_tokens": 25}), "train", tok, layout)
    assert key != prepared.cache_key(cfg, "dev", tok, layout)
    other = type(tok).from_pretrained(tok.name_or_path)
    other.add_tokens(["qragnewtoken"])
    assert prepared.tokenizer_fingerprint(other) != prepared.tokenizer_fingerprint(tok)
    # a changed source file rebuilds the entry
    first = prepared.prepare_split(cfg, "train", tok, layout)
    records = make_hotpot_records(30)
    target = first.samples()[0].id
    next(r for r in records if r["_id"] == target)["question"] = "A changed question?"
    with open(cfg.path, "w") as fh:
        fh.write(json.dumps(records))
    again = prepared.prepare_split(cfg, "train", tok, layout)
    assert again.samples()[0].question == "A changed question?" and len(again) == len(first)


def test_cache_off_is_a_fresh_load(setup):
    cfg, tok, layout = setup
    off = DataConfig(**{**cfg.__dict__, "cache_dir": "none"})
    split = prepared.prepare_split(off, "dev", tok, layout)
    assert prepared.cache_folder(off) is None and not (prepared.cache_folder(cfg)).exists()
    same_tokens(fresh(cfg, "dev", tok, layout)[1], split.tokenized())


def test_the_arrow_table_gets_our_fingerprint_not_dills(setup, monkeypatch):
    """A cached split's table is fingerprinted from its own buffers: hashing it through datasets'
    Hasher (dill) disassembled functions on the way, and a Ray Train worker printed the bytecode."""
    import datasets.fingerprint

    def no_dill(*args, **kwargs):
        raise AssertionError("the table was hashed through datasets' Hasher")

    monkeypatch.setattr(datasets.fingerprint.Hasher, "hash", no_dill)
    cfg, tok, layout = setup
    samples, tokenized = fresh(cfg, "train", tok, layout)
    a = prepared._to_table(samples, tokenized)
    assert a._fingerprint == prepared._to_table(samples, tokenized)._fingerprint  # the same rows, the same print
    other = [dataclasses.replace(samples[0], question=samples[0].question + "?"), *samples[1:]]
    assert prepared._to_table(other, tokenized)._fingerprint != a._fingerprint
    assert a.num_rows == len(samples) and a[0]["id"] == samples[0].id
