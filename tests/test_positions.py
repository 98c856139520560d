import math

import pytest
import torch

from qrag.model.positions import chunk_positions, relative_positions, rope_frequencies, rotate


def test_rope_equals_complex_multiplication_per_half():
    torch.manual_seed(0)
    d, base = 16, 10000.0
    v = torch.randn(5, d, dtype=torch.float64).float()
    pos = torch.tensor([0.0, 1.0, 2.5, 7.25, 1000.0])
    out = rotate(v, pos, base)
    freqs = rope_frequencies(d, base)
    for half in range(2):
        pairs = v[:, half * d // 2 : (half + 1) * d // 2].reshape(5, d // 4, 2)
        z = torch.complex(pairs[..., 0].double(), pairs[..., 1].double())
        rot = z * torch.polar(torch.ones_like(z.real), pos[:, None].double() * freqs.double())
        expected = torch.stack((rot.real, rot.imag), -1).reshape(5, d // 2)
        assert torch.allclose(out[:, half * d // 2 : (half + 1) * d // 2].double(), expected, atol=1e-5)


def test_rope_preserves_norms_of_each_half():
    torch.manual_seed(1)
    v = torch.randn(3, 7, 32)
    pos = torch.rand(3, 7) * 100
    out = rotate(v, pos, 10000.0)
    assert torch.allclose(out[..., :16].norm(dim=-1), v[..., :16].norm(dim=-1), atol=1e-5)
    assert torch.allclose(out[..., 16:].norm(dim=-1), v[..., 16:].norm(dim=-1), atol=1e-5)


def test_rope_position_zero_is_identity_and_relative_shift_invariance():
    torch.manual_seed(2)
    s, a = torch.randn(16), torch.randn(16)
    assert torch.allclose(rotate(a[None], torch.zeros(1), 100.0)[0], a)
    # <R(p) s, R(p) a> does not depend on p: rotations are orthogonal.
    p = torch.tensor([3.7])
    assert math.isclose(float(rotate(s[None], p, 100.0) @ rotate(a[None], p, 100.0).T), float(s @ a), rel_tol=1e-5)


def test_relative_positions_worked_example():
    # m = 10 chunks, chunks 3 and 7 selected (0-based); δ = 10, ℓ = 9.
    selected = torch.zeros(1, 10, dtype=torch.bool)
    selected[0, [3, 7]] = True
    rho = relative_positions(selected, torch.tensor([10]), 10.0, 9.0)[0]
    # interval 0: [0, 3) -> 9 * i / 3
    assert rho[0].item() == pytest.approx(0.0)
    assert rho[2].item() == pytest.approx(6.0)
    # interval 1: [3, 7) -> 10 + 9 * (i - 3) / 4
    assert rho[3].item() == pytest.approx(10.0)
    assert rho[5].item() == pytest.approx(14.5)  # fractional, not truncated to 14
    # interval 2: [7, 10) -> 20 + 9 * (i - 7) / 3
    assert rho[8].item() == pytest.approx(23.0)
    assert rho[9].item() == pytest.approx(26.0)
    assert rho.dtype == torch.float32


def test_relative_positions_without_selection_and_order_preserved():
    selected = torch.zeros(2, 6, dtype=torch.bool)
    selected[1, 0] = True
    rho = relative_positions(selected, torch.tensor([6, 4]), 10.0, 9.0)
    assert torch.allclose(rho[0], torch.tensor([0, 1.5, 3, 4.5, 6, 7.5]))
    assert rho[1, 0].item() == 10.0 and rho[1, 3].item() == pytest.approx(10 + 9 * 3 / 4)
    assert bool((rho[0].diff() > 0).all())


def test_fractional_positions_reach_the_rotation():
    v = torch.ones(1, 8)
    a = rotate(v, torch.tensor([14.5]), 10.0)
    b = rotate(v, torch.tensor([14.0]), 10.0)
    assert not torch.allclose(a, b)


def test_chunk_positions_modes():
    sel = torch.zeros(1, 4, dtype=torch.bool)
    assert chunk_positions("none", sel, torch.tensor([4]), 10, 9) is None
    assert torch.equal(chunk_positions("absolute", sel, torch.tensor([4]), 10, 9)[0], torch.arange(4.0))
    with pytest.raises(ValueError, match="positions mode"):
        chunk_positions("sideways", sel, torch.tensor([4]), 10, 9)
