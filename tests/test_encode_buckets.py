"""Length bucketing of ``encode``: every sequence once, batches within ``max_tokens``, and a batch cut
where the next sequence would be padded too far, though never into batches below ``min_tokens``."""

import numpy as np
import pytest
import torch

from qrag.model.encoder import (
    BUCKET_MIN_SHARE,
    BUCKET_SPLIT_RATIO,
    EncodeStats,
    _bucket,
    encode,
    load_encoder,
    load_tokenizer,
    split_ratio_for,
)

CPU = torch.device("cpu")
MULTIPLE = 8


def widths(lengths: np.ndarray) -> np.ndarray:
    return -(-np.asarray(lengths) // MULTIPLE) * MULTIPLE


def padded(lengths: np.ndarray, batch: np.ndarray) -> int:
    return int(widths(lengths[batch]).max()) * len(batch)


def old_rule(lengths: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """The rule before the padding split: only ``max_tokens`` cut a batch."""
    order = np.argsort(-lengths, kind="stable")
    batches, start = [], 0
    while start < len(order):
        size = max(1, max_tokens // max(int(widths(lengths[order[start]])), 1))
        batches.append(order[start : start + size])
        start += size
    return batches


def hotpot_micro_batch(seed: int = 0, n: int = 160) -> np.ndarray:
    """The paragraphs of a small training micro-batch: ~10 per question, 20 to 220 tokens."""
    return np.random.default_rng(seed).integers(20, 221, size=n)


CASES = [
    (hotpot_micro_batch(), 32768),
    (hotpot_micro_batch(1, 2560), 32768),
    (np.random.default_rng(2).integers(1, 600, size=500), 4096),
    (np.array([5000, 12, 3, 3000, 7, 0, 900]), 2048),  # longer than max_tokens: alone
    (np.array([0, 0, 1]), 64),
    (np.array([], dtype=np.int64), 32768),
]


@pytest.mark.parametrize("lengths,max_tokens", CASES)
@pytest.mark.parametrize("settings", [{}, {"ratio": 0.0}, {"ratio": 0.9, "min_tokens": 0}, {"min_tokens": 10**9}])
def test_every_sequence_once_and_no_batch_over_max_tokens(lengths, max_tokens, settings):
    batches = _bucket(lengths, max_tokens, **settings)
    got = np.concatenate(batches) if batches else np.zeros(0, np.int64)
    assert sorted(got.tolist()) == list(range(len(lengths)))
    for b in batches:
        assert len(b) > 0
        assert padded(lengths, b) <= max_tokens or len(b) == 1


@pytest.mark.parametrize("lengths,max_tokens", CASES)
def test_the_default_split_keeps_the_old_order_and_cap(lengths, max_tokens):
    """The batches are the old ones cut further: the same sequence order, and ``ratio=0`` is the old rule."""
    new, old = _bucket(lengths, max_tokens), old_rule(lengths, max_tokens)
    flat = np.concatenate(new) if new else np.zeros(0, np.int64)
    assert flat.tolist() == (np.concatenate(old) if old else flat).tolist()
    assert [b.tolist() for b in _bucket(lengths, max_tokens, ratio=0.0)] == [b.tolist() for b in old]


@pytest.mark.parametrize("lengths,max_tokens", CASES)
@pytest.mark.parametrize("ratio,min_tokens", [(BUCKET_SPLIT_RATIO, None), (0.9, 256), (0.5, 0)])
def test_a_batch_holds_a_much_shorter_sequence_only_while_below_min_tokens(lengths, max_tokens, ratio, min_tokens):
    floor = max_tokens // BUCKET_MIN_SHARE if min_tokens is None else min_tokens
    batches = _bucket(lengths, max_tokens, ratio=ratio, min_tokens=min_tokens)
    for k, b in enumerate(batches):
        w = widths(lengths[b])
        longest = max(int(w[0]), 1)
        assert (np.diff(w) <= 0).all()  # longest first
        for j in range(1, len(b)):
            assert w[j] >= ratio * longest or j * longest < floor, (k, j)
        if k < len(batches) - 1:
            # no batch but the last below the floor (or it would have taken the next sequence)
            assert padded(lengths, b) >= min(floor, max_tokens - longest + 1)


def test_a_small_micro_batch_is_no_longer_one_batch_padded_to_its_longest():
    lengths = hotpot_micro_batch()
    real = lengths.sum()
    old = sum(padded(lengths, b) for b in old_rule(lengths, 32768)) / real
    batches = _bucket(lengths, 32768)
    new = sum(padded(lengths, b) for b in batches) / real
    assert old > 1.5
    assert new < 1.25
    assert len(batches) <= 8  # a few forwards, not a forward per length
    assert min(padded(lengths, b) for b in batches[:-1]) >= 32768 // BUCKET_MIN_SHARE


def test_the_two_argument_call_still_works():
    lengths = np.array([10, 200, 30])
    assert sorted(np.concatenate(_bucket(lengths, 32768)).tolist()) == [0, 1, 2]
    assert [b.tolist() for b in _bucket(lengths, 32768, 8)] == [b.tolist() for b in _bucket(lengths, 32768)]
    assert sorted(np.concatenate(_bucket([3, 1, 2], 64)).tolist()) == [0, 1, 2]  # a plain list too


@pytest.mark.parametrize("arch", ["bert", "mpnet"])
def test_split_batches_give_each_sequence_its_own_vector_in_input_order(tiny_encoder, tiny_mpnet, arch):
    path = {"bert": tiny_encoder, "mpnet": tiny_mpnet}[arch]
    model = load_encoder(path).eval()
    pad_id = load_tokenizer(path).pad_token_id
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1000, 2000, size=n).astype(np.int64) for n in rng.integers(2, 64, size=40)]
    lengths = np.array([len(s) for s in seqs])
    max_tokens = 640
    batches = _bucket(lengths, max_tokens)
    assert len(batches) > len(old_rule(lengths, max_tokens))  # the padding split really cuts here
    with torch.no_grad():
        got = encode(model, seqs, pad_id=pad_id, device=CPU, max_tokens=max_tokens)
        alone = torch.cat([encode(model, [s], pad_id=pad_id, device=CPU) for s in seqs])
    assert got.shape == alone.shape
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-4)


