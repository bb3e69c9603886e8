"""Every block in one C++ call (kernels/fused_ops.body_step, offload/body/fused_body.py): the same
bits as its reference op chain and as the blocks run one by one, and a clean fallback to the
blocks wherever they must run as modules."""

from __future__ import annotations

import pytest
import torch

from ember.kernels import cpu_extension, fused_ops, q8_matmul
from ember.models.loader import load_model
from ember.offload.runtime.engine import Engine, EngineOptions
from ember.offload.speculative.token_tree import TokenTree


@pytest.fixture(scope="module")
def fast():
    if cpu_extension.forced_reference() or not fused_ops.available():
        pytest.skip(f"C++ kernels not built here: {cpu_extension.unavailable_reason()}")
    return cpu_extension.load()


def _random_layer(g, activation: str, post: bool) -> fused_ops.BodyLayer:
    nh, nkv, hd, hidden, ffn = 4, 2, 32, 64, 96
    w = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    gated = activation not in ("relu", "relu2")
    return fused_ops.BodyLayer(
        attn_norm=w(hidden), qkv_rows=q8_matmul.q8_0_quantize(w((nh + 2 * nkv) * hd, hidden) * 0.1),
        n_heads=nh, n_kv=nkv, head_dim=hd, q_norm=w(hd), k_norm=w(hd), interleaved=False,
        wo_rows=q8_matmul.q8_0_quantize(w(hidden, nh * hd) * 0.1),
        post_attn_norm=w(hidden) if post else None, ffn_norm=w(hidden),
        gate_up_rows=q8_matmul.q8_0_quantize(w((2 if gated else 1) * ffn, hidden) * 0.2),
        down_rows=q8_matmul.q8_0_quantize(w(hidden, ffn) * 0.2), activation=activation,
        post_ffn_norm=w(hidden) if post else None, eps=1e-6, scale=0.2)


@pytest.mark.parametrize("activation,post", [("gelu_glu", True), ("relu", False)])
def test_body_step_equals_its_op_chain_bit_for_bit(fast, activation, post):
    g = torch.Generator().manual_seed(3)
    layers = [_random_layer(g, activation, post) for _ in range(3)]
    x = torch.randn(1, 64, generator=g)
    pools = [torch.randn(50, 2, 32, generator=g), torch.randn(50, 2, 32, generator=g)]
    copies = [p.clone() for p in pools]
    # Each layer reads its own slots (a windowed layer fewer), its own written last.
    slots = [[torch.tensor([3, 17, 9, 30])], [torch.tensor([9, 31])],
             [torch.tensor([1, 2, 40, 32])]]
    angles = torch.randn(1, 16, generator=g)
    cos, sin = [angles.cos()] * 3, [angles.sin()] * 3
    got = fused_ops.body_step(layers)(x, *pools, slots, cos, sin)
    want = fused_ops.body_step_reference(layers, x, *copies, slots, cos, sin)
    assert torch.equal(got, want)
    assert torch.equal(pools[0], copies[0]) and torch.equal(pools[1], copies[1])


def test_body_step_wants_inputs_for_every_layer(fast):
    g = torch.Generator().manual_seed(4)
    run = fused_ops.body_step([_random_layer(g, "relu", False)] * 2)
    pools = [torch.zeros(8, 2, 32), torch.zeros(8, 2, 32)]
    with pytest.raises(RuntimeError, match="each of its 2 layers"):
        run(torch.zeros(1, 64), *pools, [[torch.tensor([1])]], [torch.ones(1, 16)],
            [torch.zeros(1, 16)])


def _engine(tiny_models, name="gemma3"):
    return Engine(load_model(tiny_models[name][2]), EngineOptions(device="cpu", n_ctx=64, weights="q8"))


