"""The embedded default model (Gemma 3 270M Q4_K_M) against llama.cpp's reference outputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ember.models.support.errors import EmberError
from ember.offload.options.sampling import GREEDY

DATA = Path(__file__).parent / "data"
MARGIN = 0.5  # below this top-2 gap llama.cpp's quantized activations may flip the argmax

pytestmark = pytest.mark.slow


def _fixture():
    return json.loads((DATA / "gemma3_greedy_fixture.json").read_text())


def test_prompt_ids_match_llama_cpp(default_engine):
    for case in _fixture()["greedy"]:
        special = "<start_of_turn>" in case["prompt"]
        assert default_engine.encode(case["prompt"], parse_special=special) == case["prompt_ids"]


def test_greedy_continuations_match_llama_cpp(default_engine):
    """Ids equal llama.cpp's up to its first near-tie step, for at least 7 of 8 prompts."""
    agreeing, report = 0, []
    for case in _fixture()["greedy"]:
        steps = case["steps"]
        done = default_engine.generate(case["prompt_ids"], sampling=GREEDY, max_tokens=len(steps),
                                       ignore_eos=True)
        compare_to = next((i for i, s in enumerate(steps)
                           if s["top1_logit"] - s["top2_logit"] < MARGIN), len(steps))
        expected = [s["id"] for s in steps][:compare_to + 1]  # the near-tie step may still agree
        got = done.token_ids[:compare_to + 1]
        ok = got[:compare_to] == expected[:compare_to]
        agreeing += ok
        report.append((case["prompt"][:30], compare_to, ok))
    assert agreeing >= 7, report


def test_first_step_logits_close_to_llama_cpp(default_engine):
    """Our logits vs llama.cpp's top-1 logit at the first step. The runtime rounds
    activations to int8 per block (as llama.cpp does, but not at the same points): one case's
    top logit is ~0.5 away from llama.cpp's (19.00 vs 18.51), so the tolerance is 0.6."""
    import torch

    for case in _fixture()["greedy"][:3]:
        default_engine.runner.reset("default")
        logits = default_engine.runner.prefill("default", case["prompt_ids"])
        step = case["steps"][0]
        assert int(torch.argmax(logits)) == step["id"]
        assert math.isclose(float(logits[step["id"]]), step["top1_logit"], abs_tol=0.6)


def _english_ppl(engine, window):
    from ember.offload.profile.perplexity import perplexity

    text = (DATA / "english.txt").read_text()
    ids = engine.tokenizer.encode(text, add_bos=False)
    return ids, perplexity(engine.model, ids, engine.tokenizer.bos_id, window=window)


def test_perplexity_within_2_percent_of_llama_cpp(default_engine):
    """Against llama.cpp's figure recorded on the same file and windows (the fixture says how)."""
    ref = json.loads((DATA / "gemma3_perplexity_llamacpp.json").read_text())
    ids, ours = _english_ppl(default_engine, ref["window"])
    assert ours.tokens == ref["tokens"] == len(ids)
    assert abs(ours.ppl / ref["ppl"] - 1) < 0.02, (ours.ppl, ref["ppl"])


def test_perplexity_matches_live_llama_cpp(default_engine, default_model_path):
    pytest.importorskip("llama_cpp", reason="the [baseline] extra is not installed")
    from ember.app.baseline import LlamaCpp

    ids, ours = _english_ppl(default_engine, 512)
    theirs = LlamaCpp(default_model_path, 2, 512, logits_all=True).perplexity(
        ids, default_engine.tokenizer.bos_id, 512)
    assert theirs.tokens == ours.tokens
    assert abs(ours.ppl / theirs.ppl - 1) < 0.02, (ours.ppl, theirs.ppl)


def test_live_llama_cpp_baseline_decodes_greedily(default_model_path):
    """The speed baseline feeds llama.cpp its own greedy tokens (the recorded fixture's)."""
    pytest.importorskip("llama_cpp", reason="the [baseline] extra is not installed")
    from ember.app.baseline import LlamaCpp

    case = _fixture()["greedy"][0]
    steps = case["steps"][:8]
    run = LlamaCpp(default_model_path, 2, 64).decode_speed(case["prompt_ids"], len(steps))
    assert run["token_ids"] == [s["id"] for s in steps]
    assert run["prefill"] > 0 and run["decode"] > 0


