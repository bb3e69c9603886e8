"""Tests for ember.models.quants against gguf-py's numpy reference implementation.

Exactness: every kernel applies its scales in the same order as GGML (and
gguf-py), one float32 rounding per multiply/add, so the dequantized values are
compared bit for bit, not within a tolerance.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants as ref
from hypothesis import given, settings, strategies as st

from ember.models import quantize as QZ
from ember.models import quants as Q
from ember.models.support.errors import UnsupportedModelError

# Byte offsets of the fp16 scale fields in each block type; random block bytes
# get these overwritten with finite halves so no block decodes to inf/nan.
FP16_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}
BLOCK_TYPES = list(FP16_FIELDS)
FLOAT_TYPES = [T.F32, T.F16, T.BF16]
# Q8_K is supported but gguf-py has no dequantizer for it; tested separately.
REFERENCE_TYPES = FLOAT_TYPES + BLOCK_TYPES

SHAPE_BLOCKS = [(1, 1), (1, 3), (64, 2), (5, 7), (300, 1)]   # (rows, blocks per row)


def _finite_halves(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random finite fp16 values over the whole range (subnormals, +-0, 65504 included)."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF          # inf/nan exponent -> a finite one
    return bits.view(np.float16)


def random_raw(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random tensor bytes, shaped [rows, row_bytes] as gguf-py expects."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block_size
    if qtype == T.F32:
        data = rng.standard_normal(n_blocks).astype(np.float32) * np.float32(1e3)
        return data.view(np.uint8).reshape(rows, -1)
    raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for at in FP16_FIELDS.get(qtype, []):
        raw[:, at:at + 2] = _finite_halves(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(rows, -1)


def assert_bitwise_equal(got: torch.Tensor, want: np.ndarray) -> None:
    got = got.numpy()
    assert got.dtype == np.float32 and got.shape == want.shape
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    same = got.view(np.uint32)[~nan] == want.astype(np.float32).view(np.uint32)[~nan]
    if not same.all():
        bad = np.flatnonzero(~same)[:5]
        raise AssertionError(f"{(~same).sum()} values differ, e.g. got {got[~nan][bad]} want {want[~nan][bad]}")


# --------------------------------------------------------------------------
# dequantize vs gguf-py
# --------------------------------------------------------------------------

@pytest.mark.parametrize("rows,blocks_per_row", SHAPE_BLOCKS)
@pytest.mark.parametrize("qtype", REFERENCE_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference(qtype, rows, blocks_per_row):
    block_size = GGML_QUANT_SIZES[qtype][0]
    # Float types have 1-element "blocks"; give their rows a realistic width.
    cols = blocks_per_row * (block_size if block_size > 1 else 64)
    raw = random_raw(qtype, rows, cols, seed=rows * 31 + blocks_per_row)
    want = ref.dequantize(raw, qtype).reshape(rows, cols)
    got = Q.dequantize(torch.from_numpy(raw.reshape(-1)), qtype, (rows, cols))
    assert_bitwise_equal(got, want)


@pytest.mark.parametrize("qtype", REFERENCE_TYPES, ids=lambda t: t.name)
def test_dequantize_across_chunks(qtype, monkeypatch):
    """Tensors bigger than one kernel chunk decode the same as in one piece."""
    block_size = GGML_QUANT_SIZES[qtype][0]
    monkeypatch.setattr(Q, "_CHUNK_ELEMENTS", 3 * block_size)     # 3 blocks a chunk
    cols = 4 * max(block_size, 32)
    raw = random_raw(qtype, 7, cols, seed=5)
    got = Q.dequantize(torch.from_numpy(raw.reshape(-1)), qtype, (7, cols))
    assert_bitwise_equal(got, ref.dequantize(raw, qtype).reshape(7, cols))


def test_dequantize_float_specials():
    """inf, nan, subnormals and -0 pass through F16 and BF16 unchanged."""
    halves = np.array([np.inf, -np.inf, np.nan, -0.0, 6e-8, 65504, 1.0, -2.5], np.float16)
    got = Q.dequantize(torch.from_numpy(halves.view(np.uint8).copy()), T.F16, (8,))
    assert_bitwise_equal(got, halves.astype(np.float32))

    f32 = np.array([np.inf, -np.inf, np.nan, -0.0, 1e-40, 3e38, 1.0, -2.5], np.float32)
    bf16 = (f32.view(np.uint32) >> 16).astype(np.uint16)             # exact for these
    got = Q.dequantize(torch.from_numpy(bf16.view(np.uint8).copy()), T.BF16, (8,))
    assert_bitwise_equal(got, ref.dequantize(bf16.view(np.uint8).reshape(1, -1), T.BF16).reshape(8))


@settings(max_examples=60, deadline=None)
@given(
    qtype=st.sampled_from(BLOCK_TYPES),
    rows=st.integers(1, 4),
    blocks_per_row=st.integers(1, 3),
    data=st.data(),
)
def test_dequantize_arbitrary_blocks(qtype, rows, blocks_per_row, data):
    """Hypothesis-chosen block bytes (scale fields kept finite) match the reference."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * blocks_per_row
    raw = np.frombuffer(data.draw(st.binary(min_size=n_blocks * type_size, max_size=n_blocks * type_size)),
                        dtype=np.uint8).reshape(n_blocks, type_size).copy()
    for at in FP16_FIELDS[qtype]:
        field = raw[:, at:at + 2].copy().view(np.uint16)
        field[(field & 0x7C00) == 0x7C00] &= 0xBFFF
        raw[:, at:at + 2] = field.view(np.uint8)
    raw = raw.reshape(rows, -1)
    cols = blocks_per_row * block_size
    got = Q.dequantize(torch.from_numpy(raw.reshape(-1)), qtype, (rows, cols))
    assert_bitwise_equal(got, ref.dequantize(raw, qtype).reshape(rows, cols))


