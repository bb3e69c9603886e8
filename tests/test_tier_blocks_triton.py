"""The fused Triton kernel for the GPU tier's file blocks (kernels/tier_blocks_triton.py), on
CUDA where there is a device (bench/gpu_check.sh) and else in Triton's interpreter on the CPU
(the same kernel source): every type it takes reads the file's values exactly (a one-hot x
picks a column of W), multiplies as the float64 reference does, gives a row the same bits
whatever rows share its call, decodes a prompt's tiles as torch ops do, and `TierBlocks`
sends a decoded token or a draft tree to it and a prompt to decoded tiles and a matmul."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from ember.kernels import tier_blocks
from ember.kernels import tier_blocks_triton as fused
from ember.kernels import triton_support
from ember.kernels.tier_blocks import TierBlocks, tier_blocks_matmul_reference
from ember.models.quantize import quantize
from ember.models.weights import QTensor

# not imported here: Triton takes its interpreter mode from TRITON_INTERPRET when first imported
if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton comes with CUDA builds of PyTorch", allow_module_level=True)

TYPES = [Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    if DEVICE.type == "cpu":  # Triton's interpreter (tests/conftest.py sets its mode)
        monkeypatch.setenv("EMBER_TIER_TRITON", "cpu")
    else:
        monkeypatch.delenv("EMBER_TIER_TRITON", raising=False)


def _tensor(qtype, n, k, seed, device=DEVICE) -> QTensor:
    g = torch.Generator().manual_seed(seed)
    raw = quantize(torch.randn(n, k, generator=g) * 0.05, int(qtype))
    return QTensor(raw.to(device), int(qtype), (n, k))


def _randn(*shape, seed) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _shape(qtype) -> tuple[int, int]:
    """Rows not a multiple of BLOCK_N; for 32-value types, K not a multiple of BLOCK_K."""
    return (37, 512) if qtype in (Q.Q4_K, Q.Q6_K) else (37, 352)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_one_hot_row_reads_the_files_values_exactly(qtype):
    n, k = _shape(qtype)
    t = _tensor(qtype, n, k, 1)
    w = _tensor(qtype, n, k, 1, "cpu").dequantize()
    # block edges, both nibbles, both halves of a K-quant super-block, the last value
    cols = torch.tensor([0, 1, 15, 16, 31, 32, 63, 64, 127, 128, 255, k - 1])
    x = torch.zeros(len(cols), k)
    x[torch.arange(len(cols)), cols] = 1.0
    y = fused.block_matmul(x.to(DEVICE), t.raw, t.qtype, t.shape)
    assert torch.equal(y.cpu(), w[:, cols].t())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_match_float64_and_a_rows_bits_do_not_depend_on_its_neighbours(qtype):
    n, k = _shape(qtype)
    t = _tensor(qtype, n, k, 2)
    x = _randn(fused.MAX_ROWS, k, seed=3)
    many = fused.block_matmul(x, t.raw, t.qtype, t.shape)
    want = tier_blocks_matmul_reference(x, [t])
    torch.testing.assert_close(many.cpu(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    for rows in ([0], [5], [4, 5, 6], [15, 2]):  # alone, in a short call, in another order
        assert torch.equal(fused.block_matmul(x[rows], t.raw, t.qtype, t.shape), many[rows])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16, torch.float32])
def test_decoded_tiles_are_the_files_values_in_the_tiers_type(qtype, half):
    n, k = _shape(qtype)
    t = _tensor(qtype, n, k, 8)
    want = _tensor(qtype, n, k, 8, "cpu").dequantize().to(half)
    assert torch.equal(fused.decode_rows(t.raw, t.qtype, t.shape, 0, n, half).cpu(), want)
    assert torch.equal(fused.decode_rows(t.raw, t.qtype, t.shape, 5, 17, half).cpu(), want[5:17])
    with pytest.raises(ValueError, match="rows 9..3"):
        fused.decode_rows(t.raw, t.qtype, t.shape, 9, 3, half)


def test_tier_blocks_send_a_few_rows_to_the_kernel_and_a_prompt_to_tiles_and_a_matmul(
        monkeypatch):
    monkeypatch.setattr(tier_blocks, "block_kernels_on", lambda device: False)
    a, b = _tensor(Q.Q4_K, 40, 256, 4), _tensor(Q.Q6_K, 24, 256, 5)
    w = TierBlocks.of([a, b], DEVICE, torch.float32)
    assert w.fused and not w.native
    x = _randn(fused.MAX_ROWS + 1, 256, seed=6)
    calls = []
    real = fused.block_matmul
    monkeypatch.setattr(fused, "block_matmul", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    few = w(x[:3])
    assert len(calls) == 2  # one kernel per matrix, each into its own columns
    want = tier_blocks_matmul_reference(x, w.parts)
    torch.testing.assert_close(few.cpu(), want[:3], rtol=1e-5,
                               atol=1e-5 * float(want.abs().max()))
    prompt = w(x)  # past MAX_ROWS: tiles decoded by the kernel, one matmul each (half type)
    assert len(calls) == 2
    torch.testing.assert_close(prompt.cpu(), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    # the very bits of the torch-op decoding (the same values, then the same matmul)
    assert torch.equal(prompt, tier_blocks.tier_blocks_matmul(x, w.parts, w.half))


def test_a_type_the_kernel_lacks_or_the_switch_off_keeps_the_torch_path(monkeypatch):
    monkeypatch.setattr(tier_blocks, "block_kernels_on", lambda device: False)
    assert not TierBlocks.of([_tensor(Q.Q5_K, 8, 256, 7)], DEVICE, torch.float32).fused
    assert not TierBlocks.of([_tensor(Q.Q4_K, 8, 256, 7), _tensor(Q.F16, 8, 256, 8)], DEVICE,
                             torch.float32).fused
    monkeypatch.setenv("EMBER_TIER_TRITON", "0")
    assert not TierBlocks.of([_tensor(Q.Q4_K, 8, 256, 7)], DEVICE, torch.float32).fused
    monkeypatch.delenv("EMBER_TIER_TRITON")
    assert not triton_support.usable(torch.device("cpu"))  # a CPU tier unasked: C++ or torch ops


def test_calls_the_kernel_cannot_take_say_why():
    t = _tensor(Q.Q8_0, 8, 64, 9)
    with pytest.raises(ValueError, match="rows of x"):
        fused.block_matmul(_randn(fused.MAX_ROWS + 1, 64, seed=0), t.raw, t.qtype, t.shape)
    with pytest.raises(ValueError, match="not a"):
        fused.block_matmul(_randn(1, 64, seed=0), t.raw[:-34], t.qtype, t.shape)
    with pytest.raises(ValueError, match="out must be"):
        fused.block_matmul(_randn(1, 64, seed=0), t.raw, t.qtype, t.shape,
                           out=torch.empty(1, 9, device=DEVICE))


def test_neighbours_of_one_type_become_one_launch(monkeypatch):
    """Gate and up (q and k) of one type are one matrix for the kernel: the same bytes, one
    launch; a part of another type stays apart."""
    monkeypatch.setattr(tier_blocks, "block_kernels_on", lambda device: False)
    a, b, c = _tensor(Q.Q4_K, 40, 256, 4), _tensor(Q.Q4_K, 24, 256, 5), _tensor(Q.Q6_K, 8, 256, 6)
    host = [QTensor(t.raw.cpu(), t.qtype, t.shape) for t in (a, b, c)]
    w = TierBlocks.of(host, DEVICE, torch.float32)
    assert [(t.qtype, t.shape) for t in w.parts] == [(Q.Q4_K, (64, 256)), (Q.Q6_K, (8, 256))]
    assert w.nbytes() == a.nbytes + b.nbytes + c.nbytes
    calls = []
    real = fused.block_matmul
    monkeypatch.setattr(fused, "block_matmul", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = _randn(2, 256, seed=7)
    got = w(x)
    assert len(calls) == 2
    want = tier_blocks_matmul_reference(x, host)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
