"""The GPU tier on a real CUDA device: every format's matmul against the same codes on the
host, the engine's split on CUDA (each --tier-dtype) against the CPU's unsplit model up to a
near-tie, the plan against what CUDA allocated, and one synchronisation per split layer;
attention and its KV pool on the GPU (each --tier-attention type) likewise, the attention
kernel against its host reference, and their KV blocks swapped to the pinned host pool and
back bit for bit. Skipped without CUDA; bench/gpu_check.sh runs them on a lent machine."""

from __future__ import annotations

import pytest
import torch

from ember.kernels.hot_ffn import HotFFNWeights, hot_ffn
from ember.kernels.tier_attention import AttendRows, tier_attention, tier_attention_reference
from ember.kernels.sparse_ffn import neuron_rows_ffn
from ember.kernels.tier_weights import TierLinear, dequantize_int4, quantize_int4
from ember.models.loader import load_model
from ember.offload.body import file_blocks_model
from ember.offload.runtime.engine import Engine, EngineOptions
from ember.offload.hybrid.memory_plan import workspace_bytes
from ember.offload.hybrid.tier_dtypes import TierCaps

from .near_ties import assert_agrees_until_near_tie, greedy_with_gaps
from .test_tier_attention import _attention_budget, _layer, _pools, _rows_cases, _rotary
from .test_tier_placement import check_budgets

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def _formats():
    caps = TierCaps.of(torch.device("cuda")) if torch.cuda.is_available() else None
    out = ["int8", "fp16", "fp32"]
    if caps is not None and caps.int4:
        out.append("int4")
    if caps is not None and caps.half == torch.bfloat16:
        out.append("bf16")
    return out


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp16", "bf16", "fp32"])
def test_each_format_on_cuda_multiplies_as_its_codes(fmt):
    if fmt not in _formats():
        pytest.skip(f"{fmt} is not offered on this GPU")
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(256, 512, generator=g) * 0.05, torch.randn(3, 512, generator=g)
    lin = TierLinear.pack(w, fmt, "cuda", TierCaps.of(torch.device("cuda")).half)
    if fmt == "int4":  # the CUDA tile layout must hold the codes the CPU reference decodes
        want_w = dequantize_int4(*quantize_int4(w))
    else:
        want_w = lin.dequantize()
    want = x.to(lin.compute).float() @ want_w.t()
    got = lin(x.cuda()).float().cpu()
    tol = 1e-4 if fmt == "fp32" else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))
    assert lin.nbytes() == sum(t.numel() * t.element_size() for t in lin.tensors.values())


@pytest.mark.parametrize("formats", [("int4", "int4"), ("int4", "int8"), ("int8", "int8"),
                                     ("fp16", "fp16")])
def test_hot_ffn_on_cuda_is_the_reference(formats):
    if not set(formats) <= set(_formats()):
        pytest.skip("format not offered on this GPU")
    g = torch.Generator().manual_seed(1)
    gate, up, down = (torch.randn(70, 256, generator=g) * 0.2 for _ in range(3))
    w = HotFFNWeights.from_rows(gate, up, down, "silu_glu", "cuda", formats,
                                TierCaps.of(torch.device("cuda")).half)
    x = torch.randn(2, 256, generator=g)
    got = hot_ffn(x.cuda(), w).cpu()
    want = neuron_rows_ffn(x, gate, up, down, "silu_glu")
    assert float((got - want).norm() / want.norm()) < 0.25


def _cpu_reference(loaded):
    """The unsplit CPU model's 8 greedy tokens on PROMPT, with each step's top-two gap."""
    return greedy_with_gaps(Engine(loaded, EngineOptions(device="cpu", n_ctx=64)), PROMPT, 8)


@pytest.mark.skipif(not file_blocks_model.applies(), reason="C++ kernels not built")
@pytest.mark.parametrize("tier", ["auto", "int4", "int8", "fp16", "bf16", "fp32"])
def test_a_cuda_split_decodes_as_the_cpu_model_within_its_plan(tiny_q4_k_m, tier):
    if tier not in _formats() + ["auto"]:
        pytest.skip(f"{tier} is not offered on this GPU")
    loaded = load_model(tiny_q4_k_m[2])
    want, gaps = _cpu_reference(loaded)
    budget = workspace_bytes(loaded.config) + 400_000
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine = Engine(loaded, EngineOptions(device="cuda", n_ctx=64, gpu_budget=budget,
                                          tier_dtype=tier, tier_attention="host"))
    try:
        assert isinstance(engine.model, file_blocks_model.FileBlocksModel)  # not the float32 model
        plan = engine.hybrid.plan
        held = torch.cuda.memory_allocated() - before
        charged = plan.charges()["ffn_hot"]
        # The tier holds what it charged; CUDA's allocator rounds each tensor up to 512 B.
        tensors = sum(len(side.tensors) for layer in engine.hybrid.layers if layer.hot
                      for side in (layer.hot.gate_up, layer.hot.down))
        assert charged <= held <= charged + 512 * tensors and charged <= budget
        got, _ = greedy_with_gaps(engine, PROMPT, 8)
        assert_agrees_until_near_tie(want, gaps, got)
        peak = torch.cuda.max_memory_allocated() - before
        assert peak <= budget, f"CUDA peaked at {peak} bytes over a {budget}-byte budget"
        split = [layer for layer in engine.hybrid.layers if layer.hot is not None]
        tokens = split[0].counters.tokens
        assert all(layer.transfer.syncs >= tokens for layer in split)
    finally:
        engine.close()


