"""Row groups: K-quant matrices with 16 rows interleaved block by block (QTensor.in_row_groups),
the one-token AVX-512 kernel's layout. Every reader gets the file layout's bits from them."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from ember.kernels import block_matmul as bm
from ember.kernels.tier_blocks import down_columns
from ember.models import quants
from ember.models.quantize import quantize
from ember.models.weights import ROW_GROUP, QTensor
from ember.offload.options.engine_options import EngineOptions
from ember.offload.options.sampling import GREEDY
from ember.offload.runtime.engine import Engine

needs_kernel = pytest.mark.skipif(not bm.available(), reason="C++ kernels not built here")
K_TYPES = [int(Q.Q4_K), int(Q.Q5_K), int(Q.Q6_K)]
PATHS = bm.cpu_paths()


def name(qtype: int) -> str:
    return quants.type_name(qtype)


def weight(qtype: int, n: int, k: int, seed: int = 0) -> QTensor:
    g = torch.Generator().manual_seed(seed * 1000 + n * 7 + k + qtype)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) \
        + torch.randn(n, 1, generator=g) * 0.2
    return QTensor(quantize(w, qtype), qtype, (n, k))


def grouped(w: QTensor) -> QTensor:
    """w in row groups, on a copy of its bytes (in_row_groups reorders in place)."""
    return QTensor(w.raw.clone(), w.qtype, w.shape).in_row_groups()


@pytest.mark.parametrize("qtype", K_TYPES, ids=name)
def test_the_layout_is_block_b_of_sixteen_rows_side_by_side(qtype):
    w = weight(qtype, 32, 768)
    g = grouped(w)
    _, nbytes = quants.block_info(qtype)
    file_blocks = w.raw.view(32, 3, nbytes)
    group_blocks = g.raw.view(2, 3, ROW_GROUP, nbytes)
    for r in (0, 5, 15, 16, 31):
        for b in range(3):
            assert torch.equal(group_blocks[r // 16, b, r % 16], file_blocks[r, b])
    assert g.grouped and g.nbytes == w.nbytes and g.raw.data_ptr() != w.raw.data_ptr()


@pytest.mark.parametrize("qtype", K_TYPES, ids=name)
def test_every_reader_gets_the_file_layouts_values(qtype):
    w = weight(qtype, 48, 512)
    g = grouped(w)
    assert torch.equal(g.file_layout().raw, w.raw) and not g.file_layout().grouped
    assert torch.equal(g.dequantize(), w.dequantize())
    picked = torch.tensor([47, 0, 17, 17, 33])
    assert torch.equal(g.select_rows(picked).raw, w.select_rows(picked).raw)
    assert torch.equal(g.dequantize_rows(picked), w.dequantize_rows(picked))
    # a slice between groups stays a view in groups; one across them is a copy in rows
    aligned, ragged = g.row_slice(16, 48), g.row_slice(5, 21)
    assert aligned.grouped and aligned.raw.data_ptr() == g.raw.data_ptr() + 16 * g.rows()[0, 0].numel()
    assert torch.equal(aligned.file_layout().raw, w.row_slice(16, 48).raw)
    assert not ragged.grouped and torch.equal(ragged.raw, w.row_slice(5, 21).raw)
    blocks = torch.tensor([1])  # of the 2 blocks a row
    assert torch.equal(down_columns(g, blocks).raw, down_columns(w, blocks).raw)
    for index in (0, 15, 16, 21, 47):  # first and last lanes, one between
        assert torch.equal(bm.dequantize_row_reference(g, index), bm.dequantize_row_reference(w, index))
        if bm.available():
            assert torch.equal(bm.dequantize_row(g, index), bm.dequantize_row(w, index))


def test_only_k_quant_matrices_in_whole_groups_take_them():
    assert not weight(int(Q.Q8_0), 32, 256).can_group()   # no kernel reads Q8_0 groups
    assert not weight(int(Q.Q4_K), 40, 256).can_group()   # 40 rows: not whole groups
    g = grouped(weight(int(Q.Q4_K), 32, 256))
    assert not g.can_group()                                # grouped already
    with pytest.raises(ValueError, match="cannot take row groups"):
        weight(int(Q.Q6_K), 20, 256).in_row_groups()


@needs_kernel
@pytest.mark.parametrize("qtype", K_TYPES, ids=name)
def test_block_matmul_gives_the_same_bits_on_every_path(qtype, restore_path):
    """One row of x (the AVX-512 group kernel), a few (the row kernel, group by group), 16-47
    (tiles of 16 tokens) and 48 on (weight rows in lanes); beside a weight in the file's layout
    in the same call; on paths without group kernels each tile goes back to rows first."""
    w, other = weight(qtype, 64, 768), weight(int(Q.Q8_0), 24, 768)
    g = grouped(w)
    for path in PATHS:
        bm.set_cpu_path(path)
        for t in (1, 2, 3, 9, 16, 17, 40, 50, 80):
            x = torch.randn(t, 768, generator=torch.Generator().manual_seed(t))
            want = bm.block_matmul(x, [w, other, w.row_slice(32, 64)])
            got = bm.block_matmul(x, [g, other, g.row_slice(32, 64)])
            assert torch.equal(got, want), (path, t)


@needs_kernel
def test_the_kernel_refuses_groups_of_other_types():
    w = weight(int(Q.Q8_0), 32, 256)
    module = bm._module()
    with pytest.raises(ValueError, match="row groups hold K-quants only"):
        module.block_matmul(torch.randn(1, 256), [w.raw.view(2, 16, -1)], [int(Q.Q8_0)])


@needs_kernel
def test_an_engine_on_row_groups_decodes_the_same_tokens(tiny_q4_k_m, monkeypatch, restore_path):
    """A RAM copy in row groups (where the path reads them, as on AVX-512) against the file's
    layout: the same greedy tokens, prompt and decode, on whichever path runs."""
    path, runs = tiny_q4_k_m[2], {}
    for groups in ("0", "1"):
        monkeypatch.setenv("EMBER_ROW_GROUPS", groups)
        monkeypatch.setattr(bm, "cpu_path", lambda: "avx512")  # ask for groups on any CPU
        engine = Engine.load(path, EngineOptions(n_ctx=64, threads=1, mmap="off"))
        monkeypatch.undo()
        stored = engine.loaded.source.weights
        assert any(stored.get(n).grouped for n in stored.names()) == (groups == "1")
        done = engine.generate([2, 40, 41, 42, 43], sampling=GREEDY, max_tokens=12,
                               ignore_eos=True)
        runs[groups] = done.token_ids
    assert runs["0"] == runs["1"]


def test_a_mapped_file_is_never_reordered(tiny_q4_k_m, monkeypatch):
    from ember.models.loader import load_model

    loaded = load_model(tiny_q4_k_m[2])
    with pytest.raises(ValueError, match="memory map"):
        loaded.source.weights.in_row_groups()
