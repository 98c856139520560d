"""The bucketed state encoder (CUDA graphs on GPU) gives the vectors of the plain encoder."""

import numpy as np
import pytest
import torch

from qrag.model.checkpoint import untrained_qnet
from qrag.config import ModelConfig
from qrag.model.encoder import encode
from qrag.model.state_graphs import GraphedEncoder, bucket_of

CPU = torch.device("cpu")


def test_bucket_of_picks_the_smallest_bucket_that_holds_the_value():
    assert bucket_of(1, (1, 2, 4)) == 1
    assert bucket_of(3, (1, 2, 4)) == 4
    assert bucket_of(5, (1, 2, 4)) is None


@pytest.mark.parametrize("similarity,arch", [("twin", "bert"), ("cosine", "bert"), ("twin", "mpnet")])
def test_padded_buckets_give_the_plain_encoder_vectors(tiny_encoder, tiny_mpnet, similarity, arch):
    """MPNet runs eager attention, which adds the mask to the scores: a boolean mask there let the
    padded tokens in (a wrong vector for every padded state)."""
    encoder = {"bert": tiny_encoder, "mpnet": tiny_mpnet}[arch]
    qnet, tok, layout = untrained_qnet(
        ModelConfig(encoder=encoder, positions="relative", similarity=similarity), CPU, use_target=False
    )
    qnet.eval()
    rng = np.random.default_rng(0)
    # 5 states (bucket 8: three padding rows) of mixed lengths (bucket 64: padded columns).
    seqs = [rng.integers(1000, 2000, size=n).astype(np.int64) for n in (7, 40, 33, 12, 50)]
    enc = GraphedEncoder(qnet, layout.pad_id, CPU, batch_buckets=(1, 2, 4, 8), length_buckets=(16, 64))
    got = enc(seqs)
    with torch.no_grad():
        want = qnet.finish(encode(qnet.state_encoder, seqs, pad_id=layout.pad_id, device=CPU))
        alone = torch.cat(
            [qnet.finish(encode(qnet.state_encoder, [s], pad_id=layout.pad_id, device=CPU)) for s in seqs]
        )
    torch.testing.assert_close(want, alone, atol=2e-5, rtol=1e-4)  # padding changes no vector
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert enc.eager_calls == 1 and enc.replays == 0  # CPU: the same padded forward, eagerly


def test_more_states_than_the_largest_batch_are_split_in_order(tiny_encoder):
    qnet, tok, layout = untrained_qnet(ModelConfig(encoder=tiny_encoder), CPU, use_target=False)
    qnet.eval()
    seqs = [np.arange(5, 5 + n, dtype=np.int64) for n in range(3, 12)]
    enc = GraphedEncoder(qnet, layout.pad_id, CPU, batch_buckets=(1, 2, 4), length_buckets=(16,))
    got = enc(seqs)
    singles = torch.cat([enc([s]) for s in seqs])
    torch.testing.assert_close(got, singles, atol=2e-5, rtol=1e-4)