def test_dequantize_q8_k():
    """Q8_K (d f32 | int8 qs[256] | int16 bsums[16]) against a direct numpy decode."""
    rng = np.random.default_rng(3)
    n = 6
    d = rng.standard_normal(n).astype(np.float32)
    qs = rng.integers(-128, 128, (n, 256)).astype(np.int8)
    bsums = rng.integers(-(1 << 15), 1 << 15, (n, 16)).astype(np.int16)   # ignored by decode
    raw = np.concatenate([d.view(np.uint8).reshape(n, 4), qs.view(np.uint8), bsums.view(np.uint8).reshape(n, 32)], axis=1)
    assert raw.shape[1] == 292
    got = Q.dequantize(torch.from_numpy(raw.reshape(-1)), T.Q8_K, (2, 768))
    assert_bitwise_equal(got, (d[:, None] * qs.astype(np.float32)).reshape(2, 768))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.F32], ids=lambda t: t.name)
def test_dequantize_other_shapes(qtype):
    """1-D and 3-D shapes: blocks always run along the last dimension."""
    block_size = max(GGML_QUANT_SIZES[qtype][0], 32)
    raw = random_raw(qtype, 6, 2 * block_size, seed=9)
    want = ref.dequantize(raw, qtype)
    flat = torch.from_numpy(raw.reshape(-1))
    assert_bitwise_equal(Q.dequantize(flat, qtype, (2, 3, 2 * block_size)), want.reshape(2, 3, -1))
    assert_bitwise_equal(Q.dequantize(flat, qtype, (12 * block_size,)), want.reshape(-1))
    assert Q.dequantize(flat[:0], qtype, (0, 2 * block_size)).shape == (0, 2 * block_size)


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.Q6_K, T.Q5_0], ids=lambda t: t.name)
def test_dequantize_from_readonly_unaligned_memmap(qtype, tmp_path):
    """Raw bytes may be a read-only memmap view at any offset; they are never written."""
    rows, cols = 3, 512
    raw = random_raw(qtype, rows, cols, seed=11)
    path = tmp_path / "blob.bin"
    path.write_bytes(b"\x01\x02\x03" + raw.tobytes() + b"\x04")         # odd offset
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)     # torch: "array is not writable"
        view = torch.from_numpy(mm[3:3 + raw.size])
    before = view.clone()
    got = Q.dequantize(view, qtype, (rows, cols))
    assert torch.equal(view, before)
    assert_bitwise_equal(got, ref.dequantize(raw, qtype).reshape(rows, cols))
    # The result owns its memory: writing to it cannot touch the read-only map.
    got.fill_(0)
    assert torch.equal(view, before)