def test_the_cut_is_on_for_the_cpu_and_off_for_gpus():
    """A GPU runs a small micro-batch's forward in launch time: there the cut halved training's
    episodes/s (bench/results/encode_buckets_gpu_h200.json) while it tripled the CPU's."""
    assert split_ratio_for(CPU) == BUCKET_SPLIT_RATIO > 0
    assert split_ratio_for(torch.device("cuda", 0)) == 0.0
    assert split_ratio_for(torch.device("mps")) == 0.0


def test_encode_batches_by_its_devices_rule(tiny_encoder, monkeypatch):
    import qrag.model.encoder as encoder_module

    model = load_encoder(tiny_encoder).eval()
    pad_id = load_tokenizer(tiny_encoder).pad_token_id
    rng = np.random.default_rng(1)
    seqs = [rng.integers(1000, 2000, size=n).astype(np.int64) for n in rng.integers(2, 64, size=40)]
    lengths = np.array([len(s) for s in seqs])

    def padded_by_encode() -> int:
        stats = EncodeStats()
        with torch.no_grad():
            encode(model, seqs, pad_id=pad_id, device=CPU, max_tokens=640, stats=stats)
        return stats.padded_tokens

    cut = sum(padded(lengths, b) for b in _bucket(lengths, 640))
    old = sum(padded(lengths, b) for b in old_rule(lengths, 640))
    assert cut < old and padded_by_encode() == cut
    monkeypatch.setattr(encoder_module, "split_ratio_for", lambda device: 0.0)  # as on a GPU
    assert padded_by_encode() == old


def test_the_training_bench_measures_the_cut_both_ways(tiny_encoder, tmp_path):
    """`bench/train_speed.py --split-ratio`: the same episodes with the cut off and on, so another
    machine or encoder can be measured with the documented command; `--profile` beside it."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from conftest import make_hotpot_records

    root = Path(__file__).resolve().parents[1]
    records = make_hotpot_records(40, paragraphs=10)
    for record in records:  # paragraphs of 10 to 190 words, as HotpotQA's vary
        for k, (_, sentences) in enumerate(record["context"]):
            sentences[1] += " and more" * (5 + 20 * k)
    hotpot_file = tmp_path / "varied.json"
    hotpot_file.write_text(json.dumps(records))

    def speed(ratio: str) -> dict:
        out = tmp_path / f"speed_{ratio}.json"
        argv = ["--config", "configs/hotpot.yaml", "--updates", "1", "--warmup", "0", "--timed", "0", "--profile", "1"]
        argv += ["--split-ratio", ratio, "--out", str(out), f"model.encoder={tiny_encoder}", f"data.path={hotpot_file}"]
        argv += ["learner.objective=sft", "learner.episodes_per_update=16", "learner.micro_batch=16", "device=cpu"]
        env = {**os.environ, "PYTHONPATH": str(root / "platform")}
        done = subprocess.run(
            [sys.executable, "bench/train_speed.py", *argv], cwd=root, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(out.read_text())

    off, on = speed("0"), speed("0.75")
    assert off["split_ratio"] == 0.0 and on["split_ratio"] == 0.75
    assert on["padding_overhead"] < off["padding_overhead"]
    # --profile: one more update under torch.profiler (bench/step_profile.py), reduced to its breakdown
    prof = on["profile"]
    assert prof["updates"] == 1 and prof["wall_s_per_update"] > 0
    assert prof["gpu_busy_share"] is None  # no GPU here: said, not made up
    ops = {row["op"] for row in prof["top_host_ops"]}
    # The encoders ran in it: one of their operators is among the top 15 by host time (which ones rank
    # there moves with the machine's load; with the loss's passes shared, the matmuls can drop out).
    encoder_ops = ("addmm", "linear", "matmul", "softmax", "layer_norm", "gelu")
    assert any(name in op for op in ops for name in encoder_ops), ops
    assert 0 < prof["host_self_s_per_update"] <= prof["wall_s_per_update"] * 1.05