def test_a_corpus_encoded_sorted_in_buckets_gives_the_plain_vectors_in_input_order(tiny_encoder):
    """The indexing path on a GPU (CUDA graphs of the chunk encoder; here the same padded forward,
    eagerly): chunks of mixed lengths, more than one batch per length, vectors in input order."""
    qnet, tok, layout = untrained_qnet(ModelConfig(encoder=tiny_encoder), CPU, use_target=False)
    qnet.eval()
    rng = np.random.default_rng(3)
    seqs = [rng.integers(1000, 2000, size=n).astype(np.int64) for n in rng.integers(2, 40, size=37)]
    enc = GraphedEncoder.for_chunks(qnet, layout.pad_id, CPU, batch_buckets=(2, 8), length_buckets=(16, 48))
    got = enc.encode_sorted(seqs, max_tokens=8 * 16)  # 8 rows of 16 tokens, but only 2 rows of 48
    with torch.no_grad():
        want = qnet.finish(encode(qnet.action_encoder, seqs, pad_id=layout.pad_id, device=CPU))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    long_rows = int(sum(len(s) > 16 for s in seqs))
    assert enc.eager_calls == -(-long_rows // 2) + -(-(len(seqs) - long_rows) // 8)
    assert enc.encode_sorted([], 64).shape == (0, qnet.dim)
    with pytest.raises(ValueError, match="longer than"):
        enc.encode_sorted([np.arange(60, dtype=np.int64)], 64)


def test_a_state_longer_than_every_bucket_is_a_clear_error(tiny_encoder):
    qnet, tok, layout = untrained_qnet(ModelConfig(encoder=tiny_encoder), CPU, use_target=False)
    enc = GraphedEncoder(qnet, layout.pad_id, CPU, length_buckets=(16,))
    with pytest.raises(ValueError, match="longer than"):
        enc([np.arange(20, dtype=np.int64)])


@pytest.mark.parametrize("arch", ["bert", "mpnet"])
def test_encoders_load_with_attention_they_support_and_ignore_padding(tiny_encoder, tiny_mpnet, arch):
    """all-mpnet-base-v2 has no SDPA attention: it loads eager (it failed to load at all), and a
    padded batch gives each sequence the vector it has alone."""
    from qrag.model.encoder import load_encoder

    model = load_encoder({"bert": tiny_encoder, "mpnet": tiny_mpnet}[arch]).eval()
    assert model.config._attn_implementation == ("sdpa" if arch == "bert" else "eager")
    rng = np.random.default_rng(1)
    seqs = [rng.integers(1000, 2000, size=n).astype(np.int64) for n in (3, 17, 9, 30)]
    with torch.no_grad():
        batch = encode(model, seqs, pad_id=0, device=CPU)
        alone = torch.cat([encode(model, [s], pad_id=0, device=CPU) for s in seqs])
    torch.testing.assert_close(batch, alone, atol=2e-5, rtol=1e-4)


def test_embedding_model_embeds_chunks_through_its_graphed_chunk_encoder(tiny_encoder):
    """On a GPU EmbeddingModel.embed_chunks goes through GraphedEncoder.encode_sorted (here its
    eager twin, set by hand: on CPU it is off); chunks past its largest bucket take the plain path.
    Either way the vectors are those of the plain path."""
    from qrag.retrieval.embedder import load_embedding_model, resolve_source

    model = load_embedding_model(resolve_source(None, tiny_encoder), "cpu")
    assert model.chunk_encoder is None  # CPU: the exact-width path, numbers as before
    rng = np.random.default_rng(4)
    seqs = [rng.integers(1000, 2000, size=n).astype(np.int64) for n in (5, 30, 12, 66, 3)]
    plain = model.embed_chunks(seqs)
    model.chunk_encoder = GraphedEncoder.for_chunks(model.qnet, model.layout.pad_id, CPU, length_buckets=(16, 72))
    np.testing.assert_allclose(model.embed_chunks(seqs), plain, atol=2e-5, rtol=1e-4)
    assert model.chunk_encoder.eager_calls == 1
    np.testing.assert_allclose(
        model.embed_chunks([*seqs, np.arange(80, dtype=np.int64)])[:5], plain, atol=2e-5, rtol=1e-4
    )
    assert model.chunk_encoder.eager_calls == 1  # 80 tokens: past the buckets, the plain path


def test_threads_replaying_one_graph_get_their_own_vectors(tiny_encoder, monkeypatch):
    """A captured graph reads and writes fixed tensors: two threads replaying one shape must not
    swap each other's inputs or outputs. A fake graph (CPU) that reads its input, waits, then
    writes its output shows the swap when the copy-in, replay and copy-out are not held together."""
    import threading
    import time

    qnet, tok, layout = untrained_qnet(ModelConfig(encoder=tiny_encoder), CPU, use_target=False)
    enc = GraphedEncoder(qnet, layout.pad_id, CPU, batch_buckets=(1,), length_buckets=(16,))
    static_ids = torch.zeros(1, 16, dtype=torch.long)
    static_mask = torch.zeros(1, 16, dtype=torch.bool)
    out = torch.zeros(1, qnet.dim)

    class FakeGraph:
        def replay(self):
            first = int(static_ids[0, 0])
            time.sleep(0.002)  # another thread's copy-in would land here
            out.fill_(first)

    enc.graphs = True
    monkeypatch.setattr(enc, "_graph", lambda batch, length: (FakeGraph(), static_ids, static_mask, out))
    wrong = []

    def ask(token):
        for _ in range(30):
            got = enc([np.array([token, 5, 6], dtype=np.int64)])
            if int(got[0, 0]) != token:
                wrong.append((token, int(got[0, 0])))

    threads = [threading.Thread(target=ask, args=(t,)) for t in (101, 202, 303)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not wrong and enc.replays == 90


def test_one_capture_lock_per_gpu():
    from qrag.model.state_graphs import capture_lock

    assert capture_lock("cuda:0") is capture_lock(torch.device("cuda", 0))
    assert capture_lock("cuda:0") is not capture_lock("cuda:1")


def test_captures_on_one_gpu_never_overlap_across_encoders(tiny_encoder, monkeypatch):
    """Two encoders on one GPU (two feeder threads indexing on it; a query's state encoder beside
    an append's chunk encoder) must not capture at once: that failed with "operation not
    permitted when stream is capturing". A fake capture (CPU) records overlaps; another GPU's
    captures may overlap."""
    import threading
    import time

    qnet, tok, layout = untrained_qnet(ModelConfig(encoder=tiny_encoder), CPU, use_target=False)
    active: dict[str, int] = {"cuda:0": 0, "cuda:1": 0}
    overlaps: dict[str, int] = {"cuda:0": 0, "cuda:1": 0}
    guard = threading.Lock()

    def fake_capture(self, batch, length):
        dev = str(self.device)
        with guard:
            active[dev] += 1
            overlaps[dev] += active[dev] > 1
        time.sleep(0.003)
        with guard:
            active[dev] -= 1
        return ("graph", batch, length)

    monkeypatch.setattr(GraphedEncoder, "_capture", fake_capture)
    encoders = [GraphedEncoder(qnet, layout.pad_id, torch.device(d)) for d in ("cuda:0", "cuda:0", "cuda:1", "cuda:1")]
    for enc in encoders:
        enc.graphs = True

    def capture_many(enc):
        for length in (16, 32, 48, 64, 80, 96):
            assert enc._graph(1, length) == ("graph", 1, length)

    threads = [threading.Thread(target=capture_many, args=(e,)) for e in encoders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert overlaps["cuda:0"] == 0 and overlaps["cuda:1"] == 0
    assert all(len(e.captured_shapes) == 6 for e in encoders)


def test_a_capture_runs_on_a_stream_of_the_encoders_own_device(tiny_encoder, monkeypatch):
    """torch.cuda.graph's default capture stream is one per process, made on the device current at
    its first use: a model on cuda:1 captured on it failed, and that GPU ran eagerly (2 GPUs
    indexing). The capture must get the encoder's own side stream, on the encoder's device; the
    CUDA calls are faked here (CPU)."""
    import contextlib

    qnet, tok, layout = untrained_qnet(ModelConfig(encoder=tiny_encoder), CPU, use_target=False)
    enc = GraphedEncoder(qnet, layout.pad_id, torch.device("cuda:1"))

    class FakeStream:
        def __init__(self, device=None):
            self.device = torch.device(device) if device is not None else torch.device("cuda:0")

        def wait_stream(self, other):
            pass

    captured = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, stream=None, capture_error_mode="global"):
        captured.append(stream.device if stream is not None else FakeStream().device)  # None: the process-wide default
        yield

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(device))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 1))
    monkeypatch.setattr(enc, "_forward", lambda ids, mask: torch.zeros(len(ids), qnet.dim))
    real_full, real_zeros = torch.full, torch.zeros
    monkeypatch.setattr(torch, "full", lambda *a, device=None, **k: real_full(*a, **k))  # the buffers stay on the CPU
    monkeypatch.setattr(torch, "zeros", lambda *a, device=None, **k: real_zeros(*a, **k))
    enc._capture(1, 16)
    assert captured == [torch.device("cuda:1")]


