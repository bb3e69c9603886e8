"""The GPU tier in the file's own blocks (kernels/tier_blocks.py): every type a Q4_K_M,
Q5_K_M or Q8_0 file holds, decoded on the device by torch ops exactly as the host decodes
them, multiplied against the float64 reference by both paths (the C++ block kernels a CPU
tier runs, the torch path CUDA runs, forced here on the CPU), hot neurons sliced in whole
blocks with their bytes stated to the byte, and the plan's per-layer modes read in one place."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from ember.kernels import block_matmul as bm
from ember.kernels import tier_blocks
from ember.kernels.hot_ffn import (HotFFNWeights, file_format, file_hot_bytes, granule,
                                   hot_ffn, hot_ffn_bytes, hot_ffn_reference)
from ember.kernels.tier_blocks import (TierBlocks, bits_per_weight, down_columns,
                                       tier_blocks_matmul, tier_blocks_matmul_reference)
from ember.models import quants
from ember.models.quantize import quantize
from ember.models.weights import QTensor
from ember.offload.hybrid.ffn import whole_groups

TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F16, Q.BF16, Q.F32]


def _tensor(qtype, n=48, k=512, seed=0) -> QTensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    return QTensor(quantize(w, int(qtype)), int(qtype), (n, k))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_decoded_blocks_are_the_files_values_bit_for_bit(qtype):
    t = _tensor(qtype)
    values, nbytes = quants.block_info(int(qtype))
    blocks = t.raw.view(-1, nbytes)
    got = quants.decode_blocks(blocks, int(qtype)).reshape(t.shape)
    assert torch.equal(got, t.dequantize())
    # a tile of rows in the middle decodes to those rows (what the torch path reads)
    part = tier_blocks._decoded(t, 5, 17)
    assert torch.equal(part, t.dequantize()[5:17])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("torch_path", [False, True], ids=["block-kernels", "torch"])
def test_tier_blocks_multiply_as_the_files_values(qtype, torch_path, monkeypatch):
    if torch_path:
        monkeypatch.setattr(tier_blocks, "block_kernels_on", lambda device: False)
    elif not (bm.available() and bm.supports(int(qtype))):
        pytest.skip("no C++ block kernels for this type here")
    a, b = _tensor(qtype, 48, 512, 1), _tensor(qtype, 16, 512, 2)
    w = TierBlocks.of([a, b], "cpu", torch.float32)
    assert w.native == (not torch_path) and w.shape == (64, 512) and w.error == 0
    assert w.nbytes() == a.nbytes + b.nbytes  # the file's bytes, nothing more
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(3))
    want = tier_blocks_matmul_reference(x, w.parts)
    got = w(x)
    # the block kernels round x to 8 bits per block (the host's arithmetic); the torch path
    # multiplies in the tier's type (float32 here)
    tol = 2e-2 if not torch_path and qtype not in (Q.F16, Q.BF16, Q.F32) else 1e-4
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))
    assert torch.equal(w.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))


def test_the_torch_path_decodes_in_tiles_and_in_the_tiers_half_type(monkeypatch):
    t = _tensor(Q.Q4_K, 40, 256, 4)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(5))
    want = tier_blocks_matmul_reference(x, [t])
    monkeypatch.setattr(tier_blocks, "TILE_VALUES", 256 * 7)  # 7 rows a tile: 6 tiles
    got = tier_blocks_matmul(x, [t], torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    half = tier_blocks_matmul(x, [t], torch.bfloat16)
    assert half.dtype == torch.float32
    assert float((half - want).norm() / want.norm()) < 1e-2


def test_bits_per_weight_are_the_files():
    assert bits_per_weight(Q.Q4_K) == 4.5 and bits_per_weight(Q.Q6_K) == 6.5625
    assert bits_per_weight(Q.Q8_0) == 8.5 and bits_per_weight(Q.Q4_0) == 4.5
    assert bits_per_weight(Q.Q5_0) == 5.5 and bits_per_weight(Q.F16) == 16


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q8_0, Q.F16], ids=lambda t: t.name)
def test_down_columns_are_whole_blocks_of_the_files_bytes(qtype):
    down = _tensor(qtype, 64, 1024, 6)  # (hidden, ffn)
    g = quants.block_info(int(qtype))[0]  # neurons per block of down's input axis
    groups = torch.tensor([0, 2]) if g > 1 else torch.tensor([3, 700])
    cols = down_columns(down, groups)
    idx = (groups[:, None] * g + torch.arange(g)[None, :]).reshape(-1)
    assert cols.shape == (64, len(idx))
    assert torch.equal(cols.dequantize(), down.dequantize()[:, idx])
    assert cols.nbytes == 64 * quants.row_nbytes(int(qtype), len(idx))


def test_a_hot_set_becomes_whole_groups_holding_most_of_it():
    # 270 neurons asked for: one group of 256, the one holding most of them (group 1)
    asked = np.r_[np.arange(10), np.arange(256, 456), np.arange(700, 760)]
    assert whole_groups(asked, 256, 1024).tolist() == list(range(256, 512))
    assert whole_groups(np.arange(512, 1024), 256, 1024).tolist() == list(range(512, 1024))
    assert whole_groups(np.array([5]), 256, 1024).size == 0
    assert whole_groups(np.array([9, 4]), 1, 16).tolist() == [4, 9]


@pytest.mark.parametrize("n_groups", [1, 2])
def test_hot_neurons_in_the_files_blocks_are_the_reference_ffn_and_state_their_bytes(n_groups):
    hidden, ffn = 256, 512
    gate, up = _tensor(Q.Q4_K, ffn, hidden, 7), _tensor(Q.Q4_K, ffn, hidden, 8)
    down = _tensor(Q.Q6_K, hidden, ffn, 9)
    formats = (file_format(["Q4_K", "Q4_K"]), file_format(["Q6_K"]))
    assert granule(formats) == 256
    groups = torch.arange(n_groups) if n_groups == 2 else torch.tensor([1])
    idx = (groups[:, None] * 256 + torch.arange(256)[None, :]).reshape(-1)
    w = HotFFNWeights.from_file([gate.select_rows(idx), up.select_rows(idx)],
                                down_columns(down, groups), "silu_glu", "cpu", torch.float32)
    n = len(idx)
    assert w.nbytes() == hot_ffn_bytes(n, hidden, True, formats) == file_hot_bytes(n, hidden,
                                                                                   formats)
    assert file_hot_bytes(n + 100, hidden, formats) == w.nbytes()  # whole groups only
    x = torch.randn(2, hidden, generator=torch.Generator().manual_seed(10))
    want = hot_ffn_reference(x, w)
    got = hot_ffn(x, w)
    assert float((got - want).norm() / want.norm()) < 3e-2  # x at 8 bits a block


def test_the_int4_layout_is_chosen_per_device_in_one_place():
    from ember.kernels.tier_weights import _pack_int4, int4_ops

    cpu, cuda = int4_ops(torch.device("cpu")), int4_ops(torch.device("cuda"))
    assert cpu.mm is torch.ops.aten._weight_int4pack_mm_for_cpu
    assert cuda.mm is torch.ops.aten._weight_int4pack_mm
    # CUDA's packer takes two codes a byte (even index high); the CPU's the codes themselves
    q = torch.tensor([[1, 2, 15, 0] * 8] * 16, dtype=torch.int32)
    assert cuda.codes(q)[0, :2].tolist() == [0x12, 0xF0]
    assert torch.equal(cpu.codes(q), q)
    assert _pack_int4(q, torch.device("cpu")).numel() > 0