def _attention_types():
    caps = TierCaps.of(torch.device("cuda")) if torch.cuda.is_available() else None
    return ["fp16", "fp32"] + (["bf16"] if caps is not None and caps.half == torch.bfloat16
                               else [])


@pytest.mark.parametrize("tier", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("case", _rows_cases(), ids=lambda c: c[0])
def test_tier_attention_on_cuda_is_the_host_reference(tier, case):
    if tier not in _attention_types():
        pytest.skip(f"{tier} is not offered on this GPU")
    _name, rows, T, start = case
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[tier]
    w, g = _layer(dtype, bias=True, qk_norm=True, softcap=30.0 if T > 1 else 0.0)
    x = torch.randn(T, 64, generator=g)
    cos, sin = _rotary(T, w.head_dim, start)
    k_pool, v_pool = _pools(w, 40, dtype, g)
    want = tier_attention_reference(w, x, k_pool.clone(), v_pool.clone(), rows, cos, sin)
    on_gpu, _ = _layer(dtype, bias=True, qk_norm=True, softcap=30.0 if T > 1 else 0.0,
                       device="cuda")  # the same values, packed on the GPU
    gpu_rows = AttendRows(rows.keys.cuda(), rows.own.cuda(),
                          None if rows.mask is None else rows.mask.cuda())
    k_before = k_pool.clone()
    k_gpu, v_gpu = k_pool.cuda(), v_pool.cuda()
    got = tier_attention(on_gpu, x.cuda(), k_gpu, v_gpu, gpu_rows, cos.cuda(), sin.cuda())
    tol = 1e-4 if tier == "fp32" else 2e-2
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=tol, atol=tol * float(b.abs().max()))
    # the rows' K/V went into the GPU's pool, in its type
    assert k_gpu.dtype == dtype and not torch.equal(k_gpu.cpu(), k_before)


@pytest.mark.skipif(not file_blocks_model.applies(), reason="C++ kernels not built")
@pytest.mark.parametrize("tier", ["auto", "bf16", "fp16", "fp32"])
def test_attention_and_kv_on_cuda_decode_as_the_cpu_model_within_the_plan(tiny_q4_k_m, tier):
    if tier not in _attention_types() + ["auto"]:
        pytest.skip(f"{tier} is not offered on this GPU")
    loaded = load_model(tiny_q4_k_m[2])
    want, gaps = _cpu_reference(loaded)
    # auto: the file's blocks, K/V in float16; a float type: both in it
    dtype = torch.float16 if tier == "auto" else getattr(
        torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[tier])
    budget = _attention_budget(loaded.config, dtype, extra=300_000)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine = Engine(loaded, EngineOptions(device="cuda", n_ctx=64, gpu_budget=budget,
                                          tier_attention=tier))
    try:
        plan, hybrid = engine.hybrid.plan, engine.hybrid
        if tier == "auto" and not plan.attention_on_gpu:
            pytest.skip("auto judged hot FFN rows the better use of this budget")
        pool = engine.kv.device_pool
        assert pool.k.device.type == "cuda" and pool.k.dtype == dtype
        assert all(w.device.type == "cuda" for w in hybrid.attention)
        if tier != "auto":
            assert all(w.dtype == dtype for w in hybrid.attention)
        charges = plan.charges()
        assert charges["attention"] == sum(w.nbytes() for w in hybrid.attention)
        assert charges["kv_pool"] == pool.k.nbytes + pool.v.nbytes
        head = engine.model.head
        assert charges["lm_head"] == (head.nbytes if plan.lm_head_on_gpu else 0)
        charged = (charges["attention"] + charges["kv_pool"] + charges["ffn_hot"]
                   + charges["lm_head"])
        tensors = 2 + sum(len(w.tensors()) for w in hybrid.attention) + sum(
            len(side.tensors) for layer in hybrid.layers if layer.hot
            for side in (layer.hot.gate_up, layer.hot.down)) + (
            sum(len(m.tensors) for m in head.chunks) if plan.lm_head_on_gpu else 0)
        held = torch.cuda.memory_allocated() - before
        assert charged <= held <= charged + 512 * tensors and plan.gpu_bytes <= budget
        got, _ = greedy_with_gaps(engine, PROMPT, 8)
        assert_agrees_until_near_tie(want, gaps, got)
        peak = torch.cuda.max_memory_allocated() - before
        assert peak <= budget, f"CUDA peaked at {peak} bytes over a {budget}-byte budget"
    finally:
        engine.close()


