"""Speculative decoding: token trees, verification numerics, lossless acceptance, drafters."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch

from ember.models.support.errors import ConfigError
from ember.models.loader import load_model
from ember.offload.runtime.engine import Engine, EngineOptions
from ember.offload.kv.paged import PagedKVCache
from ember.offload.options.sampling import GREEDY, SamplingParams
from ember.offload.options.tree_spec import parse_tree, tree_size
from ember.offload.speculative.token_tree import TokenTree

PROMPTS = ["the cat is in the hat and the dog is in the", "an apple of the", "wh is the"]


def _engine(path, **kw) -> Engine:
    return Engine(load_model(path), EngineOptions(device="cpu", n_ctx=128, **kw))


@pytest.fixture(scope="module")
def plain(tiny_models):
    return {name: _engine(m[2]) for name, m in tiny_models.items() if name in ("gemma3", "llama-silu_glu")}


def _greedy(engine, text, n=40):
    return engine.generate(engine.encode(text), sampling=GREEDY, max_tokens=n,
                           ignore_eos=True).token_ids


# -- token trees ------------------------------------------------------------------------
def test_parse_tree_and_size():
    assert parse_tree("1,1,3,1") == (1, 1, 3, 1)
    assert tree_size((1, 1, 3, 1)) == 1 + 1 + 1 + 3 + 3
    for bad in ("", "1,0", "a,b", "8,8,8,8"):
        with pytest.raises(ConfigError):
            parse_tree(bad)


def test_tree_paths_and_mask():
    tree = TokenTree.root(5)
    a, b = tree.add(0, 7), tree.add(0, 8)
    c = tree.add(a, 9)
    assert tree.add(0, 7) == a and tree.children(0) == {7: a, 8: b}
    assert tree.path(c) == [0, a, c] and tree.depths == [0, 1, 1, 2]
    mask = tree.ancestor_mask()
    assert mask[c].tolist() == [True, True, False, True]
    assert mask[b].tolist() == [True, False, True, False]


def test_compact_moves_positions(tiny_models):
    cfg = tiny_models["gemma3"][0]
    kv = PagedKVCache(cfg, device_blocks=64, block_size=4)
    seq = kv.allocate()
    view = kv.view(seq)
    view.reserve(6)
    for layer in range(cfg.n_layers):
        k = torch.arange(6, dtype=torch.float32)[:, None, None].expand(6, cfg.n_kv_heads, cfg.head_dim)
        view.write(layer, 0, k, -k)
    kv.compact(seq, [3, 5], [1, 2])
    view.commit(3)
    k, v = view.read(0, 0, 3)
    assert k[:, 0, 0].tolist() == [0.0, 3.0, 5.0] and v[:, 0, 0].tolist() == [0.0, -3.0, -5.0]


# -- numerics -----------------------------------------------------------------------------
@pytest.mark.parametrize("weights", ["fp32", "auto"])
def test_tree_verification_logits_equal_decode_bit_for_bit(tiny_models, weights):
    """Verifying a chain gives exactly the logits plain decode gives: one pass over all rows
    with the batch-invariant file-blocks model ("auto"), one row at a time with the fp32
    reference."""
    from ember.offload.body import file_blocks_model

    if weights != "fp32" and not file_blocks_model.applies():
        pytest.skip("no C++ kernels here")
    engine = _engine(tiny_models["gemma3"][2], weights=weights)
    assert engine.model.batch_invariant == (weights != "fp32")
    runner = engine.runner
    ids = engine.encode(PROMPTS[0])
    out = _greedy(engine, PROMPTS[0], 12)
    runner.reset("v")
    runner.prefill("v", ids)
    ref = [runner.decode("v", t) for t in out[:11]]
    runner.reset("v")
    runner.prefill("v", ids)
    tree = TokenTree.root(out[0])
    for t in out[1:11]:
        tree.add(len(tree) - 1, t)
    assert runner.begin_tree("v", len(tree)) == len(tree)
    logits = runner.verify("v", tree)
    assert all(torch.equal(logits[i], ref[i]) for i in range(len(tree)))
    runner.reset("v")


def test_batched_tree_pass_matches_rows_closely(tiny_models):
    """The fp32 reference's one-pass tree-mask forward agrees with its row-by-row passes to
    rounding only (fp32 torch matmul is not batch-invariant), hence the runner's rows one at
    a time for it. Both paths are called directly on the model."""
    engine = _engine(tiny_models["gemma3"][2], weights="fp32")
    runner, model = engine.runner, engine.model
    ids = engine.encode(PROMPTS[1])
    tree = TokenTree.root(ids[-1])
    a = tree.add(0, 40)
    tree.add(0, 50)
    tree.add(a, 60)
    tree.add(a, 70)
    runner.prefill("b", ids[:-1])
    context = len(runner.tokens("b"))
    runner.begin_tree("b", len(tree))
    view = engine.kv.view(runner.sessions["b"].seq_id)
    tokens = torch.tensor(tree.tokens)
    rows = torch.cat([model.hidden(tokens[i: i + 1], view, tree.row_for(context, i))
                      for i in range(len(tree))])
    batched = model.hidden(tokens, view, tree.rows_for(context, 0, len(tree)))
    runner.reset("b")
    torch.testing.assert_close(model.logits(batched), model.logits(rows), rtol=1e-4, atol=1e-4)


def test_which_ops_are_batch_invariant():
    """Documents the cause: a T-row fp32 matmul may round each row differently from a
    single-row one (GEMM vs GEMV kernels); the file-blocks kernel does not."""
    from ember.kernels import block_matmul as bm
    from ember.models.quantize import quantize
    from ember.models.quants import T
    from ember.models.weights import QTensor

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g)
    w = torch.randn(64, 96, generator=g)
    rows = torch.stack([x[i: i + 1] @ w for i in range(8)])[:, 0]
    assert torch.allclose(x @ w, rows, atol=1e-5)  # equal to rounding; bitwise varies by BLAS
    q = QTensor(quantize(torch.randn(96, 64, generator=g), T.Q8_0), T.Q8_0, (96, 64))
    if not bm.available():
        pytest.skip("no block kernel here")
    batched = bm.block_matmul(x, [q])
    single = torch.cat([bm.block_matmul(x[i: i + 1], [q]) for i in range(8)])
    assert torch.equal(batched, single)


# -- lossless ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["lookup", "self", "model"])
@pytest.mark.parametrize("name", ["gemma3", "llama-silu_glu"])
def test_greedy_speculation_is_lossless(tiny_models, plain, name, mode):
    path = tiny_models[name][2]
    spec = _engine(path, speculate=mode, draft_model=str(path) if mode == "model" else None)
    for text in PROMPTS:
        assert _greedy(spec, text) == _greedy(plain[name], text)
    assert spec.speculation["verifications"] > 0


def test_fp32_body_rows_are_lossless(tiny_models):
    """The fp32 reference body is not batch-invariant: verification goes row by row."""
    path = tiny_models["llama-silu_glu"][2]
    plain32 = _engine(path, weights="fp32")
    for mode in ("self", "lookup"):
        spec = _engine(path, weights="fp32", speculate=mode, tree="2,1,1,1")
        for text in PROMPTS[:2]:
            assert _greedy(spec, text, 30) == _greedy(plain32, text, 30)


def test_trees_with_branches_are_lossless(tiny_models, plain):
    path = tiny_models["gemma3"][2]
    for mode in ("self", "lookup"):
        spec = _engine(path, speculate=mode, tree="2,2,1,1")
        for text in PROMPTS:
            assert _greedy(spec, text, 30) == _greedy(plain["gemma3"], text, 30)
        assert max(spec.speculation["accepted_per_step"]) >= 1


@pytest.mark.parametrize("kv_type", ["q8_0", "bf16"])
def test_speculation_is_lossless_on_every_kv_type(tiny_q4_k_m, kv_type):
    """A tree's rows read a Q8_0 or bfloat16 cache as a decoded token does, to the bit (on a
    model whose head dim takes them: 64)."""
    path = tiny_q4_k_m[2]
    plain_kv = _engine(path, kv_type=kv_type)
    spec = _engine(path, kv_type=kv_type, speculate="self", tree="2,2,1,1")
    for text in PROMPTS:
        assert _greedy(spec, text, 30) == _greedy(plain_kv, text, 30)
    assert spec.speculation["verifications"] > 0


@pytest.mark.parametrize("weights", ["auto", "fp32"])
def test_self_drafter_reads_a_head_kept_in_host_ram(tiny_models, weights):
    """On a GPU the runtime may wrap the LM head (HostLMHead); the shortlist reads the real one."""
    from ember.offload.speculative.drafters import ShortlistHead
    from ember.offload.hybrid.setup import HostLMHead

    model = _engine(tiny_models["gemma3"][2], weights=weights).model
    hidden = torch.randn(2, model.cfg.hidden_size)
    plain_top = ShortlistHead(model, 50).top(hidden, 3)
    inner = model.head
    model.head = HostLMHead(inner)
    try:
        assert ShortlistHead(model, 50).top(hidden, 3) == plain_top
    finally:
        model.head = inner


def test_drafting_with_the_target_accepts_every_draft(tiny_models, plain):
    path = tiny_models["gemma3"][2]
    spec = _engine(path, speculate="model", draft_model=str(path), tree="1,1,1,1,1")
    out = _greedy(spec, PROMPTS[0], 37)
    assert out == _greedy(plain["gemma3"], PROMPTS[0], 37)
    # Every drafted level is accepted (the sizer soon drafts little: a draft model as big as
    # the target costs more per level than it saves).
    stats = spec.speculation
    assert stats["accepted_per_step"] == [n - 1 for n in stats["tree_nodes_per_step"]]
    assert max(stats["accepted_per_step"]) >= 1


def test_seeded_sampling_is_identical_draw_for_draw(tiny_models, plain):
    path = tiny_models["gemma3"][2]
    spec = _engine(path, speculate="self")
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    ids = spec.encode(PROMPTS[1])
    a = spec.generate(ids, sampling=params, max_tokens=30, ignore_eos=True).token_ids
    b = plain["gemma3"].generate(ids, sampling=params, max_tokens=30, ignore_eos=True).token_ids
    assert a == b


def test_sampling_distribution_matches_target(tiny_models, plain):
    """Statistical: 3-token continuations with speculation (seeds 0..n-1) and with plain
    decoding (other seeds) come from the same distribution (top-2 sampling: 8 outcomes)."""
    path = tiny_models["gemma3"][2]
    spec = _engine(path, speculate="model", draft_model=str(path), tree="1,2")
    ids = spec.encode(PROMPTS[2])
    n = 150
    counts = []
    for engine, offset in ((spec, 0), (plain["gemma3"], 10_000)):
        c = collections.Counter()
        for seed in range(n):
            p = SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, seed=seed + offset)
            c[tuple(engine.generate(ids, sampling=p, max_tokens=3, ignore_eos=True).token_ids)] += 1
        counts.append(c)
    keys = set(counts[0]) | set(counts[1])
    tv = 0.5 * sum(abs(counts[0][k] - counts[1][k]) for k in keys) / n
    assert len(keys) > 2 and tv < 0.2, (tv, counts)


# -- options -------------------------------------------------------------------------------
def test_options_are_checked():
    with pytest.raises(ConfigError, match="--speculate"):
        EngineOptions(speculate="maybe")
    with pytest.raises(ConfigError, match="--draft-model"):
        EngineOptions(speculate="model")
    with pytest.raises(ConfigError, match="--tree"):
        EngineOptions(speculate="self", tree="1,x")


def test_mismatched_draft_tokenizer_is_refused(tiny_models):
    from ember.offload.speculative.model_drafter import check_same_tokenizer

    a = load_model(tiny_models["gemma3"][2]).tokenizer

    class Other:
        vocab_size = a.vocab_size + 1

    with pytest.raises(ConfigError, match="tokenizer"):
        check_same_tokenizer(a, Other(), "other.gguf")


# -- the default model -----------------------------------------------------------------------
DEFAULT_PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Copy this list:\n1. apples\n2. bread\n3. cheese\n\nCopy:\n1. apples",
]


@pytest.mark.parametrize("mode", ["self", "lookup"])
def test_default_model_greedy_speculation_is_lossless(default_engine, mode):
    """A few prompts here; `bench/speculate_lossless.py` checks all 21 of the bench."""
    spec = Engine(default_engine.loaded, EngineOptions(device="cpu", n_ctx=2048, threads=2,
                                                       speculate=mode))
    drafted = []
    for text in DEFAULT_PROMPTS:
        assert _greedy(spec, text, 24) == _greedy(default_engine, text, 24), text
        drafted += [n - 1 for n in spec.speculation["tree_nodes_per_step"]]
    assert max(drafted) >= 1  # the sizer drafts only where it pays, but it does draft


def test_tree_sizer_drafts_what_pays():
    from ember.offload.speculative.verify import TreeSizer

    sizer = TreeSizer((1, 1, 1, 1))
    assert sizer.next_widths() == ()  # the first step is plain: it measures a step
    sizer.update(0, 0, 1.0)
    assert sizer.next_widths() == (1,)  # the priors: one level pays, two do not
    for _ in range(4):  # every level accepted, 0.1 step each: depth grows to the maximum
        levels = len(sizer.next_widths())
        sizer.update(levels, levels, 1.0 + 0.1 * levels)
    assert sizer.next_widths() == (1, 1, 1, 1)
    for _ in range(8):  # rejected at once, 0.5 step per level: drafting does not pay
        sizer.update(4, 0, 3.0)
    plan = [sizer.next_widths() for _ in range(28)]
    probes = [i for i, widths in enumerate(plan) if widths]
    assert probes == [3, 11, 27] and all(plan[i] == (1,) for i in probes)  # rarer and rarer
    cheap = TreeSizer((1, 1, 1, 1, 1, 1))
    cheap.update(0, 0, 1.0)
    for _ in range(12):  # 3 of 6 levels accepted (p -> 0.75), each 0.2 of a step
        cheap.update(6, 3, 2.2)
    depth = len(cheap.next_widths())
    assert 0 < depth < 6 and cheap.p ** depth > cheap.level_cost()


def test_an_empty_lookup_draft_is_a_plain_step(tiny_models, plain):
    """Prompt lookup with no match decodes plainly: no one-node tree goes through
    verification, and no reserved block is left behind."""
    path = tiny_models["gemma3"][2]
    spec = _engine(path, speculate="lookup")
    spec.sizer.next_widths = lambda: (1, 1)  # ask for a draft every step
    verified = []
    verify = spec.runner.verify
    spec.runner.verify = lambda name, tree: verified.append(len(tree)) or verify(name, tree)
    for text in PROMPTS:
        assert _greedy(spec, text, 24) == _greedy(plain["gemma3"], text, 24)
        nodes = spec.speculation["tree_nodes_per_step"]
        assert 1 in nodes and min(verified, default=2) > 1
        assert spec.kv.usage()["device_blocks_used"] == plain["gemma3"].kv.usage()["device_blocks_used"]


# -- draft models: the cache keeps pace, lookup in the same tree, auto ------------------------
def test_draft_cache_keeps_pace_with_the_target(tiny_models, plain):
    """Drafting with the target itself (every level accepted), each draft finds the draft
    cache at most one token behind (the leaf the last draft never ran, computed with the
    next draft's first level), never a backlog: nothing is computed apart as catch-up."""
    from ember.offload.speculative.model_drafter import DRAFT

    path = tiny_models["gemma3"][2]
    spec = _engine(path, speculate="model", draft_model=str(path))
    spec.sizer.next_widths = lambda: (1, 1, 1)  # draft every step
    spec.drafter.lookup_depth = 0  # the model's own tree alone
    draft_runner = spec.drafter.model.runner
    computed = []
    sync = draft_runner.sync
    draft_runner.sync = lambda name, ids: computed.append(sync(name, ids)) or computed[-1]
    ids = spec.encode(PROMPTS[0])
    out = spec.generate(ids, sampling=GREEDY, max_tokens=30, ignore_eos=True).token_ids
    assert out == _greedy(plain["gemma3"], PROMPTS[0], 30)
    assert computed[0] == len(ids)  # the prompt, prefilled with the target's
    assert sum(computed[1:]) == 0 and spec.speculation["verifications"] > 5
    held = draft_runner.tokens(DRAFT)
    assert held == (ids + out)[: len(held)] and len(held) >= len(ids) + len(out) - 8


def test_lookup_branches_join_the_model_tree(tiny_models, plain):
    """`--speculate model` drafts the draft model's chain and the prompt lookup's branch in
    one tree: on a text that repeats, trees run deeper than the model's levels."""
    path = tiny_models["gemma3"][2]  # its greedy continuation repeats a token
    spec = _engine(path, speculate="model", draft_model=str(path), tree="1,1")
    spec.sizer.next_widths = lambda: (1, 1)
    assert _greedy(spec, PROMPTS[0], 30) == _greedy(plain["gemma3"], PROMPTS[0], 30)
    assert spec.speculation["drafter"] == "model+lookup"
    assert max(spec.speculation["tree_nodes_per_step"]) > 3


def _small_same_tokenizer(tmp_path, layers: int, **overrides) -> Path:
    from ember.models.testing import synthetic

    cfg = synthetic.tiny_config("gemma3", n_layers=layers,
                                sliding_window=(8,) * (layers - 1) + (None,), **overrides)
    return synthetic.write_gguf(tmp_path / f"gemma3-{layers}.gguf", cfg,
                                synthetic.tiny_weights(cfg, seed=layers))


def test_a_draft_model_with_a_shorter_context_stops_drafting_at_its_end(tiny_models, plain,
                                                                        tmp_path):
    short = _small_same_tokenizer(tmp_path, 1, context_length=32)
    spec = _engine(tiny_models["gemma3"][2], speculate="model", draft_model=str(short))
    spec.sizer.next_widths = lambda: (1, 1)
    assert _greedy(spec, PROMPTS[0], 40) == _greedy(plain["gemma3"], PROMPTS[0], 40)
    assert spec.drafter.model.runner.n_ctx == 32


def test_auto_finds_a_much_smaller_model_of_the_same_tokenizer(tiny_models, tmp_path):
    from ember.offload.speculative.draft_choice import find_draft_model

    target = tiny_models["gemma3"][2]  # 6 layers
    (tmp_path / "broken.gguf").write_bytes(b"GGUF not really")
    assert find_draft_model(target, [tmp_path]) is None
    _small_same_tokenizer(tmp_path, 5)  # more than half the target's bytes: no gain
    assert find_draft_model(target, [tmp_path]) is None
    small = _small_same_tokenizer(tmp_path, 1)
    assert find_draft_model(target, [tmp_path, tmp_path / "absent"]) == small.resolve()
    assert find_draft_model(small, [tmp_path]) is None  # nothing smaller than it


@pytest.mark.parametrize("name", ["gemma3", "llama-silu_glu"])
def test_auto_is_lossless_with_and_without_a_draft_model(tiny_models, plain, tmp_path,
                                                         monkeypatch, name):
    from ember.offload.speculative import draft_choice

    path = tiny_models[name][2]
    monkeypatch.setattr(draft_choice, "draft_model_dirs", lambda: [tmp_path])
    alone = _engine(path, speculate="auto")
    assert alone.drafter.name == "lookup"
    _small_same_tokenizer(tmp_path, 1)
    drafted = _engine(path, speculate="auto")
    assert drafted.drafter.name == "model+lookup"
    for spec in (alone, drafted):
        for text in PROMPTS:
            assert _greedy(spec, text) == _greedy(plain[name], text)
    assert _engine(path, speculate="auto", weights="fp32").drafter is None  # row by row


def test_shortlist_head_holds_the_stop_tokens(tiny_models):
    from ember.offload.speculative.drafters import ShortlistHead

    model = _engine(tiny_models["gemma3"][2]).model
    vocab = model.cfg.vocab_size
    head = ShortlistHead(model, 50, always=(vocab - 1, 3))
    assert head.extra_ids == [vocab - 1]
    hidden = torch.randn(1, model.cfg.hidden_size)
    assert all(t < 50 or t == vocab - 1 for t in head.top(hidden, 60)[0])


def test_tree_sizer_is_not_locked_out_by_a_cost_spike():
    """One step that costs many times the usual (a draft cache catching up, another process)
    does not stop drafting; a run of them does, yet probes go on at least every
    MAX_PROBE_EVERY steps, and once they show drafting pays again it resumes."""
    from ember.offload.speculative.verify import TreeSizer

    sizer = TreeSizer((1, 1, 1, 1))
    sizer.update(0, 0, 1.0)
    for _ in range(10):  # 3 of 4 levels accepted, 0.2 of a step each
        sizer.update(4, 3, 1.8)
    depth = len(sizer.next_widths())
    assert depth >= 2
    sizer.update(depth, depth, 1.0 + 8.0)  # the spike: 8 steps of catch-up
    assert len(sizer.next_widths()) >= 2
    for _ in range(12):  # now every level costs 2 steps and is rejected
        sizer.update(4, 0, 9.0)
    plan = [sizer.next_widths() for _ in range(300)]
    probes = [i for i, widths in enumerate(plan) if widths]
    assert len(probes) >= 300 // TreeSizer.MAX_PROBE_EVERY - 1
    assert max(b - a for a, b in zip(probes, probes[1:])) <= TreeSizer.MAX_PROBE_EVERY
    for _ in range(200):  # probes accepted and cheap again: drafting resumes
        levels = len(sizer.next_widths())
        if levels:
            sizer.update(levels, levels, 1.0 + 0.1 * levels)
        if levels >= 2:
            break
    assert levels >= 2


@pytest.mark.slow
def test_bench_speculate_runs_chat_requests_from_a_file(capsys, tiny_models, tmp_path):
    """`ember bench speculate --prompts-file` sends each line's request as a chat message,
    with a draft model and `auto`, and prints one JSON with every request's speedup."""
    import json

    from ember.app.cli import main

    path = str(tiny_models["gemma3"][2])
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"request": t}) + "\n" for t in PROMPTS[:2]))
    code = main(["bench", "speculate", "--model", path, "--draft-model", path, "--drafters",
                 "model", "auto", "--prompts-file", str(requests), "--gen-tokens", "8",
                 "--runs", "2", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["identical_to_plain"] and report["chat"]
    kind = report["kinds"]["requests"]
    assert report["prompts_per_kind"] == {"requests": 2}
    assert report["drafters"]["model"] == "model+lookup"
    assert len(kind["model"]["speedup_per_prompt"]) == 2
    assert kind["auto"]["speedup_min"] <= kind["auto"]["speedup"] <= kind["auto"]["speedup_max"]
    requests.write_text("{\"prompt\": 1}\n")
    assert main(["bench", "speculate", "--model", path, "--prompts-file", str(requests)]) == 2
    assert "request" in capsys.readouterr().err


def test_a_step_returns_no_more_than_the_tokens_still_wanted(tiny_models, plain):
    """The lookup's continuation runs past the model's levels; a reply ending inside it
    stops exactly at max_tokens, and its session holds just what was returned."""
    path = tiny_models["gemma3"][2]
    spec = _engine(path, speculate="model", draft_model=str(path))
    spec.sizer.next_widths = lambda: (1,)
    for n in (9, 13, 17):
        ids = spec.encode(PROMPTS[0])
        out = spec.generate(ids, sampling=GREEDY, max_tokens=n, ignore_eos=True).token_ids
        assert out == _greedy(plain["gemma3"], PROMPTS[0], n)
        assert spec.conversation_tokens("default") == ids + out[:-1]