def test_warm_up_captures_every_shape_a_replica_can_meet(tiny_encoder, monkeypatch):
    """A serving replica captures its state graphs at start: every batch bucket up to the largest
    batch it can be sent and every length bucket up to the longest state (here faked captures on a
    'cuda' device: CPU). With graphs off (CPU), nothing."""
    qnet, tok, layout = untrained_qnet(ModelConfig(encoder=tiny_encoder), CPU, use_target=False)
    monkeypatch.setattr(GraphedEncoder, "_capture", lambda self, batch, length: ("graph", batch, length))
    enc = GraphedEncoder(
        qnet,
        layout.pad_id,
        torch.device("cuda:0"),
        batch_buckets=(1, 2, 4, 8, 16, 32, 64),
        length_buckets=(32, 64, 96, 128, 192),
    )
    enc.graphs = True
    assert enc.warm_up(20, 100) == 6 * 4  # batches 1..32 (20 states fill bucket 32), lengths 32..128
    assert enc.captured_shapes == [(b, n) for b in (1, 2, 4, 8, 16, 32) for n in (32, 64, 96, 128)]
    assert GraphedEncoder(qnet, layout.pad_id, CPU).warm_up(20, 100) == 0


def test_a_serving_replica_warms_its_encoder_up_at_start(monkeypatch):
    pytest.importorskip("ray")  # the GPU image runs this file's graph tests without Ray
    import qrag.distributed.serving as serving
    from qrag.serving.service_config import ServeConfig

    calls = []

    class FakeModel:
        def warm_up(self, max_batch):
            calls.append(max_batch)
            return 1

    monkeypatch.setattr(serving, "load_embedding_model", lambda *a, **k: FakeModel())
    monkeypatch.setattr(serving, "serving_source", lambda c: None)
    serving.serving_model(ServeConfig(state_batch_size=16, max_beam_width=24))
    serving.serving_model(ServeConfig(warm_up=False))
    assert calls == [24]