def test_dequantize_into_out():
    raw = random_raw(T.Q4_K, 4, 512, seed=2)
    big = torch.full((6, 512), 7.0)
    res = Q.dequantize(torch.from_numpy(raw.reshape(-1)), T.Q4_K, (4, 512), out=big[1:5])
    assert res.data_ptr() == big[1].data_ptr()
    assert_bitwise_equal(big[1:5], ref.dequantize(raw, T.Q4_K))
    assert (big[0] == 7).all() and (big[5] == 7).all()
    with pytest.raises(ValueError, match="out must be"):
        Q.dequantize(torch.from_numpy(raw.reshape(-1)), T.Q4_K, (4, 512), out=torch.empty(4, 512)[:, :256])


# --------------------------------------------------------------------------
# sizes and errors
# --------------------------------------------------------------------------

def test_supported_types_and_block_info():
    for qtype in REFERENCE_TYPES + [T.Q8_K]:
        assert int(qtype) in Q.SUPPORTED_TYPES
        assert Q.block_info(qtype) == GGML_QUANT_SIZES[qtype]
        assert Q.block_info(int(qtype)) == GGML_QUANT_SIZES[qtype]
    assert Q.block_info(T.Q4_K) == (256, 144)
    assert Q.block_info(T.Q8_0) == (32, 34)


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.Q8_1, T.TQ1_0, T.I32], ids=lambda t: t.name)
def test_unsupported_type_names_the_type(qtype):
    with pytest.raises(UnsupportedModelError, match=qtype.name) as info:
        Q.block_info(qtype)
    assert "Q4_K" in str(info.value)                                   # lists what works
    with pytest.raises(UnsupportedModelError, match=qtype.name):
        Q.dequantize(torch.zeros(GGML_QUANT_SIZES[qtype][1], dtype=torch.uint8), qtype,
                     (GGML_QUANT_SIZES[qtype][0],))


def test_unknown_type_id():
    with pytest.raises(UnsupportedModelError, match="#999"):
        Q.block_info(999)
    with pytest.raises(ValueError, match="999"):
        Q.row_nbytes(999, 256)


def test_row_nbytes():
    assert Q.row_nbytes(T.F32, 640) == 2560
    assert Q.row_nbytes(T.BF16, 3) == 6
    assert Q.row_nbytes(T.Q8_0, 640) == 20 * 34
    assert Q.row_nbytes(T.Q4_K, 2048) == 8 * 144
    assert Q.row_nbytes(T.Q6_K, 0) == 0
    assert Q.row_nbytes(T.IQ2_XXS, 256) == 66         # arithmetic works for any known type
    with pytest.raises(ValueError, match="Q4_K"):
        Q.row_nbytes(T.Q4_K, 640)
    with pytest.raises(ValueError):
        Q.row_nbytes(T.Q8_0, 33)


