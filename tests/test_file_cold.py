"""`--cold-dtype file`: a split GLU layer's cold neurons computed from the file's own blocks
(offload/hybrid/file_cold.py) on a Q4_K_M tiny model: against the plain kernels' references,
through the engine against the unsplit model, and its bytes against the int8 bundles'."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.kernels import input_sparse as isp
from ember.kernels.block_matmul import block_matmul_reference
from ember.models.support.errors import ConfigError
from ember.models.loader import load_model
from ember.models.transformer import activate
from ember.offload.body import file_blocks_model
from ember.offload.body.ffn_rows import FileFFNRows
from ember.offload.body.file_blocks_model import FileBlocksModel
from ember.offload.options.sampling import GREEDY
from ember.offload.hybrid.cpu_worker import CpuWorker
from ember.offload.hybrid.ffn import HybridFFN
from ember.offload.hybrid.file_cold import FileColdFFN
from ember.offload.hybrid.memory_plan import workspace_bytes
from ember.offload.runtime.engine import Engine, EngineOptions
from ember.offload.runtime.resources import split_rows_bytes

from .near_ties import assert_agrees_until_near_tie, greedy_with_gaps

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(not (file_blocks_model.applies() and isp.available()),
                                reason="C++ kernels not built on this machine")


def _layer_rows(path, i: int = 1) -> FileFFNRows:
    layer = FileBlocksModel.plain(load_model(path).source).layers[i]
    return FileFFNRows(layer.gate_up, layer.down, layer.activation)


def _reference(rows: FileFFNRows, cold: np.ndarray, x: torch.Tensor, threshold: float):
    """The cold neurons through the kernels' plain references: gate/up rows of the cold
    neurons, act, the hot neurons' inputs zero, then the input-sparse down."""
    idx = torch.from_numpy(cold)
    n = len(cold)
    gate_up = block_matmul_reference(x, [t.select_rows(idx) for t in rows.gate_up])
    full = torch.zeros(x.shape[0], rows.ffn_size)
    full[:, idx] = activate(rows.activation, gate_up[:, :n], gate_up[:, n:])
    down = isp.input_sparse_matmul_reference(full, [isp.relayout(rows.down)], threshold)
    return down, (full.abs() > threshold).sum(dim=1)


@pytest.mark.parametrize("threshold", [0.0, 0.05])
def test_the_cold_side_equals_the_kernels_references(tiny_q4_k_m, threshold):
    rows = _layer_rows(tiny_q4_k_m[2])
    cold = np.setdiff1d(np.arange(rows.ffn_size), np.arange(0, rows.ffn_size, 3))
    x = torch.randn(3, rows.hidden, generator=torch.Generator().manual_seed(2))
    side = FileColdFFN(rows, cold)
    got, kept = side(x, threshold or None)
    want, want_kept = _reference(rows, cold, x, threshold)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    assert torch.equal(kept, want_kept)
    if threshold:
        assert (kept < len(cold)).all() and (kept > 0).all()
    else:
        assert kept.tolist() == [len(cold)] * 3  # every cold neuron, no hot one
    # The file's bytes: the cold rows verbatim, down re-ordered (same size as the file's).
    assert side.nbytes == sum(t.nbytes for t in rows.gate_up) * len(cold) // rows.ffn_size \
        + rows.down.nbytes


def test_a_split_layer_with_the_file_cold_side_adds_up_to_the_dense_ffn(tiny_q4_k_m):
    """Hot rows fp32 on the tier, cold rows on the file's blocks: the sum is the dense FFN
    up to the int8 rounding of the kernels' inputs."""
    loaded = load_model(tiny_q4_k_m[2])
    rows = _layer_rows(tiny_q4_k_m[2])
    dense = loaded.model.blocks[1].ffn
    x = torch.randn(3, rows.hidden, generator=torch.Generator().manual_seed(1))
    worker = CpuWorker()
    try:
        for hot in (np.arange(0, rows.ffn_size, 3), np.arange(0, rows.ffn_size, 7)):
            split = HybridFFN.split(rows, 1, hot, CPU, worker, "file", bundles=False)
            assert split.cold_file is not None and split.cold is None
            gated = HybridFFN.split(rows, 1, hot, CPU, worker, "file")  # a selector may come
            assert gated.cold_file is None and gated.cold.dtype == "int8"
            want = dense(x)
            err = (split(x) - want).abs().max() / want.abs().max()
            assert err < 0.03, err
    finally:
        worker.close()


