"""The Q8_0 matmul kernel against its reference."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from ember.kernels import q8_matmul
from ember.models import quants
from ember.models.quantize import quantize

needs_kernel = pytest.mark.skipif(not q8_matmul.available(),
                                  reason="C++ kernels not built on this machine")


def _rows(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1
    return q8_matmul.q8_0_rows(quantize(w, Q.Q8_0), n, k)


@needs_kernel
@pytest.mark.parametrize("n,k", [(1, 32), (7, 64), (1000, 640), (333, 96)])
@pytest.mark.parametrize("t", [1, 3, 4, 5, 9])
def test_kernel_matches_reference(n, k, t):
    rows = _rows(n, k)
    x = torch.randn(t, k)
    ref = q8_matmul.q8_0_matmul_reference(x, rows)
    got = q8_matmul.q8_0_matmul(x, rows)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("n,k", [(500, 640), (37, 2048), (5, 96)])
@pytest.mark.parametrize("t", [2, 3, 4, 5, 8, 13])
def test_each_row_of_x_is_independent_of_the_batch(n, k, t):
    """Rows scored together or one by one, or in any split, give bit-identical results
    (speculative verification relies on it)."""
    rows, x = _rows(n, k, seed=t), torch.randn(t, k)
    together = q8_matmul.q8_0_matmul(x, rows)
    alone = torch.cat([q8_matmul.q8_0_matmul(x[i:i + 1], rows) for i in range(t)])
    assert torch.equal(together, alone)
    split = torch.cat([q8_matmul.q8_0_matmul(x[:t // 2], rows),
                       q8_matmul.q8_0_matmul(x[t // 2:], rows)])
    assert torch.equal(together, split)


@needs_kernel
@pytest.mark.parametrize("t", [1, 4, 7])
def test_kernel_is_close_to_the_float_matmul(t):
    """Rounding x to int16 per block costs ~1e-5 relative: far below the weights' 8-bit grid."""
    n, k = 300, 640
    rows, x = _rows(n, k), torch.randn(t, k) * 3
    w = quants.dequantize(rows.reshape(-1), Q.Q8_0, (n, k))
    exact = x.double() @ w.double().t()
    got = q8_matmul.q8_0_matmul(x, rows)
    assert (got.double() - exact).abs().max() < 1e-4 * exact.abs().max()


@needs_kernel
def test_zero_and_tiny_blocks_of_x():
    rows, x = _rows(40, 96), torch.randn(3, 96)
    x[0] = 0  # an all-zero row
    x[1, 32:64] = 0  # an all-zero block
    x[2, :32] = 1e-30  # a block of tiny values
    got = q8_matmul.q8_0_matmul(x, rows)
    torch.testing.assert_close(got, q8_matmul.q8_0_matmul_reference(x, rows), rtol=1e-5, atol=1e-6)
    assert torch.equal(got[0], torch.zeros(40))


@pytest.mark.parametrize("n,k", [(1, 32), (3, 64), (129, 640), (10, 2048)])
def test_quantize_matches_the_gguf_quantizer(n, k):
    """The C++ requantizer writes the same bytes as models/quantize.py (GGML's rounding)."""
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 4
    w[0, :32] = 0
    assert torch.equal(q8_matmul.q8_0_quantize(w), q8_matmul.q8_0_rows(quantize(w, Q.Q8_0), n, k))


def test_quantize_needs_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_matmul.q8_0_quantize(torch.randn(4, 48))


def test_reference_is_the_dequantized_matmul_of_rounded_activations():
    rows, x = _rows(50, 64), torch.randn(2, 64)
    w = quants.dequantize(rows.reshape(-1), Q.Q8_0, (50, 64))
    q, s = q8_matmul.quantize_activations_reference(x)
    assert q.abs().max() == 32767 and torch.equal(q, q.round())
    x_hat = (q * s).reshape(2, 64)
    torch.testing.assert_close(q8_matmul.q8_0_matmul_reference(x, rows), x_hat @ w.t())
    torch.testing.assert_close(x_hat, x, rtol=0, atol=float(x.abs().max()) / 32767)