def test_bad_sizes_raise_value_error():
    raw = torch.zeros(2 * 34, dtype=torch.uint8)
    with pytest.raises(ValueError, match="needs 68 bytes, got 67"):
        Q.dequantize(raw[:67], T.Q8_0, (1, 64))
    with pytest.raises(ValueError, match="needs 34 bytes, got 68"):
        Q.dequantize(raw, T.Q8_0, (1, 32))
    with pytest.raises(ValueError, match="not a multiple"):
        Q.dequantize(raw, T.Q8_0, (2, 16))
    with pytest.raises(ValueError, match="not a multiple"):
        Q.dequantize(torch.zeros(144 * 5, dtype=torch.uint8), T.Q4_K, (2048, 640))
    with pytest.raises(ValueError, match="1-D uint8"):
        Q.dequantize(raw.view(2, 34), T.Q8_0, (1, 64))
    with pytest.raises(ValueError, match="1-D uint8"):
        Q.dequantize(raw.to(torch.int8), T.Q8_0, (1, 64))


# --------------------------------------------------------------------------
# quantize
# --------------------------------------------------------------------------

def _test_matrix(rows: int, cols: int, scale: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
    x[0, :32] = 0                                   # all-zero block (d = 0)
    x[1, :32] = x[1, 0]                             # constant block
    x[2, :32] = np.float32(0.5) * np.sign(rng.standard_normal(32)).astype(np.float32)  # +-absmax ties
    x[3, :32] = np.arange(32, dtype=np.float32) / 31 * 127 / 2        # many exact .5 ties in Q8_0
    return x


@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1],
                         ids=lambda t: t.name)
def test_quantize_matches_gguf_reference(qtype, scale):
    """Bit-identical bytes to gguf-py's quantizers (which mirror GGML's C reference)."""
    x = _test_matrix(37, 256, scale, seed=int(qtype))
    want = ref.quantize(x, qtype).view(np.uint8).reshape(-1)
    got = QZ.quantize(torch.from_numpy(x), qtype)
    assert got.dtype == torch.uint8 and got.dim() == 1
    np.testing.assert_array_equal(got.numpy(), want)


def test_quantize_bf16_nan_and_rounding():
    x = torch.tensor([float("nan"), float("inf"), -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.4e38], dtype=torch.float32)
    got = QZ.quantize(x, T.BF16)
    np.testing.assert_array_equal(got.numpy(), ref.quantize(x.numpy(), T.BF16).view(np.uint8).reshape(-1))
    back = Q.dequantize(got, T.BF16, (6,))
    assert torch.isnan(back[0]) and back[1] == float("inf")
    assert back[3] == 1.0 and back[4] == 1.0 + 4 * 2**-8            # ties go to even


# Per-type bound on |dequantize(quantize(x)) - x| in units of the block's absmax
# (K-quants: of the 256-element super-block's absmax), derived in the comments.
ROUND_TRIP_BOUND = {
    # RTN with step amax/127; the stored fp16 d adds up to 127 * 2**-11 steps.
    T.Q8_0: 0.57 / 127,
    # Symmetric 4/5-bit: the signed absmax maps to -8 (-16); values of the other sign
    # can only reach +7 (+15) steps, so the worst case is one full step.
    T.Q4_0: 1.01 / 8,
    T.Q5_0: 1.01 / 16,
    # Affine: half a step of range/15 (31) plus fp16 rounding of d and min.
    T.Q4_1: 1.02 * 2 / 15 / 2 + 2e-3,
    T.Q5_1: 1.02 * 2 / 31 / 2 + 2e-3,
    # K-quants (simple RTN, see quantize()): half a sub-block step, plus the slack
    # from rounding the 6-bit (Q6_K: 8-bit) sub-block scales/mins, which can push
    # the top of a sub-block a few super-block units outside the grid.
    T.Q4_K: (2 / 15) * (0.5 + 8 / 63) + 0.5 / 63,
    T.Q5_K: (2 / 31) * (0.5 + 16 / 63) + 0.5 / 63,
    T.Q6_K: (1 / 31) * (0.5 + 16 / 127),
}


