"""The bucketed state encoder (CUDA graphs on GPU) gives the vectors of the plain encoder."""

import numpy as np
import pytest
import torch

from qrag.model.checkpoint import untrained_qnet
from qrag.config import ModelConfig
from qrag.model.encoder import encode
from qrag.model.state_graphs import StateEncoder, bucket_of

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
    qnet, tok, layout = untrained_qnet(ModelConfig(encoder=encoder, positions="relative", similarity=similarity), CPU, use_target=False)
    qnet.eval()
    rng = np.random.default_rng(0)
    # 5 states (bucket 8: three padding rows) of mixed lengths (bucket 64: padded columns).
    seqs = [rng.integers(1000, 2000, size=n).astype(np.int64) for n in (7, 40, 33, 12, 50)]
    enc = StateEncoder(qnet, layout.pad_id, CPU, batch_buckets=(1, 2, 4, 8), length_buckets=(16, 64))
    got = enc(seqs)
    with torch.no_grad():
        want = qnet.finish(encode(qnet.state_encoder, seqs, pad_id=layout.pad_id, device=CPU))
        alone = torch.cat([qnet.finish(encode(qnet.state_encoder, [s], pad_id=layout.pad_id, device=CPU)) for s in seqs])
    torch.testing.assert_close(want, alone, atol=2e-5, rtol=1e-4)  # padding changes no vector
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert enc.eager_calls == 1 and enc.replays == 0  # CPU: the same padded forward, eagerly


def test_more_states_than_the_largest_batch_are_split_in_order(tiny_encoder):
    qnet, tok, layout = untrained_qnet(ModelConfig(encoder=tiny_encoder), CPU, use_target=False)
    qnet.eval()
    seqs = [np.arange(5, 5 + n, dtype=np.int64) for n in range(3, 12)]
    enc = StateEncoder(qnet, layout.pad_id, CPU, batch_buckets=(1, 2, 4), length_buckets=(16,))
    got = enc(seqs)
    singles = torch.cat([enc([s]) for s in seqs])
    torch.testing.assert_close(got, singles, atol=2e-5, rtol=1e-4)


def test_a_state_longer_than_every_bucket_is_a_clear_error(tiny_encoder):
    qnet, tok, layout = untrained_qnet(ModelConfig(encoder=tiny_encoder), CPU, use_target=False)
    enc = StateEncoder(qnet, layout.pad_id, CPU, length_buckets=(16,))
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
