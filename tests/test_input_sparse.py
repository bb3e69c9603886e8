"""input_sparse (y = W x over an input-major layout, skipping inputs at or below a threshold)
against its reference, on every CPU path: re-layout bytes, values, batch invariance, and the
thresholded product equal to the masked dense one bit for bit."""

from __future__ import annotations

import functools

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from ember.kernels import block_matmul as bm
from ember.kernels import input_sparse as isp
from ember.models.quantize import quantize
from ember.models.weights import QTensor

needs_kernel = pytest.mark.skipif(not isp.available(), reason="C++ kernels not built here")
PATHS = bm.cpu_paths()
SOURCES = (Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.F16)
# (N, K): one block, a short tail chunk (288 = 256 + 32), the default model's 640, several chunks
SHAPES = ((32, 256), (288, 512), (640, 256), (1056, 768))


@functools.lru_cache(maxsize=None)
def weight(qtype: int, n: int, k: int) -> QTensor:
    g = torch.Generator().manual_seed(n * 13 + k + int(qtype))
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) + 0.1
    return QTensor(quantize(w, int(qtype)), int(qtype), (n, k))


@functools.lru_cache(maxsize=None)
def laid_out(qtype: int, n: int, k: int) -> isp.InputMajor:
    return isp.relayout(weight(qtype, n, k))


def inputs(t: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 7 * t + k)
    return torch.randn(t, k, generator=g)


@pytest.fixture
def restore_path():
    before = bm.cpu_path() if bm.available() else None
    yield
    if before is not None:
        bm.set_cpu_path(before)


@needs_kernel
@pytest.mark.parametrize("qtype", SOURCES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_relayout_matches_reference_bytes(qtype, shape):
    w = weight(qtype, *shape)
    got, want = isp.relayout(w), isp.relayout_reference(w)
    assert got.qtype == want.qtype == isp.layout_type(qtype)
    assert torch.equal(got.packed, want.packed)
    assert got.nbytes == shape[0] * shape[1] // 32 * {2: 18, 6: 22, 8: 34}[got.qtype]


@pytest.mark.parametrize("qtype,limit", [(Q.Q8_0, 0.01), (Q.Q5_0, 0.06), (Q.Q4_K, 0.12)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_relayout_error_is_measured_and_small(qtype, limit):
    w = weight(qtype, 288, 512)
    err = isp.relayout_error(w, isp.relayout_reference(w))
    assert 0 < err < limit


def test_dequantize_input_major_is_the_transpose():
    w = weight(Q.Q8_0, 288, 256)
    im = isp.relayout_reference(w, int(Q.Q8_0))
    assert torch.allclose(isp.dequantize_input_major(im), w.dequantize(), atol=0.02, rtol=0.01)


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", (Q.Q4_K, Q.Q5_0, Q.Q6_K), ids=lambda q: q.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_reference(path, qtype, shape, restore_path):
    bm.set_cpu_path(path)
    im = laid_out(qtype, *shape)
    for t in (1, 3, 9, 17):
        x = inputs(t, shape[1])
        for threshold in (None, 0.0, 0.6, 10.0):
            got = isp.input_sparse_matmul(x, [im], threshold)
            want = isp.input_sparse_matmul_reference(x, [im], threshold)
            scale = want.abs().max().clamp_min(1.0)
            assert (got - want).abs().max() <= 2e-5 * scale, (t, threshold)


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
def test_weights_side_by_side(path, restore_path):
    bm.set_cpu_path(path)
    ims = [laid_out(Q.Q4_K, 288, 256), laid_out(Q.Q8_0, 32, 256), laid_out(Q.Q5_0, 640, 256)]
    x = inputs(5, 256)
    got = isp.input_sparse_matmul(x, ims, 0.3)
    parts = [isp.input_sparse_matmul(x, [w], 0.3) for w in ims]
    assert torch.equal(got, torch.cat(parts, 1))
    assert got.shape == (5, 288 + 32 + 640)


@needs_kernel
def test_paths_agree_bit_for_bit(restore_path):
    im = laid_out(Q.Q5_0, 1056, 768)
    x = inputs(11, 768)
    results = []
    for path in PATHS:
        bm.set_cpu_path(path)
        results.append([isp.input_sparse_matmul(x[:1], [im], 0.5),
                        isp.input_sparse_matmul(x, [im], None)])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("threshold", (None, 0.0, 0.7))
def test_batch_invariant(path, threshold, restore_path):
    bm.set_cpu_path(path)
    im = laid_out(Q.Q4_K, 640, 512)
    x = inputs(13, 512, seed=3)
    batch = isp.input_sparse_matmul(x, [im], threshold)
    for t in range(13):
        assert torch.equal(isp.input_sparse_matmul(x[t:t + 1], [im], threshold), batch[t:t + 1])
    assert torch.equal(isp.input_sparse_matmul(x[2:7], [im], threshold), batch[2:7])


@needs_kernel
@pytest.mark.parametrize("path", PATHS)
def test_threshold_equals_masked_dense_exactly(path, restore_path):
    bm.set_cpu_path(path)
    im = laid_out(Q.Q6_K, 288, 768)
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
    im = laid_out(Q.Q8_0, 32, 256)
    x = inputs(3, 256)
    stats = torch.zeros(2, dtype=torch.int64)
    isp.input_sparse_matmul(x, [im], 0.5, stats)
    isp.input_sparse_matmul(x[:1], [im], None, stats)
    assert stats.tolist() == [int((x.abs() > 0.5).sum()) + 256, 4 * 256]


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="whole blocks of 32"):
        isp.relayout(weight(Q.Q8_0, 32, 256).__class__(
            quantize(torch.randn(40, 256), int(Q.Q8_0)), int(Q.Q8_0), (40, 256)))
    im = laid_out(Q.Q8_0, 32, 256)
    with pytest.raises(ValueError, match="256 inputs; x has 128"):
        isp.input_sparse_matmul(torch.randn(1, 128), [im])
    with pytest.raises(ValueError, match="threshold must be >= 0"):
        isp.input_sparse_matmul(torch.randn(1, 256), [im], -1.0)
