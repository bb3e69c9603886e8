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


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_0])
def test_widening_to_q8_0_keeps_every_value(qtype):
    """Q4_0/Q5_0 blocks widened to Q8_0 hold exactly the file's values (all 5th bits and
    both nibbles, an all-zero block included)."""
    g = torch.Generator().manual_seed(int(qtype))
    n, k = 64, 96
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    w[3, 32:64] = 0
    rows = quantize(w, qtype).view(n, quants.row_nbytes(int(qtype), k))
    wide = q8_matmul.widen_to_q8_0(rows, int(qtype))
    assert wide.shape == (n, quants.row_nbytes(Q.Q8_0, k)) and wide.dtype == torch.uint8
    original = quants.dequantize(rows.reshape(-1), int(qtype), (n, k))
    assert torch.equal(quants.dequantize(wide.reshape(-1), Q.Q8_0, (n, k)), original)
    assert (original - w).abs().max() <= w.abs().max() / 7  # the file's own grid, read right
    x = torch.randn(5, k)
    torch.testing.assert_close(q8_matmul.q8_0_matmul(x, wide),
                               q8_matmul.q8_0_matmul_reference(x, wide), rtol=1e-5, atol=1e-5)


def test_widening_refuses_types_q8_0_cannot_hold_exactly():
    rows = quantize(torch.randn(2, 256), Q.Q4_K).view(2, -1)
    with pytest.raises(ValueError, match="Q4_K"):
        q8_matmul.widen_to_q8_0(rows, int(Q.Q4_K))


@needs_kernel
@pytest.mark.parametrize("k,scale", [(640, 25.298221281347036), (96, 1.0)])
def test_embedding_row_is_the_references_bit_for_bit(k, scale):
    """A decoded token's embedding read from Q8_0 rows in one call is exactly the model's own
    dequantize-then-scale."""
    rows = _rows(50, k, seed=k)
    for token in (0, 17, 49):
        got = q8_matmul.q8_0_embed(rows, token, scale)
        want = quants.dequantize(rows[token].contiguous(), Q.Q8_0, (1, k)) * scale
        assert torch.equal(got, want)
        assert torch.equal(got, q8_matmul.q8_0_embed_reference(rows, token, scale))
    with pytest.raises(IndexError, match="outside"):
        q8_matmul.q8_0_embed(rows, 50, scale)