@pytest.mark.skipif(not file_blocks_model.applies(), reason="C++ kernels not built")
def test_cuda_kv_blocks_swap_to_the_pinned_host_pool_and_back_bit_for_bit(tiny_q4_k_m):
    loaded = load_model(tiny_q4_k_m[2])
    dtype = TierCaps.of(torch.device("cuda")).half
    engine = Engine(loaded, EngineOptions(device="cuda", n_ctx=64, tier_attention="fp16"
                                          if dtype == torch.float16 else "bf16",
                                          gpu_budget=_attention_budget(loaded.config, dtype)))
    try:
        kv = engine.kv
        greedy_with_gaps(engine, PROMPT, 4, session="a")
        seq = engine.runner.sessions["a"].seq_id
        view = kv.view(seq)
        before = [tuple(t.cpu() for t in view.read(layer, 0, view.length))
                  for layer in range(loaded.config.n_layers)]
        assert kv.host_pool.k.is_pinned() and kv.device_pool.k.device.type == "cuda"
        kv.swap_out(seq)
        greedy_with_gaps(engine, list(reversed(PROMPT)), 4, session="b")
        kv.swap_in(seq)
        for layer, (k, v) in enumerate(before):
            got_k, got_v = view.read(layer, 0, view.length)
            assert torch.equal(got_k.cpu(), k) and torch.equal(got_v.cpu(), v)
    finally:
        engine.close()


@pytest.mark.skipif(not file_blocks_model.applies(), reason="C++ kernels not built")
@pytest.mark.parametrize("fmt", ["file", "int8", "int4"])
def test_the_whole_tier_on_cuda_decodes_as_the_cpu_model_at_three_budgets(tiny_q4_k_m, fmt):
    """Attention, its KV, the LM head and the FFN on the GPU in the file's blocks (decoded
    on the device), int8 or int4: at three budgets the charges are the tensors' bytes,
    greedy output is the CPU model's up to a near-tie, and a verified tree's rows are plain
    decoding's bit for bit."""
    if fmt == "int4" and "int4" not in _formats():
        pytest.skip("int4 is not offered on this GPU")
    loaded = load_model(tiny_q4_k_m[2])
    want, gaps = _cpu_reference(loaded)
    check_budgets(loaded, fmt, want, gaps, PROMPT, 64, 8, device="cuda")


def _greedy_logits(engine: Engine, session: str, prompt: list[int], n: int) -> list:
    out = [engine.runner.prefill(session, list(prompt))]
    for _ in range(n):
        out.append(engine.runner.decode(session, int(out[-1].argmax())))
    return out


@pytest.mark.skipif(not file_blocks_model.applies(), reason="C++ kernels not built")
def test_a_decoded_token_replayed_from_its_cuda_graph_has_the_layers_bits(tiny_q4_k_m,
                                                                           monkeypatch):
    """The whole model on the tier: tokens replayed from the decode step's CUDA graph
    (offload/body/tier_graph.py) give the logits the layers give launched one by one
    (EMBER_CUDA_GRAPHS=0), bit for bit, across a new KV block, a second conversation and a
    truncation; the graph was captured once."""
    from ember.offload.body import tier_graph

    from .test_tier_placement import _budgets, _options

    loaded = load_model(tiny_q4_k_m[2])
    fits = _budgets(loaded, "file", 64, torch.device("cuda"))["fits"]
    logits, report = {}, None
    for graphs in ("0", "1"):
        monkeypatch.setenv(tier_graph.ENV, graphs)
        engine = Engine(loaded, _options("file", fits, 64, "cuda"))
        try:
            logits[graphs] = [t for s, p in (("a", PROMPT), ("b", PROMPT[:5]), ("a", PROMPT))
                              for t in _greedy_logits(engine, s, p, 20)]
            report = engine.model.decode_graphs()
            if graphs == "0":
                assert report is None
        finally:
            engine.close()
    assert report["layers"] == [list(range(loaded.config.n_layers))]
    # (the graph's bytes are the allocator's growth: 0 where a tiny model's step fits the
    # segments it holds already; 4 MiB on the 1.1B, bench/gpu_check.sh)
    assert report["captured"] == [True] and report["replays"] >= 50
    assert all(torch.equal(a, b) for a, b in zip(logits["0"], logits["1"]))