def test_live_llama_cpp_keeps_the_q8_0_cache_ember_is_compared_with(default_model_path):
    """With --kv-type q8_0 the baseline is llama.cpp's own Q8_0 cache (-ctk/-ctv q8_0), which
    it keeps only with flash attention: on unless asked off, and then a clear error."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="the [baseline] extra is not installed")
    from ember.app.baseline import LlamaCpp

    with pytest.raises(EmberError, match="q8_0 KV cache only with flash attention"):
        LlamaCpp(default_model_path, 2, 64, flash_attn=False, kv_type="q8_0")
    with pytest.raises(EmberError, match="no llama.cpp KV cache type for 'q4_0'"):
        LlamaCpp(default_model_path, 2, 64, kv_type="q4_0")
    case = _fixture()["greedy"][0]
    state = {}
    # float16 with flash attention asked for; Q8_0 turns it on itself
    for kv_type, other in (("f16", LlamaCpp(default_model_path, 2, 64, flash_attn=True)),
                           ("q8_0", LlamaCpp(default_model_path, 2, 64, kv_type="q8_0"))):
        assert other.flash_attn and other.kv_type == kv_type
        run = other.decode_speed(case["prompt_ids"], 4)
        assert len(run["token_ids"]) == 4 and run["decode"] > 0
        state[kv_type] = llama_cpp.llama_state_get_size(other.llm.ctx)
    # its cache in Q8_0 blocks: 34 bytes per 32 values where float16 takes 64
    assert 0.5 < state["q8_0"] / state["f16"] < 0.6, state
    # bfloat16 (GGML's type 30, which llama_cpp names no constant for) with flash attention off
    # too, float16's bytes
    bf16 = LlamaCpp(default_model_path, 2, 64, kv_type="bf16")
    assert not bf16.flash_attn and len(bf16.decode_speed(case["prompt_ids"], 4)["token_ids"]) == 4
    assert llama_cpp.llama_state_get_size(bf16.llm.ctx) == state["f16"]


def test_sessions_with_swaps_equal_sessions_without_past_the_window(default_model_path):
    """Two conversations longer than the 512-token window share a device pool that holds
    one, so every switch swaps; their logits equal those of a pool that holds both."""
    import torch

    from ember.models.loader import load_model
    from ember.offload.runtime.engine import Engine, EngineOptions

    loaded = load_model(default_model_path)
    tight = Engine(loaded, EngineOptions(device="cpu", n_ctx=1024, threads=2,
                                         kv_host_budget=128 << 20))
    roomy = Engine(loaded, EngineOptions(device="cpu", n_ctx=1024, threads=2,
                                         kv_budget=256 << 20))
    text = (DATA / "english.txt").read_text()
    convs = {"a": tight.encode(text), "b": tight.encode(text[::-1])[:580]}  # 491 + 580 tokens
    for round_ in range(3):
        for name, ids in convs.items():
            got, want = tight.runner.prefill(name, ids), roomy.runner.prefill(name, ids)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            ids.append(int(torch.argmax(want)))
    usage = tight.kv_usage()
    assert usage["swaps_in"] >= 2 and usage["dropped"] == 0
    assert roomy.kv_usage()["swaps_out"] == 0


def test_paged_attention_equals_contiguous_past_the_512_window(default_engine):
    """Same chunks, same decode steps: the paged cache's logits equal the contiguous cache's
    across Gemma 3's 512-token sliding window (local layers release blocks on the way)."""
    import torch

    engine, model = default_engine, default_engine.model
    ids = engine.encode((DATA / "english.txt").read_text() * 2)[:700]
    engine.runner.reset("window")
    paged = engine.runner.prefill("window", ids)  # chunks of 512 + 188
    cache = model.new_cache(720)
    for lo in range(0, len(ids), 512):
        contiguous = model.logits(model.hidden(torch.tensor(ids[lo:lo + 512]), cache))[-1]
    torch.testing.assert_close(paged, contiguous, rtol=1e-5, atol=1e-5)
    for token in (818, 5279, 529):
        paged = engine.runner.decode("window", token)
        contiguous = model.logits(model.hidden(torch.tensor([token]), cache))[0]
        torch.testing.assert_close(paged, contiguous, rtol=1e-5, atol=1e-5)
    seq = engine.kv.seqs[engine.runner.session("window").seq_id]
    assert seq.tables[0][0] is None  # a local layer gave back its oldest block