def test_warming_up_for_indexing_captures_the_main_shape_and_runs_the_others_once(tiny_encoder, monkeypatch):
    """A lane makes its chunk encoder ready while it starts (warm_up_sorted): the full batch of the
    longest chunks, the shape encode_sorted replays for nearly every batch of an index, is captured;
    every other shape encode_sorted can take runs once eagerly (its kernels loaded), none captured."""
    qnet, tok, layout = untrained_qnet(ModelConfig(encoder=tiny_encoder), CPU, use_target=False)
    enc = GraphedEncoder.for_chunks(qnet, layout.pad_id, CPU, batch_buckets=(2, 8, 32), length_buckets=(16, 32, 48, 64))
    assert enc.warm_up_sorted(40, max_tokens=8 * 32) == 0  # CPU: no graphs
    enc.graphs = True  # the shapes chosen, without a GPU: record instead of capturing
    captured, eager, used = [], [], set()
    monkeypatch.setattr(enc, "_graph", lambda batch, length: captured.append((batch, length)) or None)
    monkeypatch.setattr(
        enc, "_forward", lambda ids, mask: eager.append(tuple(ids.shape)) or torch.zeros(ids.shape[0], qnet.dim)
    )
    enc.warm_up_sorted(40, max_tokens=8 * 32)
    assert captured == [(2, 48)]  # 8 rows of 48 ids are more than 256 tokens: 2 rows
    assert sorted(eager) == [(2, 16), (2, 32), (8, 16), (8, 32)]  # no 32 rows: 32 x 16 > 256 tokens
    monkeypatch.setattr(enc, "_graph", lambda batch, length: used.add((batch, length)) or None)
    rng = np.random.default_rng(1)
    for n in (1, 3, 9, 40):
        enc.encode_sorted([np.ones(k, np.int64) for k in rng.integers(2, 41, size=n)], max_tokens=8 * 32)
    assert used and used <= {*captured, *eager}  # every shape indexing takes was made ready
