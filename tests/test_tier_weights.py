"""The GPU tier's weight formats (kernels/tier_weights.py) against their float references, and
the hot FFN on each, on the CPU through the code CUDA runs (the int4 op is the only per-device
switch). The same checks on CUDA are in tests/test_cuda_tier.py."""

from __future__ import annotations

import pytest
import torch

from ember.kernels.hot_ffn import HotFFNWeights, hot_ffn, hot_ffn_bytes, hot_ffn_reference
from ember.kernels.sparse_ffn import neuron_rows_ffn
from ember.kernels.tier_weights import (FORMATS, TierLinear, dequantize_int4, linear_bytes,
                                        quantize_int4, quantize_int8)

HALF = (torch.bfloat16, torch.float16)


def _w(n, k, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_int4_codes_round_trip_a_4_bit_grid():
    """Values already on a 16-level grid per 32-group (what a Q4 block decodes to) come back
    to bf16 rounding of their scale and zero."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (16, 64), generator=g)
    codes[:, ::32] = 0
    codes[:, 1::32] = 15  # every group spans the whole grid
    scale = torch.rand(16, 2, generator=g).repeat_interleave(32, 1) * 0.01 + 0.001
    w = (codes - 8) * scale - 0.003
    q, s, z = quantize_int4(w)
    assert torch.equal(q, codes.to(torch.int32))
    # bf16 keeps 8 bits of the scale: code 15 carries 15 times its rounding (2^-9), about
    # 2^-8 of a group's largest value.
    torch.testing.assert_close(dequantize_int4(q, s, z), w, rtol=0,
                               atol=float(w.abs().max()) / 128)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 3])
def test_each_format_multiplies_as_its_dequantized_weight(fmt, rows):
    w = _w(64, 128)
    lin = TierLinear.pack(w, fmt)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(2))
    got = lin(x).float()
    want = x.to(lin.compute).float() @ lin.dequantize().t()
    tol = 1e-5 if fmt == "fp32" else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))
    assert lin.nbytes() == linear_bytes(fmt, 64, 128)
    # The stored error is what the codes lose against the rows (measured, not assumed).
    bound = {"int4": 0.15, "int8": 0.01, "fp16": 1e-3, "bf16": 5e-3, "fp32": 0.0}[fmt]
    assert lin.error <= bound and (fmt == "fp32" or lin.error > 0)


def test_int4_dequantize_reads_back_the_packed_codes():
    w = _w(32, 64, seed=3)
    q, s, z = quantize_int4(w)
    torch.testing.assert_close(TierLinear.pack(w, "int4").dequantize(), dequantize_int4(q, s, z),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("half", HALF)
def test_int8_fast_op_and_portable_matmul_agree(half):
    """The aten int8 op (CUDA) and the dequantizing matmul (elsewhere) are one format: both
    paths run here (the CPU op on one row, a shape its kernel takes)."""
    w, x = _w(48, 96, seed=4), torch.randn(1, 96)
    fast = TierLinear.pack(w, "int8", half=half, fast_int8=True)
    slow = TierLinear.pack(w, "int8", half=half)
    assert not slow.fast_int8  # the CPU's default
    q, scale = quantize_int8(w, half)
    assert torch.equal(fast.tensors["q"], q) and torch.equal(fast.tensors["scale"], scale)
    torch.testing.assert_close(fast(x).float(), slow(x).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("formats", [("int4", "int4"), ("int4", "int8"), ("int8", "int8"),
                                     ("fp16", "fp16"), ("bf16", "bf16"), ("fp32", "fp32")])
@pytest.mark.parametrize("act", ["silu_glu", "relu"])
@pytest.mark.parametrize("n", [5, 32, 70])
def test_hot_ffn_in_each_format_is_the_reference_ffn(formats, act, n):
    """Any hot count (padded to int4's 32-neuron groups with zero rows) gives the FFN of the
    weights its codes stand for (to bf16/fp16 activations), and the float FFN to the
    formats' conversion error; the bytes are the plan's."""
    hidden = 64
    g = torch.Generator().manual_seed(n)
    gate = torch.randn(n, hidden, generator=g) * 0.2 if act == "silu_glu" else None
    up, down = torch.randn(n, hidden, generator=g) * 0.2, torch.randn(n, hidden, generator=g) * 0.2
    w = HotFFNWeights.from_rows(gate, up, down, act, formats=formats)
    gu = w.gate_up.dequantize()  # (2n or n, hidden)
    # Padded neurons have zero gate/up rows, so h = 0 there and they add nothing (their
    # down columns share int4 groups with real ones and need not be zero).
    assert not gu[n:w.n].any() and not gu[w.n + n:].any()
    x = torch.randn(3, hidden, generator=g)
    mask = torch.rand(3, n, generator=g) > 0.5
    for m in (None, mask):
        got = hot_ffn(x, w, m)
        kernel = _rel(got, hot_ffn_reference(x, w, m))
        assert kernel < (1e-5 if formats[0] == "fp32" else 0.02), kernel
        conversion = _rel(got, neuron_rows_ffn(x, gate, up, down, act, m))
        assert conversion < {"int4": 0.25, "int8": 0.03}.get(formats[0], 0.01), conversion
    assert w.nbytes() == hot_ffn_bytes(n, hidden, act == "silu_glu", formats)


def _rel(got, want):
    return float((got - want).norm() / want.norm().clamp_min(1e-6))


def test_int4_falls_back_to_int8_where_its_tiles_do_not_fit():
    """hidden 40 is not whole 32-value groups: that side is held as int8 instead."""
    rows = torch.randn(8, 40)
    w = HotFFNWeights.from_rows(rows, rows, rows, "silu_glu", formats=("int4", "int4"))
    assert w.formats == ("int8", "int8")
    assert w.nbytes() == hot_ffn_bytes(8, 40, True, ("int4", "int4"))
