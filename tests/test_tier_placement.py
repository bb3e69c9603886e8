"""Issue 30 on the CPU tier: attention, its KV pool, the LM head and FFN rows on the tier in
the file's own blocks (and in int8 and int4), each layer placed "gpu", "split" or "cpu" by
the plan. At three budgets (everything fits; attention, KV and head with half the FFN; them
with no FFN rows) greedy output equals the unsplit engine's up to the first near-tie, on a
tiny Q4_K_M llama and on the default model, and the plan charges the bytes the tensors
take. The CUDA path (the tier decoding the file's blocks with torch ops) runs here too, by
choosing it for the CPU in the one place that chooses (`block_kernels_on`). Speculation
stays lossless and the KV swap round-trips through it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ember.kernels import tier_blocks
from ember.kernels.hot_ffn import hot_ffn_bytes
from ember.models.support.errors import ConfigError
from ember.models.loader import load_model
from ember.offload.body import file_blocks_model
from ember.offload.body.file_layers import FileLayers
from ember.offload.body.protocol import BodyModel
from ember.offload.body.tier_layers import tier_attention_bytes, tier_head_bytes
from ember.offload.decode.runner import Session
from ember.offload.options.sampling import SamplingParams
from ember.offload.hybrid import decode_costs
from ember.offload.hybrid.memory_plan import ComponentBytes, workspace_bytes
from ember.offload.hybrid.placed_model import read_layer_modes
from ember.offload.hybrid.setup import tier_formats
from ember.offload.hybrid.tier_dtypes import TierChoice
from ember.offload.kv.plan import plan_kv
from ember.offload.runtime.engine import Engine, EngineOptions

from .near_ties import assert_agrees_until_near_tie, greedy_with_gaps

PROMPT = [2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
GREEDY = SamplingParams(temperature=0.0)
CPU = torch.device("cpu")
needs_kernels = pytest.mark.skipif(not file_blocks_model.applies(),
                                   reason="C++ kernels not built on this machine")
pytestmark = needs_kernels


def _options(fmt: str, budget: int, n_ctx: int, device: str = "cpu", **extra) -> EngineOptions:
    """Attention and the LM head in `fmt`, the hot FFN rows in it too (the file's blocks:
    tier dtype auto)."""
    return EngineOptions(device=device, n_ctx=n_ctx, threads=2, gpu_budget=budget,
                         tier_attention=fmt, tier_dtype="auto" if fmt == "file" else fmt,
                         **extra)


def _budgets(loaded, fmt: str, n_ctx: int, device: torch.device = CPU) -> dict[str, int]:
    """What attention, its KV, the LM head and the FFN take on the tier in `fmt`, from the
    runtime's own byte counts: everything; them with half the FFN; them alone."""
    cfg = loaded.config
    file = FileLayers.read(loaded.source)
    tier = TierChoice.resolve("auto" if fmt == "file" else fmt, device)
    kv = plan_kv(cfg, n_ctx, value_bytes=2)
    fixed = (workspace_bytes(cfg) + tier_attention_bytes(file, fmt, tier.half)
             + kv.device_blocks * kv.block_bytes + tier_head_bytes(file, fmt, tier.half))
    ffn = sum(hot_ffn_bytes(cfg.ffn_size, cfg.hidden_size, cfg.gated, tier_formats(tier, rows),
                            tier.half) for rows in file.ffn_rows())
    return {"fits": fixed + ffn, "half": fixed + ffn // 2, "none": fixed}


def _hot_rows_are_the_tensors(plan, hybrid, charges: dict) -> None:
    """Each layer's hot rows charged at the bytes of the tensors built for them, and the plan
    inside its budget."""
    for i, layer in enumerate(hybrid.layers):
        real = 0 if layer.hot is None else sum(
            t.numel() * t.element_size() for side in (layer.hot.gate_up, layer.hot.down)
            for t in side.tensors.values())
        assert real == layer.gpu_bytes() == plan.sizes.hot_bytes(i, len(layer.hot_idx))
    assert charges["ffn_hot"] == sum(layer.gpu_bytes() for layer in hybrid.layers)
    assert plan.gpu_bytes <= plan.budget


def _charges_are_the_tensors(engine: Engine) -> None:
    plan, hybrid, model = engine.hybrid.plan, engine.hybrid, engine.model
    charges = plan.charges()
    assert plan.attention_on_gpu and plan.lm_head_on_gpu
    assert charges["attention"] == sum(w.nbytes() for w in hybrid.attention)
    assert charges["attention"] == sum(t.numel() * t.element_size()
                                       for w in hybrid.attention for t in w.tensors())
    pool = engine.kv.device_pool
    assert charges["kv_pool"] == pool.k.nbytes + pool.v.nbytes
    assert pool.k.dtype == torch.float16
    assert charges["lm_head"] == model.head.nbytes
    _hot_rows_are_the_tensors(plan, hybrid, charges)


def check_budgets(loaded, fmt, want, gaps, prompt, n_ctx, n, device="cpu"):
    """At the three budgets, on `device`: charges are the tensors' bytes, the layers' modes
    follow the room, greedy output is the reference's up to its first near-tie."""
    budgets = _budgets(loaded, fmt, n_ctx, torch.device(device))
    for name, budget in budgets.items():
        engine = Engine(loaded, _options(fmt, budget, n_ctx, device))
        try:
            _charges_are_the_tensors(engine)
            modes = read_layer_modes(engine.hybrid.plan).modes
            fraction = engine.hybrid_report()["hot_fraction"]
            if name == "fits":  # the whole model on the tier
                assert set(modes) == {"gpu"} and fraction == 1.0
            elif name == "half":
                assert "split" in modes or {"gpu", "split"} >= set(modes) and 0 < fraction < 1
            else:
                assert fraction == 0 and all(m == "split" for m in modes)
            held = engine.hybrid_report()["tier_attention_weights"]
            assert held["format"] == fmt and held["layers"] == loaded.config.n_layers
            if fmt == "file":
                assert held["error_qkv"]["max"] == 0 and held["error_o"]["max"] == 0
            got, _ = greedy_with_gaps(engine, prompt, n)
            assert_agrees_until_near_tie(want, gaps, got)
            if name == "half":
                verified_chain_is_decode(engine, prompt)
        finally:
            engine.close()


def _whole_budgets(loaded, n_ctx: int) -> dict[str, int]:
    """Rooms for the whole-model plan (`--tier-attention auto`, the file's blocks), from the
    file's own bytes: everything; everything but half of one layer's FFN (that layer is
    best split); half of attention and KV alone (some layers must stay on the host)."""
    cfg = loaded.config
    kv = plan_kv(cfg, n_ctx, value_bytes=2)
    model = ComponentBytes.of_file_blocks(cfg, loaded.source.weights, n_ctx,
                                          kv.device_blocks * kv.block_bytes).model
    fixed = sum(l.attention + l.kv for l in model.layers)
    ffn = sum(l.ffn for l in model.layers)
    space = workspace_bytes(cfg)
    fits = space + fixed + model.head + ffn
    return {"fits": fits, "split": fits - model.layers[0].ffn // 2, "some": space + fixed // 2}


def _whole_charges_are_the_tensors(engine: Engine) -> None:
    """The whole-model plan charges, part by part, the bytes of what was built: each tier
    layer's attention copy, its share of the KV pool, the head, the hot rows."""
    plan, hybrid = engine.hybrid.plan, engine.hybrid
    charges, on = plan.charges(), plan.tier_layers()
    assert charges["attention"] == sum(w.nbytes() for w in hybrid.attention or [])
    assert len(hybrid.attention or []) == len(on)
    _kv_charge_is_the_pool_built(engine, on)
    assert charges["lm_head"] == (engine.model.head.nbytes if plan.lm_head_on_gpu else 0)
    _hot_rows_are_the_tensors(plan, hybrid, charges)


def _kv_charge_is_the_pool_built(engine: Engine, on: list[int]) -> None:
    """Each tier layer is charged its share of the KV blocks; where tier layers run apart
    from the host's (the torch path a CUDA tier runs), the device pool is those shares and
    nothing more, the host layers' blocks sit in their own pool in host RAM."""
    kv, plan = engine.kv, engine.kv_plan
    charge = engine.hybrid.plan.charges()["kv_pool"]
    assert charge == plan.blocks_of(on) * plan.block_bytes
    runs = engine.model.runs
    if runs is None or not any(r.attention is not None for r in runs):
        return  # one pool on the host serves every layer (the C++ pass)
    assert charge == kv.device_pool.k.nbytes + kv.device_pool.v.nbytes
    assert plan.block_bytes == kv.device_pool.block_bytes
    host = [i for i in range(len(runs)) if i not in on]
    assert sorted(on) == [i for i, r in enumerate(runs) if r.attention is not None]
    assert (kv.host_layer_pool is None) == (not host)
    if host:
        assert kv.host_layer_pool.n_blocks == plan.blocks_of(host)
        assert kv.host_layer_pool.k.device.type == "cpu"
    assert all((kv.resident[i] is kv.device_pool) == (i in on) for i in range(len(runs)))


def _info_plan(path, budget: int, n_ctx: int, gpu: str | None = None) -> dict:
    """`ember info --gpu-budget`'s plan of the same file, as JSON."""
    import io
    import json
    from contextlib import redirect_stdout

    from ember.app.cli import main

    argv = ["info", "--model", str(path), "--gpu-budget", str(budget), "--ctx-size",
            str(n_ctx), "--json"] + (["--gpu", gpu] if gpu else [])
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(argv) == 0
    return json.loads(buf.getvalue())["gpu_plan"]


def check_whole_model_budgets(loaded, want, gaps, prompt, n_ctx, n, monkeypatch):
    """The engine under `--gpu-budget` alone plans the whole model as `ember info` does (one
    plan: the same modes, hot rows and charges), builds it (charges are the tensors' bytes),
    and decodes as the unsplit engine up to its first near-tie, at three budgets. Launches
    and hand-overs are made free, so the tier is worth filling even for a tiny model's
    layers and each budget gives the modes it names (whole, split, some on the host)."""
    monkeypatch.setattr(decode_costs, "GRAPH_LAUNCH_MS", 0.0)
    monkeypatch.setattr(decode_costs, "HANDOFF_MS", 0.0)
    for name, budget in _whole_budgets(loaded, n_ctx).items():
        engine = Engine(loaded, EngineOptions(device="cpu", n_ctx=n_ctx, threads=2,
                                              gpu_budget=budget))
        try:
            plan = engine.hybrid.plan
            shown = _info_plan(loaded.source.path, budget, n_ctx)
            assert shown["layer_modes"] == list(plan.layer_modes)
            assert shown["charges"] == plan.charges()
            report = engine.hybrid_report()
            assert shown["hot_fraction_per_layer"] == report["hot_fraction_per_layer"]
            assert engine.hybrid.layer_modes == plan.layer_modes
            if not tier_blocks.block_kernels_on(CPU):  # the torch path: tier layers run there
                runs = engine.model.runs or []
                assert sum(r.attention is not None for r in runs) == len(plan.tier_layers())
            _whole_charges_are_the_tensors(engine)
            if name == "fits":  # the whole model on the tier, the host reads no weights
                assert set(plan.layer_modes) == {"gpu"} and plan.lm_head_on_gpu
                assert plan.host_weight_bytes() == 0
            if name == "split":
                assert "split" in plan.layer_modes and plan.lm_head_on_gpu
                assert 0 < plan.placement.total_hot_fraction() < 1
            if name == "some":
                assert "cpu" in plan.layer_modes and set(plan.layer_modes) != {"cpu"}
            if fmt_held := report["tier_attention_weights"]:
                assert fmt_held["format"] == "file" and fmt_held["error_qkv"]["max"] == 0
            # what runs the tier's work: the C++ block kernels on a CPU tier, else torch ops
            # (Triton's kernels only on CUDA, or asked for in the interpreter)
            native = tier_blocks.block_kernels_on(CPU)
            assert report["tier_kernels"]["matrices"] == (["c++"] if native else ["torch"])
            if fmt_held:
                assert report["tier_kernels"]["layer_steps"] == ("c++" if native else "torch")
            got, _ = greedy_with_gaps(engine, prompt, n)
            assert_agrees_until_near_tie(want, gaps, got)
        finally:
            engine.close()


def test_the_tiny_q4_k_m_under_the_whole_model_plan_decodes_as_unsplit(tiny_q4_k_m,
                                                                      monkeypatch):
    loaded = load_model(tiny_q4_k_m[2])
    dense = Engine(loaded, EngineOptions(device="cpu", n_ctx=64))
    want, gaps = greedy_with_gaps(dense, PROMPT, 8)
    check_whole_model_budgets(loaded, want, gaps, PROMPT, 64, 8, monkeypatch)


@pytest.mark.slow
def test_the_default_model_under_the_whole_model_plan_decodes_as_unsplit(
        default_greedy_reference, monkeypatch):
    loaded, ids, want, gaps = default_greedy_reference
    check_whole_model_budgets(loaded, want, gaps, ids, 256, 12, monkeypatch)


def test_the_cuda_path_runs_the_whole_model_plan(tiny_q4_k_m, monkeypatch):
    """The same three budgets with the tier's torch path chosen for the CPU (what a CUDA
    tier runs): tier layers' attention decoded from the file's blocks there, their K/V in
    the tier's pool, host layers in C++ on their own pool in host RAM."""
    loaded = load_model(tiny_q4_k_m[2])
    want, gaps = greedy_with_gaps(Engine(loaded, EngineOptions(device="cpu", n_ctx=64)),
                                  PROMPT, 8)
    monkeypatch.setattr(tier_blocks, "block_kernels_on", lambda device: False)
    check_whole_model_budgets(loaded, want, gaps, PROMPT, 64, 8, monkeypatch)


@pytest.mark.parametrize("drafter", ["self", "lookup"])
def test_speculation_under_the_whole_model_plan_is_lossless(tiny_q4_k_m, drafter, monkeypatch):
    monkeypatch.setattr(decode_costs, "GRAPH_LAUNCH_MS", 0.0)
    monkeypatch.setattr(decode_costs, "HANDOFF_MS", 0.0)
    loaded = load_model(tiny_q4_k_m[2])
    budget = _whole_budgets(loaded, 64)["split"]
    prompt = PROMPT + PROMPT[1:]  # repeats: the lookup drafter finds drafts
    plain = Engine(loaded, EngineOptions(device="cpu", n_ctx=64, gpu_budget=budget))
    spec = Engine(loaded, EngineOptions(device="cpu", n_ctx=64, gpu_budget=budget,
                                        speculate=drafter))
    try:
        assert "split" in spec.hybrid.plan.layer_modes
        want = plain.generate(prompt, sampling=GREEDY, max_tokens=12, ignore_eos=True).token_ids
        got = spec.generate(prompt, sampling=GREEDY, max_tokens=12, ignore_eos=True).token_ids
        assert got == want and spec.speculation["verifications"] > 0
    finally:
        plain.close()
        spec.close()


def test_the_engines_plan_is_priced_for_the_named_card(tiny_q4_k_m):
    """`--gpu NAME` reaches the engine's plan, as `ember info`'s; without a budget it is
    refused, and a name the table lacks is one line naming the choices."""
    loaded = load_model(tiny_q4_k_m[2])
    budget = _whole_budgets(loaded, 64)["split"]
    engine = Engine(loaded, EngineOptions(device="cpu", n_ctx=64, gpu_budget=budget,
                                          gpu="rtx4090"))
    try:
        made = dict(engine.hybrid.plan.forecast, solve_s=None)
        assert made["card"]["name"] == "rtx4090"
        assert dict(_info_plan(loaded.source.path, budget, 64, "rtx4090")["forecast"],
                    solve_s=None) == made
    finally:
        engine.close()
    with pytest.raises(ConfigError, match="--gpu rtx4090 prices a --gpu-budget plan"):
        EngineOptions(gpu="rtx4090")
    with pytest.raises(ConfigError, match="unknown --gpu"):
        Engine(loaded, EngineOptions(device="cpu", n_ctx=64, gpu_budget=budget, gpu="gtx"))


def verified_chain_is_decode(engine: Engine, prompt: list[int]) -> None:
    """A drafted chain verified in one tree gives, row for row, the very logits decoding it
    token by token gives (lossless speculation rests on it; tier attention is a masked SDPA,
    not batch-invariant, so its tree rows go one at a time)."""
    from ember.offload.speculative.token_tree import TokenTree

    runner, chain = engine.runner, [60, 61, 62, 63, 64]
    runner.prefill("chain", prompt)
    want = [runner.decode("chain", t) for t in chain]
    runner.reset("chain")
    runner.prefill("chain", prompt)
    tree = TokenTree.root(chain[0])
    for t in chain[1:]:
        tree.add(len(tree) - 1, t)
    assert runner.begin_tree("chain", len(tree)) == len(tree)
    got = runner.verify("chain", tree)
    assert all(torch.equal(got[i], want[i]) for i in range(len(chain)))
    runner.reset("chain")


@pytest.mark.parametrize("fmt", ["file", pytest.param("int8", marks=pytest.mark.slow),
                                 pytest.param("int4", marks=pytest.mark.slow)])
def test_the_tiny_q4_k_m_on_the_tier_decodes_as_unsplit_at_three_budgets(tiny_q4_k_m, fmt):
    if fmt == "int4" and not TierChoice.resolve("auto", CPU).caps.int4:
        pytest.skip("no int4 matmul in this PyTorch build")
    loaded = load_model(tiny_q4_k_m[2])
    dense = Engine(loaded, EngineOptions(device="cpu", n_ctx=64))
    want, gaps = greedy_with_gaps(dense, PROMPT, 8)
    check_budgets(loaded, fmt, want, gaps, PROMPT, 64, 8)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["file", "int8", "int4"])
def test_the_default_model_on_the_tier_decodes_as_unsplit_at_three_budgets(
        default_greedy_reference, fmt):
    if fmt == "int4" and not TierChoice.resolve("auto", CPU).caps.int4:
        pytest.skip("no int4 matmul in this PyTorch build")
    loaded, ids, want, gaps = default_greedy_reference
    check_budgets(loaded, fmt, want, gaps, ids, 256, 12)


@pytest.mark.slow
def test_the_cuda_path_decodes_the_files_blocks_on_the_tier(tiny_q4_k_m, monkeypatch):
    """With the tier's torch path chosen for the CPU (what a CUDA tier runs), every layer's
    attention runs from the file's blocks decoded on the tier, the FFN and the LM head too,
    and greedy output still equals the unsplit engine's up to a near-tie."""
    loaded = load_model(tiny_q4_k_m[2])
    want, gaps = greedy_with_gaps(Engine(loaded, EngineOptions(device="cpu", n_ctx=64)),
                                  PROMPT, 8)
    monkeypatch.setattr(tier_blocks, "block_kernels_on", lambda device: False)
    for name, budget in _budgets(loaded, "file", 64).items():
        engine = Engine(loaded, _options("file", budget, 64))
        try:
            assert engine.model.runs is not None and not engine.model.batch_invariant
            assert all(run.attention is not None for run in engine.model.runs)
            assert not engine.model.head_batch_invariant  # the tier's head
            _charges_are_the_tensors(engine)
            got, _ = greedy_with_gaps(engine, PROMPT, 8)
            assert_agrees_until_near_tie(want, gaps, got)
            verified_chain_is_decode(engine, PROMPT)
        finally:
            engine.close()


def test_the_whole_model_on_a_cpu_tier_is_the_one_call_pass(tiny_q4_k_m):
    """Everything fits: on a CPU tier the file's blocks run in the C++ pass, so the tokens
    are the unsplit engine's exactly and tree rows still verify in one pass."""
    loaded = load_model(tiny_q4_k_m[2])
    dense = Engine(loaded, EngineOptions(device="cpu", n_ctx=64))
    engine = Engine(loaded, _options("file", _budgets(loaded, "file", 64)["fits"], 64))
    try:
        assert engine.model.runs is None and engine.model.batch_invariant
        want = dense.generate(PROMPT, sampling=GREEDY, max_tokens=8, ignore_eos=True)
        got = engine.generate(PROMPT, sampling=GREEDY, max_tokens=8, ignore_eos=True)
        assert got.token_ids == want.token_ids
    finally:
        engine.close()
        dense.close()


@pytest.mark.parametrize("drafter", ["self", "lookup"])
@pytest.mark.parametrize("torch_path", [False, True], ids=["block-kernels", "torch"])
def test_speculation_through_the_tier_is_lossless(tiny_q4_k_m, drafter, torch_path,
                                                 monkeypatch):
    if torch_path:
        monkeypatch.setattr(tier_blocks, "block_kernels_on", lambda device: False)
    loaded = load_model(tiny_q4_k_m[2])
    budget = _budgets(loaded, "file", 64)["half"]
    prompt = PROMPT + PROMPT[1:]  # repeats: the lookup drafter finds drafts
    plain = Engine(loaded, _options("file", budget, 64))
    spec = Engine(loaded, _options("file", budget, 64, speculate=drafter))
    try:
        want = plain.generate(prompt, sampling=GREEDY, max_tokens=12, ignore_eos=True).token_ids
        got = spec.generate(prompt, sampling=GREEDY, max_tokens=12, ignore_eos=True).token_ids
        assert got == want and spec.speculation["verifications"] > 0
    finally:
        plain.close()
        spec.close()


@pytest.mark.slow
def test_tier_kv_blocks_swap_and_come_back_bit_for_bit(tiny_q4_k_m, monkeypatch):
    monkeypatch.setattr(tier_blocks, "block_kernels_on", lambda device: False)
    loaded = load_model(tiny_q4_k_m[2])
    engine = Engine(loaded, _options("file", _budgets(loaded, "file", 64)["none"], 64))
    try:
        kv = engine.kv
        first = greedy_with_gaps(engine, PROMPT, 4, session="a")[0]
        seq = engine.runner.sessions["a"].seq_id
        view = kv.view(seq)
        before = [tuple(t.clone() for t in view.read(layer, 0, view.length))
                  for layer in range(loaded.config.n_layers)]
        kv.swap_out(seq)
        greedy_with_gaps(engine, list(reversed(PROMPT)), 4, session="b")
        kv.swap_in(seq)
        for layer, (k, v) in enumerate(before):
            got_k, got_v = view.read(layer, 0, view.length)
            assert torch.equal(got_k, k) and torch.equal(got_v, v)
        again = engine.generate(PROMPT + first, sampling=GREEDY, max_tokens=3, ignore_eos=True,
                                session="a")
        assert len(again.token_ids) == 3
    finally:
        engine.close()


def test_the_plan_is_read_in_one_place():
    """`read_layer_modes` reads the planner's `layer_modes` and `lm_head_on_gpu` where the
    plan has them, else derives them from the hot counts and `attention_on_gpu`."""
    from ember.placement.layout import Placement

    placement = Placement.from_counts((8, 8, 8), [8, 3, 0])
    derived = SimpleNamespace(placement=placement, attention_on_gpu=True, lm_head_on_gpu=True)
    got = read_layer_modes(derived)
    assert got.modes == ("gpu", "split", "split") and all(got.attention_on_tier)
    host = SimpleNamespace(placement=placement, attention_on_gpu=False, lm_head_on_gpu=False)
    assert read_layer_modes(host).modes == ("split", "split", "cpu")
    assert not any(read_layer_modes(host).attention_on_tier)
    planned = SimpleNamespace(placement=placement, attention_on_gpu=True, lm_head_on_gpu=False,
                              layer_modes=("gpu", "split", "cpu"))
    got = read_layer_modes(planned)
    assert got.modes == ("gpu", "split", "cpu") and got.attention_on_tier == (True, True, False)
    with pytest.raises(ValueError, match="layer modes"):
        read_layer_modes(SimpleNamespace(placement=placement, attention_on_gpu=True,
                                         lm_head_on_gpu=False, layer_modes=("gpu", "tier")))


def test_both_models_satisfy_the_runners_protocol(tiny_q4_k_m):
    loaded = load_model(tiny_q4_k_m[2])
    blocks = file_blocks_model.FileBlocksModel.plain(loaded.source)
    assert isinstance(blocks, BodyModel) and isinstance(loaded.model, BodyModel)
    # built once: nothing public rewires how a built model computes
    assert not [n for n in dir(blocks) if n.startswith("use_") and n != "use_context"]


def test_decode_graphs_are_wanted_on_cuda_only_and_can_be_turned_off(monkeypatch):
    """A CUDA tier graphs its decode step unless EMBER_CUDA_GRAPHS=0; a CPU tier never."""
    from ember.offload.body import tier_graph

    monkeypatch.delenv(tier_graph.ENV, raising=False)
    assert tier_graph.wanted(torch.device("cuda")) and not tier_graph.wanted(CPU)
    monkeypatch.setenv(tier_graph.ENV, "0")
    assert not tier_graph.wanted(torch.device("cuda"))


def _mixed_engine(loaded, monkeypatch, **extra) -> Engine:
    """The whole-model plan on the torch path a CUDA tier runs, at a budget that leaves some
    layers' attention on the host (launches and hand-overs free, as above)."""
    monkeypatch.setattr(decode_costs, "GRAPH_LAUNCH_MS", 0.0)
    monkeypatch.setattr(decode_costs, "HANDOFF_MS", 0.0)
    monkeypatch.setattr(tier_blocks, "block_kernels_on", lambda device: False)
    budget = _whole_budgets(loaded, 64)["some"]
    engine = Engine(loaded, EngineOptions(device="cpu", n_ctx=64, threads=2,
                                          gpu_budget=budget, **extra))
    modes = engine.hybrid.plan.layer_modes
    assert "cpu" in modes and set(modes) != {"cpu"}
    return engine


@pytest.mark.parametrize("kv_type,host_dtype", [("q8_0", torch.uint8), ("bf16", torch.bfloat16)])
def test_a_mixed_plan_keeps_each_layers_kv_where_its_attention_runs(tiny_q4_k_m, monkeypatch,
                                                                    kv_type, host_dtype):
    """Tier layers' K/V in a pool of the tier's float16, host layers' in host RAM in
    --kv-type q8_0 or bf16 (what the C++ attention reads), each pool holding its layers'
    share of the plan's blocks; the tier is charged the device pool's bytes, at float16;
    greedy output is the unsplit engine's (same --kv-type) up to a near-tie."""
    loaded = load_model(tiny_q4_k_m[2])
    dense = Engine(loaded, EngineOptions(device="cpu", n_ctx=64, kv_type=kv_type))
    want, gaps = greedy_with_gaps(dense, PROMPT, 8)
    engine = _mixed_engine(loaded, monkeypatch, kv_type=kv_type)
    try:
        kv, on = engine.kv, engine.hybrid.plan.tier_layers()
        _kv_charge_is_the_pool_built(engine, on)
        assert kv.device_pool.k.dtype == torch.float16 == kv.host_pool.k.dtype
        assert kv.host_layer_pool.k.dtype == host_dtype
        cfg = loaded.config  # float16 K and V, not the host type's bytes
        assert engine.kv_plan.block_bytes == 2 * engine.kv_plan.block_size * cfg.n_kv_heads \
            * cfg.head_dim * 2
        got, _ = greedy_with_gaps(engine, PROMPT, 8)
        assert_agrees_until_near_tie(want, gaps, got)
        seq = engine.kv.seqs[engine.runner.sessions["near-ties"].seq_id]
        blocks = -(-(len(PROMPT) + 8) // engine.kv_plan.block_size)
        host = len(seq.tables) - len(on)
        assert kv.usage()["device_blocks_used"] == len(on) * blocks
        assert kv.usage()["host_layer_blocks_used"] == host * blocks
        # the model's own contiguous cache keeps the same split, and computes the same
        model = engine.model
        cache = model.new_cache(32)
        assert cache.k.dtype == torch.float16 and cache.host_k.dtype == host_dtype
        assert cache.k.shape[0] == len(on) and cache.host_k.shape[0] == host
        contiguous = model.logits(model.hidden(torch.tensor(PROMPT), cache))[-1]
        torch.testing.assert_close(contiguous, engine.runner.prefill("again", PROMPT))
    finally:
        engine.close()
        dense.close()


def test_a_mixed_plans_kv_swaps_and_forks_bit_for_bit(tiny_q4_k_m, monkeypatch):
    """Swapping a sequence out moves its tier layers' blocks to the host pool alone (the host
    layers' are in host RAM already) and back bit for bit; a fork shares both pools' blocks
    and decodes on as its parent would."""
    loaded = load_model(tiny_q4_k_m[2])
    engine = _mixed_engine(loaded, monkeypatch)
    try:
        kv = engine.kv
        first, _ = greedy_with_gaps(engine, PROMPT, 3, session="a")  # 15 of a 16-token block
        seq = engine.runner.sessions["a"].seq_id
        view = kv.view(seq)
        before = [tuple(t.clone() for t in view.read(layer, 0, view.length))
                  for layer in range(loaded.config.n_layers)]
        host_used = kv.host_layer_pool.allocator.n_used
        kv.swap_out(seq)
        assert kv.seqs[seq].tier == "host" and kv.host_layer_pool.allocator.n_used == host_used
        assert kv.stats.bytes_out == kv.host_pool.allocator.n_used * kv.device_pool.block_bytes
        greedy_with_gaps(engine, list(reversed(PROMPT)), 4, session="b")
        kv.swap_in(seq)
        for layer, (k, v) in enumerate(before):
            got_k, got_v = view.read(layer, 0, view.length)
            assert torch.equal(got_k, k) and torch.equal(got_v, v)
        runner = engine.runner
        runner.sessions["c"] = Session(kv.fork(seq), list(runner.sessions["a"].tokens))
        parent_next = runner.decode("a", first[-1])
        assert torch.equal(runner.decode("c", first[-1]), parent_next)
        assert kv.stats.cow_copies > 0
    finally:
        engine.close()
