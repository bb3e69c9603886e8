"""input_sparse (y = W x over input-major tiles of the file's blocks, skipping inputs at or
below a threshold) against its reference, on every CPU path and every type the tiles hold:
the tiles' bytes (C++ against PyTorch), their values (the file's, bit for bit), the product
against masked x times the dequantized file weight in float64, paths agreeing bit for bit,
batch invariance, and the thresholded product equal to the masked dense one."""

from __future__ import annotations

import functools

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from ember.kernels import block_matmul as bm
from ember.kernels import input_sparse as isp
from ember.kernels import tile_layout as tl
from ember.models.quantize import quantize
from ember.models.weights import QTensor

needs_kernel = pytest.mark.skipif(not isp.available(), reason="C++ kernels not built here")
PATHS = bm.cpu_paths()
TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F32, Q.F16, Q.BF16)
# (N, K): whole groups of 64 rows, a short last group (100, 7 rows), several super-blocks
SHAPES = ((64, 256), (100, 512), (7, 256), (320, 768))


@functools.lru_cache(maxsize=None)
def weight(qtype: int, n: int, k: int) -> QTensor:
    g = torch.Generator().manual_seed(n * 13 + k + int(qtype))
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) + 0.1
    return QTensor(quantize(w, int(qtype)), int(qtype), (n, k))


@functools.lru_cache(maxsize=None)
def tiles(qtype: int, n: int, k: int) -> isp.InputMajor:
    return isp.relayout(weight(qtype, n, k))


def inputs(t: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 7 * t + k)
    return torch.randn(t, k, generator=g)


def threshold_keeping(x: torch.Tensor, kept: float) -> float | None:
    """A threshold that keeps about `kept` of x's values (None: all of them)."""
    if kept >= 1:
        return None
    if kept <= 0:
        return float(x.abs().max())
    return float(x.abs().flatten().quantile(1 - kept))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_tiles_hold_the_files_values_and_bytes(qtype, shape):
    w = weight(qtype, *shape)
    ref = isp.relayout_reference(w)
    header, run = tl.header_and_run_bytes(qtype, *shape)
    assert ref.nbytes == header + run * shape[1]
    if shape[0] % 64 == 0:  # no padding rows: exactly the file's bytes
        assert ref.nbytes == w.nbytes
    assert torch.equal(isp.dequantize_input_major(ref), w.dequantize())
    if isp.available():
        assert torch.equal(isp.relayout(w).packed, ref.packed)


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_masked_dense_file_weight(path, qtype, shape, restore_path):
    """Against the reference (x rounded as the kernel rounds it) to float32 rounding, and
    against masked x @ the file's dequantized weight in float64 to the int8 rounding of x
    (the 4-6 bit types; exact arithmetic aside, none for Q8_0 and the float types)."""
    bm.set_cpu_path(path)
    im = tiles(qtype, *shape)
    dense = weight(qtype, *shape).dequantize().double()
    for t in (1, 2, 7, 64):
        x = inputs(t, shape[1])
        for kept in (1.0, 0.5, 0.0):
            threshold = threshold_keeping(x, kept)
            got = isp.input_sparse_matmul(x, [im], threshold)
            ref = isp.input_sparse_matmul_reference(x, [im], threshold)
            scale = float(ref.abs().max()) + 1e-3
            assert (got - ref).abs().max() <= 2e-6 * shape[1] ** 0.5 * scale, (t, kept)
            xm = x if threshold is None else torch.where(x.abs() > threshold, x, 0 * x)
            want = (xm.double() @ dense.t()).float()
            # |x - its int8 rounding| <= max|x| / 254 per value: at most that times sum |w|
            bound = 1e-5 * (float(want.abs().max()) + 1e-3)
            if isp.integer_type(qtype):
                bound += float(dense.abs().sum(1).max() * xm.abs().max()) / 254
            assert (got - want).abs().max() <= bound, (t, kept)
            if kept == 0.0:
                assert not got.any()


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
def test_weights_side_by_side(path, restore_path):
    bm.set_cpu_path(path)
    ims = [tiles(Q.Q4_K, 320, 768), tiles(Q.Q6_K, 64, 768), tiles(Q.Q8_0, 100, 768)]
    x = inputs(5, 768)
    got = isp.input_sparse_matmul(x, ims, 0.3)
    parts = [isp.input_sparse_matmul(x, [w], 0.3) for w in ims]
    assert torch.equal(got, torch.cat(parts, 1))
    assert got.shape == (5, 320 + 64 + 100)


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_paths_agree_bit_for_bit(qtype, restore_path):
    im = tiles(qtype, 320, 768)
    x = inputs(11, 768)
    results = []
    for path in PATHS:
        bm.set_cpu_path(path)
        results.append([isp.input_sparse_matmul(x[:1], [im], 0.5),
                        isp.input_sparse_matmul(x, [im], 0.5),
                        isp.input_sparse_matmul(x, [im], None)])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", (Q.Q4_K, Q.Q6_K, Q.Q5_0), ids=lambda q: q.name)
@pytest.mark.parametrize("threshold", (None, 0.0, 0.7))
def test_batch_invariant(path, qtype, threshold, restore_path):
    bm.set_cpu_path(path)
    im = tiles(qtype, 320, 768)
    x = inputs(13, 768, seed=3)
    batch = isp.input_sparse_matmul(x, [im], threshold)
    for t in range(13):
        assert torch.equal(isp.input_sparse_matmul(x[t:t + 1], [im], threshold), batch[t:t + 1])
    assert torch.equal(isp.input_sparse_matmul(x[2:7], [im], threshold), batch[2:7])


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
def test_threshold_equals_masked_dense_exactly(path, restore_path):
    bm.set_cpu_path(path)
    im = tiles(Q.Q6_K, 100, 768)
    for t in (1, 6):
        x = inputs(t, 768, seed=5)
        masked = torch.where(x.abs() > 0.8, x, torch.zeros_like(x))
        assert torch.equal(isp.input_sparse_matmul(x, [im], 0.8),
                           isp.input_sparse_matmul(masked, [im], None))


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "reference"])
def test_stats_count_kept_inputs(native, monkeypatch):
    if native and not isp.available():
        pytest.skip("C++ kernels not built here")
    if not native:
        monkeypatch.setattr(isp, "_module", lambda: None)
    im = tiles(Q.Q8_0, 64, 256)
    x = inputs(3, 256)
    stats = torch.zeros(2, dtype=torch.int64)
    isp.input_sparse_matmul(x, [im], 0.5, stats)
    isp.input_sparse_matmul(x[:1], [im], None, stats)
    assert stats.tolist() == [int((x.abs() > 0.5).sum()) + 256, 4 * 256]


def test_bad_input_is_a_clear_error():
    q3 = QTensor(torch.zeros(64, 110, dtype=torch.uint8), int(Q.Q3_K), (64, 256))
    with pytest.raises(ValueError, match="not Q3_K"):
        isp.relayout(q3)
    im = tiles(Q.Q8_0, 64, 256)
    with pytest.raises(ValueError, match="256 inputs; x has 128"):
        isp.input_sparse_matmul(torch.randn(1, 128), [im])
    with pytest.raises(ValueError, match="threshold must be >= 0"):
        isp.input_sparse_matmul(torch.randn(1, 256), [im], -1.0)