def test_an_engine_with_the_file_cold_side(tiny_q4_k_m):
    loaded = load_model(tiny_q4_k_m[2])
    want, gaps = greedy_with_gaps(Engine(loaded, EngineOptions(device="cpu", n_ctx=64)),
                                  PROMPT, 8)
    budget = workspace_bytes(loaded.config) + 420_000  # one 256-neuron group hot a layer, half
    bundles = Engine(loaded, EngineOptions(device="cpu", n_ctx=64, tier_attention="host",
                                           gpu_budget=budget,
                                           cold_dtype="int8"))
    options = EngineOptions(device="cpu", n_ctx=64, tier_attention="host",
                            gpu_budget=budget, cold_dtype="file")
    engine = Engine(loaded, options)
    try:
        report = engine.hybrid_report()
        assert report["host_ffn_dtype"] == "file" and 0 < report["hot_fraction"] < 1
        assert all(layer.cold_file is not None for layer in engine.hybrid.layers)
        # Smaller than the int8 bundles of the same cold neurons, and charged by the check.
        assert report["host_ffn_bytes"] < bundles.hybrid_report()["host_ffn_bytes"]
        assert report["host_ffn_bytes"] <= split_rows_bytes(loaded.source, options, CPU)
        got, _ = greedy_with_gaps(engine, PROMPT, 8)
        assert_agrees_until_near_tie(want, gaps, got)
        fractions = engine.hybrid_report()["computed_fraction_per_layer"]
        assert all(f == pytest.approx(1.0) for f in fractions)  # no threshold: every neuron
    finally:
        engine.close()
        bundles.close()


def test_the_file_cold_side_needs_the_files_blocks(tiny_q4_k_m):
    loaded = load_model(tiny_q4_k_m[2])
    with pytest.raises(ConfigError, match="--cold-dtype file"):
        Engine(loaded, EngineOptions(device="cpu", n_ctx=64, weights="fp32",
                                     gpu_budget=workspace_bytes(loaded.config) + 420_000,
                                     cold_dtype="file"))


def test_only_a_mapped_files_pages_are_let_go(tiny_q4_k_m, tiny_models):
    """The split lets the OS take back the mapped file's FFN pages it copied; a second
    engine on the same loaded model reads them again from the file. A copy in RAM, or a
    Hugging Face folder's tensors (read into memory by safetensors), would read as zeros:
    never released."""
    loaded = load_model(tiny_q4_k_m[2])
    want = Engine(loaded, EngineOptions(device="cpu", n_ctx=64)).generate(
        PROMPT, sampling=GREEDY, max_tokens=6, ignore_eos=True).token_ids
    options = EngineOptions(device="cpu", n_ctx=64, cold_dtype="file",
                            tier_attention="host",
                            gpu_budget=workspace_bytes(loaded.config) + 420_000)
    split = Engine(loaded, options)
    try:
        assert split.hybrid_report()["file_bytes_released"] > 0
        again = Engine(loaded, EngineOptions(device="cpu", n_ctx=64))
        assert again.generate(PROMPT, sampling=GREEDY, max_tokens=6,
                              ignore_eos=True).token_ids == want
    finally:
        split.close()
    small = tiny_models["llama-silu_glu"]
    # (K-quant hot rows come in 256-neuron groups: the Q4_K_M model needs more room for one)
    for other, room in ((load_model(tiny_q4_k_m[2], in_ram=lambda source: True), 420_000),
                        (load_model(small[3]), 60_000)):
        cfg = other.config
        engine = Engine(other, EngineOptions(device="cpu", n_ctx=64, cold_dtype="file",
                                             tier_attention="host",
                                             gpu_budget=workspace_bytes(cfg) + room))
        try:
            assert not other.source.weights.mapped
            assert any(layer.cold_file is not None for layer in engine.hybrid.layers)
            assert engine.hybrid_report()["file_bytes_released"] == 0
        finally:
            engine.close()
