"""An MPNet loaded by the library builds its relative-position bias on the hidden states' device
(transformers 5.17 built it on the CPU, and CUDA-graph capture refused the copy, so MPNet
served every state eagerly), with the library's values."""

from __future__ import annotations

import copy

import torch

from qrag.model.encoder import load_encoder
from qrag.model.mpnet_positions import build_position_bias_on_device


def test_a_loaded_mpnet_builds_the_same_bias_on_the_device(tiny_mpnet):
    model = load_encoder(tiny_mpnet)
    encoder = model.encoder
    assert "compute_position_bias" in vars(encoder), "load_encoder left MPNet's CPU-side bias in place"
    x = torch.randn(3, 17, model.config.hidden_size)
    library = type(encoder).compute_position_bias(encoder, x)
    ours = encoder.compute_position_bias(x)
    assert ours.shape == (3, model.config.num_attention_heads, 17, 17)
    assert torch.equal(ours, library)


def test_the_forward_is_unchanged_and_a_copy_keeps_the_bias(tiny_mpnet):
    from transformers import AutoModel

    plain = AutoModel.from_pretrained(tiny_mpnet, dtype=torch.float32).eval()
    model = load_encoder(tiny_mpnet).eval()
    ids = torch.randint(5, 1000, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    with torch.no_grad():
        expected = plain(input_ids=ids, attention_mask=mask).last_hidden_state
        assert torch.allclose(model(input_ids=ids, attention_mask=mask).last_hidden_state, expected, atol=1e-6)
    target = copy.deepcopy(model)  # the target networks are deep copies
    assert target.encoder.compute_position_bias.__self__ is target.encoder


def test_no_host_copy_while_building_it(tiny_mpnet, monkeypatch):
    encoder = load_encoder(tiny_mpnet).encoder

    cast = torch.Tensor.to

    def no_move(self, *args, **kwargs):  # dtype casts are fine; any device argument is a copy on a GPU
        if "device" in kwargs or any(isinstance(a, (str, torch.device, torch.Tensor)) for a in args):
            raise AssertionError(f"a tensor was sent to a device while building the bias: {args} {kwargs}")
        return cast(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", no_move)
    encoder.compute_position_bias(torch.randn(1, 9, 32))


def test_other_architectures_are_left_alone(tiny_encoder):
    model = load_encoder(tiny_encoder)  # BERT
    assert not build_position_bias_on_device(model)
    assert not any("compute_position_bias" in vars(m) for m in model.modules())
