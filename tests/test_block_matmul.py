"""block_matmul (x @ W^T straight from GGML blocks) against its reference, on every CPU path."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from ember.kernels import block_matmul as bm
from ember.models import quants
from ember.models.quantize import quantize
from ember.models.weights import QTensor

needs_kernel = pytest.mark.skipif(not bm.available(), reason="C++ kernels not built here")

K_TYPES = {int(Q.Q4_K), int(Q.Q5_K), int(Q.Q6_K)}
FLOAT_TYPES = {int(Q.F32), int(Q.F16), int(Q.BF16)}
TYPES = sorted(bm.NATIVE_TYPES)
PATHS = bm.cpu_paths()


def name(qtype: int) -> str:
    return quants.type_name(qtype)


def columns(qtype: int) -> tuple[int, ...]:
    """K values to try: whole 256-blocks for the K-quants; for the 32-value types also single
    blocks and a group of 8 plus trailing blocks (352); odd K for the float types."""
    if qtype in K_TYPES:
        return (256, 512, 768)
    if qtype in FLOAT_TYPES:
        return (32, 100, 256, 768)
    return (32, 96, 256, 352, 768)


@functools.lru_cache(maxsize=None)
def weight(qtype: int, n: int, k: int, seed: int = 0) -> QTensor:
    """Rows of mixed scale and sign bias, so that block mins and offsets matter."""
    g = torch.Generator().manual_seed(seed * 1000 + n * 7 + k + qtype)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) \
        + torch.randn(n, 1, generator=g) * 0.2
    return QTensor(quantize(w, qtype), qtype, (n, k))


def inputs(t: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 31 * t + k)
    return torch.randn(t, k, generator=g) * 2 + 0.3


def close_to(got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, ws, rel: float = 1e-5) -> None:
    """Within float32 rounding: `rel` of the output's scale, the largest sum |x_i| |w_i| (an
    output can be far smaller than its terms: Q4_1's min and the quants' sum cancel)."""
    scale = max(float((x.abs().double() @ quants.dequantize(w.raw, int(w.qtype), w.shape)
                       .abs().double().t()).max()) for w in ws)
    torch.testing.assert_close(got, ref, rtol=0, atol=rel * scale + 1e-30)


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES, ids=name)
def test_kernel_matches_reference_on_every_path(qtype, restore_path):
    for k in columns(qtype):
        for n in (1, 3, 37, 300):
            w = weight(qtype, n, k)
            for t in (1, 2, 7, 64):
                x = inputs(t, k)
                ref = bm.block_matmul_reference(x, [w])
                for path in PATHS:
                    bm.set_cpu_path(path)
                    got = bm.block_matmul(x, [w])
                    assert got.shape == (t, n) and got.dtype == torch.float32
                    close_to(got, ref, x, [w])


@pytest.mark.parametrize("qtype", TYPES, ids=name)
def test_reference_is_the_float_matmul_up_to_rounding_x(qtype):
    """The reference differs from float64 x @ W^T only by x's rounding to int8 (half a step,
    max|x_block| / 254, per value; none for the float types): within sum_i |w_i| * step_i / 2.
    For these inputs that is ~0.2-0.5% of the output's scale, as with llama.cpp's CPU backend."""
    k = 256 if qtype in FLOAT_TYPES else columns(qtype)[-1]
    w, x = weight(qtype, 50, k), inputs(5, k)
    wf = quants.dequantize(w.raw, qtype, w.shape).double()
    exact = x.double() @ wf.t()
    ref = bm.block_matmul_reference(x, [w]).double()
    if qtype in FLOAT_TYPES:
        torch.testing.assert_close(ref, exact, rtol=1e-6, atol=1e-6 * float(exact.abs().max()))
        return
    block = 256 if qtype in K_TYPES else 32
    _, d = bm.quantize_activations_reference(x, block)
    half_step = (d.double() / 2).expand(-1, -1, block).reshape(5, k)
    bound = half_step @ wf.abs().t()
    assert ((ref - exact).abs() <= bound * (1 + 1e-6) + 1e-6).all()
    assert (ref - exact).abs().max() < 0.01 * exact.abs().max()


def test_activation_rounding_is_symmetric_int8_per_block():
    x = inputs(3, 512)
    x[0, :256] = 0  # an all-zero block of either size
    for block in (32, 256):
        q, d = bm.quantize_activations_reference(x, block)
        assert q.abs().max() == 127 and torch.equal(q, q.round())
        assert float(d[0, 0]) == 0 and not q[0, 0].any()
        err = (q * d).reshape(3, 512) - x
        assert (err.abs() <= (d / 2).expand(-1, -1, block).reshape(3, 512) * (1 + 1e-6)).all()


@needs_kernel
def test_several_weights_in_one_call_are_the_calls_side_by_side(restore_path):
    """Mixed types sharing K: one call, outputs in order, bit-identical to separate calls."""
    k = 512
    ws = [weight(int(Q.Q4_K), 37, k), weight(int(Q.Q5_0), 3, k), weight(int(Q.F16), 5, k),
          weight(int(Q.Q6_K), 300, k), weight(int(Q.Q8_0), 1, k), weight(int(Q.Q4_1), 64, k)]
    x = inputs(7, k)
    for path in PATHS:
        bm.set_cpu_path(path)
        together = bm.block_matmul(x, ws)
        assert together.shape == (7, sum(w.shape[0] for w in ws))
        assert torch.equal(together, torch.cat([bm.block_matmul(x, [w]) for w in ws], 1))
        close_to(together, bm.block_matmul_reference(x, ws), x, ws)


@needs_kernel
@pytest.mark.parametrize("k", [352, 768])
def test_each_row_of_x_is_independent_of_the_batch_and_threads(k, restore_path):
    """A row of x gives bit-identical outputs alone, among T rows, in any split, and for any
    thread count (speculative verification relies on it). 53 rows: three tiles of 16 for the
    K-quants' prefill kernel (on AVX-512 the one with weight rows in lanes, 48 tokens) and 5
    for the row kernel; the first 5 alone take the row kernel, the other 48 the prefill one
    again; alone, every row takes the row kernel.
    Weights big enough to be split into several thread ranges and row tiles."""
    types = [t for t in TYPES if t not in K_TYPES or k % 256 == 0]
    ws = [weight(t, 300, k, seed=1) for t in types]
    x = inputs(53, k, seed=5)
    threads = torch.get_num_threads()
    try:
        for path in PATHS:
            bm.set_cpu_path(path)
            together = bm.block_matmul(x, ws)
            alone = torch.cat([bm.block_matmul(x[i:i + 1], ws) for i in range(len(x))])
            assert torch.equal(together, alone)
            split = torch.cat([bm.block_matmul(x[:5], ws), bm.block_matmul(x[5:], ws)])
            assert torch.equal(together, split)
            torch.set_num_threads(1)
            assert torch.equal(bm.block_matmul(x, ws), together)
            torch.set_num_threads(threads)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("qtype", sorted(K_TYPES), ids=name)
def test_k_quants_give_the_same_bits_on_every_path(qtype, restore_path):
    """The K-quants' arithmetic is one fixed sequence per output (the block's int32 sums, then
    acc += isum * (d * d_x), acc -= msum * (dmin * d_x)) in the portable path, the AVX2 row
    kernel and prefill kernel, and the AVX-512 ones, alike. One row of x: the row kernels; 40
    rows of x: two tiles of 16 in the prefill kernel with tokens in lanes; 80: five, in the one
    with weight rows in lanes (37 weight rows: two groups of 16 and a part)."""
    w = weight(qtype, 37, 512)
    for t in (1, 40, 80):
        x = inputs(t, 512)
        outs = []
        for path in PATHS:
            bm.set_cpu_path(path)
            outs.append(bm.block_matmul(x, [w]))
        assert all(torch.equal(outs[0], o) for o in outs[1:])


@needs_kernel
@pytest.mark.skipif("avx512" not in PATHS, reason="this CPU or build has no AVX-512 path")
@pytest.mark.parametrize("qtype", [t for t in TYPES if t not in FLOAT_TYPES], ids=name)
def test_avx512_gives_the_avx2_paths_bits(qtype, restore_path):
    """Every block's integer sum is exact on both, and the float steps after it are the same:
    rows of x in prefill tiles and not (40 = 2 tiles of 16 + 8; 56 = 3 + 8, where the K-quants
    hold weight rows in lanes), and a K of 8 whole groups of 8 32-value blocks plus 3 trailing
    ones (2144 = 8 * 256 + 96; the K-quants take 2048); and one row of x (the row kernels)."""
    k = 2048 if qtype in K_TYPES else 2144
    w = weight(qtype, 29, k)
    for t in (1, 40, 56):
        x = inputs(t, k)
        outs = []
        for path in ("avx2", "avx512"):
            bm.set_cpu_path(path)
            outs.append(bm.block_matmul(x, [w]))
        assert torch.equal(outs[0], outs[1])


def extreme_k_quant(qtype: int, n: int, k: int) -> QTensor:
    """K-quant rows at the edges of the integer sums: every quant and scale at its largest (and
    Q6_K's scales at -128 and 127) on even rows, random bytes on odd ones; fp16 d and dmin
    finite."""
    values, nbytes = quants.block_info(qtype)
    g = torch.Generator().manual_seed(qtype)
    blocks = torch.randint(0, 256, (n, k // values, nbytes), dtype=torch.uint8, generator=g)
    blocks[0::2] = 255
    one, half = torch.tensor([0x00, 0x3C], dtype=torch.uint8), torch.tensor([0x00, 0x38], dtype=torch.uint8)
    if qtype == int(Q.Q6_K):
        blocks[0::2, :, 192:208:2] = 0x80
        blocks[0::2, :, 193:208:2] = 0x7F
        blocks[..., 208:210] = one
    else:
        blocks[..., 0:2], blocks[..., 2:4] = one, half
    return QTensor(blocks.reshape(-1).contiguous(), qtype, (n, k))


@needs_kernel
@pytest.mark.parametrize("qtype", sorted(K_TYPES), ids=name)
def test_k_quants_at_the_edges_of_their_integer_sums(qtype, restore_path):
    """Largest quants and scales against x at +-127 everywhere, so that the int16 stages the
    kernels rely on (AVX2's vpmaddubsw pairs and their vphaddw folds, AVX-512's vpdpbusd runs
    of 4 packed to int16) reach their bounds, and against ordinary x: the same bits on every
    path, for one row of x and for prefill tiles, and within rounding of the reference."""
    w = extreme_k_quant(qtype, 37, 512)
    for t in (1, 3, 80):
        x = inputs(t, 512)
        x[0] = 1.0
        if t > 1:
            x[1] = -1.0
        ref = bm.block_matmul_reference(x, [w])
        outs = []
        for path in PATHS:
            bm.set_cpu_path(path)
            outs.append(bm.block_matmul(x, [w]))
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        close_to(outs[0], ref, x, [w])


@needs_kernel
def test_zero_and_tiny_blocks_of_x(restore_path):
    k = 512
    ws = [weight(t, 40, k) for t in TYPES]
    x = inputs(3, k)
    x[0] = 0  # an all-zero row: exactly zero out, also for the types with a min
    x[1, 32:288] = 0  # a zero 256-block (and 8 zero 32-blocks)
    x[2, :256] = 1e-30  # tiny but normal values
    for path in PATHS:
        bm.set_cpu_path(path)
        got = bm.block_matmul(x, ws)
        assert torch.equal(got[0], torch.zeros_like(got[0]))
        close_to(got, bm.block_matmul_reference(x, ws), x, ws)


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES, ids=name)
def test_dequantize_row_is_the_references_bit_for_bit(qtype):
    k = columns(qtype)[-1]
    w = weight(qtype, 20, k)
    full = quants.dequantize(w.raw, qtype, w.shape)
    for i in (0, 7, 19):
        row = bm.dequantize_row(w, i)
        assert row.shape == (1, k) and row.dtype == torch.float32
        assert torch.equal(row[0], full[i])
    with pytest.raises(IndexError, match="outside"):
        bm.dequantize_row(w, 20)


def test_without_the_extension_the_reference_runs(monkeypatch):
    w, x = weight(int(Q.Q4_K), 9, 256), inputs(2, 256)
    monkeypatch.setattr(bm, "_module", lambda: None)
    assert not bm.available() and bm.cpu_path() == "reference"
    assert torch.equal(bm.block_matmul(x, [w]), bm.block_matmul_reference(x, [w]))
    full = quants.dequantize(w.raw, w.qtype, w.shape)
    assert torch.equal(bm.dequantize_row(w, 4)[0], full[4])


@pytest.mark.parametrize("use_kernel", [True, False])
def test_bad_inputs_raise_clear_errors(use_kernel, monkeypatch):
    if use_kernel and not bm.available():
        pytest.skip("C++ kernels not built here")
    if not use_kernel:
        monkeypatch.setattr(bm, "_module", lambda: None)
    w = weight(int(Q.Q4_0), 4, 64)
    with pytest.raises(ValueError, match="columns"):
        bm.block_matmul(torch.randn(2, 96), [w])  # wrong K
    with pytest.raises(ValueError, match="float32"):
        bm.block_matmul(torch.randn(2, 64, dtype=torch.float64), [w])
    with pytest.raises(ValueError, match="float32"):
        bm.block_matmul(torch.randn(64), [w])
    q2k = QTensor(torch.zeros(84, dtype=torch.uint8), int(Q.Q2_K), (1, 256))
    with pytest.raises(ValueError, match="Q2_K"):
        bm.block_matmul(torch.randn(1, 256), [q2k])
    short = QTensor(w.raw[:-1], w.qtype, w.shape)
    with pytest.raises(ValueError, match="bytes"):
        bm.block_matmul(torch.randn(1, 64), [short])
    with pytest.raises(ValueError, match="blocks"):  # K=48 is no whole number of Q4_0 blocks
        bm.block_matmul(torch.randn(1, 48), [QTensor(torch.zeros(18, dtype=torch.uint8),
                                                     int(Q.Q4_0), (1, 48))])
    with pytest.raises(ValueError, match="not read natively"):
        bm.dequantize_row(q2k, 0)


@needs_kernel
def test_the_kernel_itself_refuses_bad_arguments():
    """C++ callers get ValueErrors (never a crash) for what the wrapper would have caught."""
    from ember.kernels import cpu_extension

    module = cpu_extension.load()
    w = weight(int(Q.Q4_K), 4, 256)
    rows = w.raw.view(4, -1)
    x = torch.randn(1, 256)
    with pytest.raises(ValueError, match="bytes|whole rows"):
        module.block_matmul(x, [rows[:, :-1].contiguous()], [int(Q.Q4_K)])
    with pytest.raises(ValueError, match="columns"):
        module.block_matmul(torch.randn(1, 96), [rows], [int(Q.Q4_K)])
    with pytest.raises(ValueError, match="not read natively"):
        module.block_matmul(x, [rows], [int(Q.Q2_K)])
    with pytest.raises(ValueError, match="types"):
        module.block_matmul(x, [rows, rows], [int(Q.Q4_K)])
    with pytest.raises(ValueError, match="contiguous"):
        module.block_matmul(x, [rows.t()], [int(Q.Q4_K)])
    with pytest.raises(ValueError, match="float32"):
        module.block_matmul(x.double(), [rows], [int(Q.Q4_K)])
    with pytest.raises(IndexError, match="outside"):
        module.dequantize_row(rows, int(Q.Q4_K), -1)
    # The flat bytes work too (the wrapper passes them so: no view per call).
    assert torch.equal(module.block_matmul(x, [w.raw], [int(Q.Q4_K)]),
                       module.block_matmul(x, [rows], [int(Q.Q4_K)]))


@needs_kernel
def test_cpu_paths(restore_path):
    assert "portable" in PATHS and bm.cpu_path() in PATHS
    for path in PATHS:
        bm.set_cpu_path(path)
        assert bm.cpu_path() == path
    with pytest.raises(ValueError, match="portable"):  # names the choices
        bm.set_cpu_path("avx9000")


@needs_kernel
@pytest.mark.slow
def test_env_var_picks_the_path_or_says_what_is_wrong():
    code = ("from ember.kernels import block_matmul as bm; import sys\n"
            "try:\n print(bm.cpu_path())\nexcept ValueError as e:\n print('ValueError:', e)")
    env = dict(os.environ, EMBER_CPU_PATH="portable")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "portable"
    env["EMBER_CPU_PATH"] = "sse9"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("ValueError:") and "EMBER_CPU_PATH" in out and "portable" in out