@pytest.mark.parametrize("qtype", list(ROUND_TRIP_BOUND), ids=lambda t: t.name)
@pytest.mark.parametrize("dist", ["normal", "uniform", "shifted", "outliers"])
def test_round_trip_error_bounded(qtype, dist):
    gen = torch.Generator().manual_seed(int(qtype) * 7 + len(dist))
    x = torch.randn(48, 1024, generator=gen)
    if dist == "uniform":
        x = torch.rand(48, 1024, generator=gen) * 2 - 1
    elif dist == "shifted":
        x = torch.rand(48, 1024, generator=gen) + 3.0          # all positive
    elif dist == "outliers":
        x[:, ::97] *= 50
    x[0, :256] = 0
    block_size = GGML_QUANT_SIZES[qtype][0]
    y = Q.dequantize(QZ.quantize(x, qtype), qtype, tuple(x.shape))
    err = (y - x).abs().view(-1, block_size)
    amax = x.abs().view(-1, block_size).amax(dim=1, keepdim=True)
    assert (err <= ROUND_TRIP_BOUND[qtype] * amax + 1e-30).all(), (err / amax.clamp(min=1e-30)).max().item()
    assert (y[0, :256] == 0).all()


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_round_trip_float_types(qtype):
    x = torch.randn(5, 96)
    y = Q.dequantize(QZ.quantize(x, qtype), qtype, (5, 96))
    want = {T.F32: x.clone(), T.F16: x.half().float(), T.BF16: x.bfloat16().float()}[qtype]
    assert torch.equal(y, want)
    packed = QZ.quantize(x, qtype)
    x.add_(1)                                       # the bytes are a copy, not a view of x
    assert torch.equal(Q.dequantize(packed, qtype, (5, 96)), want)


def test_quantize_errors():
    with pytest.raises(UnsupportedModelError, match="Q2_K"):
        QZ.quantize(torch.zeros(256), T.Q2_K)
    with pytest.raises(ValueError, match="not a multiple"):
        QZ.quantize(torch.zeros(2, 48), T.Q8_0)
    assert QZ.quantize(torch.zeros(0, 32), T.Q8_0).numel() == 0
    assert QZ.quantize(torch.zeros(3, 64), T.Q4_0).numel() == 3 * 2 * 18


# --------------------------------------------------------------------------
# timing (printed, not asserted)
# --------------------------------------------------------------------------

def _random_blocks(qtype: T, rows: int, cols: int) -> torch.Tensor:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n = rows * cols // block_size
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (n, type_size), dtype=torch.uint8, generator=gen)
    d = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    for at in FP16_FIELDS[qtype]:
        raw[:, at:at + 2] = d
    return raw.view(-1)


@pytest.mark.slow
def test_timing_print(capsys):
    # The brief asked for a 2048 x 640 Q4_K tensor, but 640 is not a multiple of the
    # 256-element K-quant block; in the model such a matrix is stored as 640 x 2048
    # (e.g. ffn_down), so that is what is timed.
    cases = [(T.Q8_0, (262144, 640)), (T.Q4_K, (640, 2048)), (T.Q6_K, (2048, 2048)), (T.Q5_0, (2048, 640))]
    lines = [f"dequantize timings ({torch.get_num_threads()} torch threads):"]
    for qtype, shape in cases:
        raw = _random_blocks(qtype, *shape)
        Q.dequantize(raw[: Q.row_nbytes(qtype, shape[1])], qtype, (1, shape[1]))   # warm up
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            out = Q.dequantize(raw, qtype, shape)
            best = min(best, time.perf_counter() - start)
        assert out.shape == shape and torch.isfinite(out[:4]).all()
        del out
        n = shape[0] * shape[1]
        lines.append(f"  {qtype.name:5s} {shape[0]:>6}x{shape[1]:<5} {best * 1e3:8.1f} ms  "
                     f"{n / best / 1e6:6.0f} Melem/s")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