@pytest.mark.parametrize("name", ["gemma3", "llama-relu"])
def test_decode_and_tree_rows_in_one_call_equal_block_by_block(fast, tiny_models, name):
    engine = _engine(tiny_models, name)
    runner, model = engine.runner, engine.model
    assert model.fast_body is not None
    ids = engine.encode("the cat is in the hat")
    body = model.fast_body
    runs = []
    for fast_body in (body, None):
        model.fast_body = fast_body
        runner.reset("s")
        runner.prefill("s", ids)
        logits = [runner.decode("s", t) for t in (5, 9, 2)]
        tree = TokenTree.root(4)
        tree.add(tree.add(0, 7), 3)
        tree.add(0, 9)
        runner.begin_tree("s", len(tree))
        for i in range(len(tree)):  # one row per call, as the self-drafter goes
            runner.tree_hidden("s", tree, upto=i + 1)
        runs.append(logits + list(tree.hidden))
    model.fast_body = body
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_trees_rows_in_one_call_equal_them_op_by_op_and_one_at_a_time(fast, tiny_models):
    """A branching tree verified in one pass through the one-call body: the bits of the op-by-op
    blocks, and of each node computed alone."""
    engine = _engine(tiny_models)
    runner, model = engine.runner, engine.model
    ids = engine.encode("the cat is in the hat and the dog")
    hidden = []
    for mode in ("one call", "op by op", "one at a time"):
        for block in model.blocks:
            block.fast.one_call = mode != "op by op"
        runner.reset("s")
        runner.prefill("s", ids)
        tree = TokenTree.root(4)
        a = tree.add(0, 7)
        tree.add(tree.add(a, 3), 12)
        tree.add(0, 9)
        runner.begin_tree("s", len(tree))
        if mode == "one at a time":
            for i in range(len(tree)):
                runner.tree_hidden("s", tree, upto=i + 1)
        else:
            runner.tree_hidden("s", tree)
        hidden.append(torch.cat(tree.hidden))
    assert torch.equal(hidden[0], hidden[1]) and torch.equal(hidden[0], hidden[2])


def test_a_q8_0_embedding_is_read_in_the_one_call_path_with_the_same_bits(fast, tiny_models,
                                                                         tmp_path):
    from gguf import GGMLQuantizationType

    from ember.models import synthetic

    cfg, weights = tiny_models["gemma3"][:2]
    path = synthetic.write_gguf(tmp_path / "q8.gguf", cfg, weights,
                                qtype=int(GGMLQuantizationType.Q8_0))
    engine = Engine(load_model(path), EngineOptions(device="cpu", n_ctx=64, weights="q8"))
    runner, model = engine.runner, engine.model
    body = model.fast_body
    assert body._embedding_rows is not None
    ids = engine.encode("the cat is in the hat")
    runs = []
    for fast_body in (body, None):
        model.fast_body = fast_body
        runner.reset("s")
        runner.prefill("s", ids)
        runs.append([runner.decode("s", t) for t in (5, 9, 2)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_hooks_and_changed_blocks_run_block_by_block(fast, tiny_models):
    engine = _engine(tiny_models)
    runner, model = engine.runner, engine.model
    ids = engine.encode("the cat is in the hat")
    runner.prefill("s", ids)
    want = runner.decode("s", 5)
    body = model.fast_body
    x = torch.tensor([5])
    cache = runner.kv.view(runner.sessions["s"].seq_id)

    seen = []
    handle = model.blocks[1].register_forward_hook(lambda m, i, o: seen.append(1))
    assert body(x, cache.length, cache) is None
    runner.reset("s")
    runner.prefill("s", ids)
    assert torch.equal(runner.decode("s", 5), want) and seen
    handle.remove()

    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    assert body(x, cache.length, cache) is None
    handle.remove()

    model.blocks[0].fast.one_call = False
    assert body(x, cache.length, cache) is None
    model.blocks[0].fast.one_call = True
    assert body(torch.tensor([5, 6]), cache.length, cache) is None  # two rows: block by block


def test_the_fp32_body_has_no_one_call_body(tiny_models):
    engine = Engine(load_model(tiny_models["gemma3"][2]),
                    EngineOptions(device="cpu", n_ctx=64, weights="fp32"))
    assert engine.model.fast_body is None
