"""bench.make_model: random-weight LLaMA GGUF files of real shapes, streamed to disk."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import make_model as mm
from bench.model_shapes import MIXES, SHAPES, T, llama_vocab, tensor_type, use_more_bits
from ember.models.gguf_file import GGUFFile
from ember.models.loader import load_model, open_model

ROOT = Path(__file__).resolve().parents[1]
TINY = SHAPES["tiny"]


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """mix name -> the tiny model written with Ember's quantizer."""
    root = tmp_path_factory.mktemp("make_model")
    lines = []
    files = {name: mm.make_model("tiny", root / f"tiny-{name}.gguf", name, quantizer="ember",
                                 log=lines.append)
             for name in MIXES}
    assert lines[::2] == ["quantizer: ember (Ember's round-to-nearest ember.models.quantize)"] * 6
    return files


def expected_type(mix: str, name: str) -> T:
    """The mix rule spelt out for the 2-layer tiny shape (use_more_bits picks layer 1 only)."""
    if name.endswith("norm.weight"):
        return T.F32
    base = {"Q4_K_M": T.Q4_K, "Q5_K_M": T.Q5_K, "Q4_0": T.Q4_0, "Q6_K": T.Q6_K,
            "Q8_0": T.Q8_0, "F16": T.F16}[mix]
    if name == "output.weight" and mix not in ("Q8_0", "F16"):
        return T.Q6_K
    if mix in ("Q4_K_M", "Q5_K_M") and name in ("blk.1.attn_v.weight", "blk.1.ffn_down.weight"):
        return T.Q6_K
    return base


@pytest.mark.parametrize("mix", list(MIXES))
def test_tiny_model_opens_with_the_shape_and_mix(tiny_files, mix):
    path = tiny_files[mix]
    src = open_model(path)
    cfg = src.config
    assert (cfg.architecture, cfg.name, cfg.activation) == ("llama", "tiny", "silu_glu")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.n_layers, cfg.ffn_size) == (512, 256, 2, 512)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.context_length) == (4, 2, 64, 512)
    assert cfg.rope_base == 10_000.0 and math.isclose(cfg.rms_eps, 1e-5, rel_tol=1e-6)
    assert not cfg.tied_embeddings
    f = GGUFFile(path)
    assert f.get("general.quantized_by") == "ember"
    assert f.get("general.file_type") == int(MIXES[mix].file_type)
    types = {name: T(info.qtype).name for name, info in f.tensors.items()}
    assert types == {name: expected_type(mix, name).name for name, _ in TINY.tensors()}
    assert len(types) == 2 * 9 + 3


def test_tiny_model_tokenizes_and_gives_finite_logits(tiny_files):
    for mix in ("Q4_K_M", "F16"):
        loaded = load_model(tiny_files[mix])
        tok = loaded.tokenizer
        ids = tok.encode("the quick brown fox.\nHello")
        assert ids[0] == 1 and len(ids) > 5 and all(0 <= i < 512 for i in ids)
        assert tok.decode(ids) == "the quick brown fox.\nHello"
        assert (tok.bos_id, tok.eos_id) == (1, 2)
        model = loaded.model
        logits = model.logits(model.hidden(torch.tensor(ids), model.new_cache(64)))
        assert logits.shape == (len(ids), 512)
        assert torch.isfinite(logits).all() and logits.std() > 0


@pytest.mark.parametrize("mix", list(MIXES))
def test_random_codes_make_the_same_file_but_its_values_in_seconds(tiny_files, mix, tmp_path):
    """`--quantizer random`: the same tensors, types and shapes as the quantized file, its
    weights spread about as far (no NaN, no blow-up through the layers), values of its own."""
    lines = []
    path = mm.make_model("tiny", tmp_path / "tiny.gguf", mix, quantizer="random",
                         log=lines.append)
    assert lines[0] == "quantizer: random (random codes under fixed scales, nothing quantized)"
    want, got = GGUFFile(tiny_files[mix]), GGUFFile(path)
    assert got.get("general.quantized_by") == "random"
    assert {n: (i.qtype, i.shape) for n, i in got.tensors.items()} == \
        {n: (i.qtype, i.shape) for n, i in want.tensors.items()}
    for name in ("blk.0.ffn_gate.weight", "output.weight"):
        w = open_model(path).weights.load(name)
        assert torch.isfinite(w).all() and 0.005 < float(w.std()) < 0.1
    model = load_model(path).model
    ids = torch.tensor([1, 40, 41, 42])
    logits = model.logits(model.hidden(ids, model.new_cache(16)))
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_q4_k_m_rule_picks_llama_cpp_layers():
    def more(n):
        return [i for i in range(n) if use_more_bits(i, n)]

    assert more(2) == [1]
    assert more(22) == [0, 1, 4, 7, 10, 13, 16, 19, 20, 21]
    assert more(32) == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert more(40) == [0, 1, 2, 3, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34, 35, 36, 37, 38, 39]
    mix = MIXES["Q4_K_M"]
    shape = SHAPES["llama2-7b"]
    types = {name: tensor_type(mix, name, dims, shape.layers) for name, dims in shape.tensors()}
    assert types["token_embd.weight"] == T.Q4_K and types["output.weight"] == T.Q6_K
    assert types["blk.5.attn_v.weight"] == T.Q4_K and types["blk.6.attn_v.weight"] == T.Q6_K
    assert types["blk.6.ffn_down.weight"] == T.Q6_K and types["blk.6.ffn_up.weight"] == T.Q4_K
    assert sum(t == T.Q6_K for t in types.values()) == 2 * 16 + 1
    # A row that is not whole 256-blocks falls back as llama.cpp does (Q4_K -> Q5_0, Q6_K -> Q8_0).
    assert tensor_type(mix, "blk.0.ffn_up.weight", (64, 96), 2) == T.Q5_0
    assert tensor_type(mix, "output.weight", (64, 96), 2) == T.Q8_0


def test_shapes_have_the_real_parameter_counts():
    assert round(SHAPES["tinyllama-1.1b"].n_params / 1e6) == 1100
    assert round(SHAPES["llama2-7b"].n_params / 1e6) == 6738
    assert round(SHAPES["llama2-13b"].n_params / 1e6) == 13016


def test_vocab_is_exactly_the_size_asked_with_llama_specials():
    tokens, scores, types = llama_vocab(32000)
    assert len(tokens) == len(scores) == len(types) == len(set(tokens)) == 32000
    assert tokens[:4] == ["<unk>", "<s>", "</s>", "<0x00>"] and tokens[258] == "<0xFF>"
    assert types[:3] == [2, 3, 3] and set(types[3:259]) == {6} and set(types[259:]) == {1}
    assert scores[259:] == sorted(scores[259:], reverse=True)
    assert llama_vocab(32000) == (tokens, scores, types)   # deterministic
    with pytest.raises(ValueError, match="at least"):
        llama_vocab(300)


def test_chunked_generation_equals_whole_tensor(monkeypatch):
    whole = mm.tensor_bytes("blk.0.ffn_up.weight", (40, 256), T.Q4_K, seed=3)
    monkeypatch.setattr(mm, "CHUNK_ELEMENTS", 3 * 256)   # 3 rows at a time
    assert (mm.tensor_bytes("blk.0.ffn_up.weight", (40, 256), T.Q4_K, seed=3) == whole).all()
    assert not (mm.tensor_bytes("blk.0.ffn_up.weight", (40, 256), T.Q4_K, seed=4) == whole).all()


def _run(*args):
    return subprocess.run([sys.executable, "-m", "bench.make_model", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_bad_input_errors_cleanly(tmp_path):
    r = _run("llama-99b", tmp_path / "x.gguf")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "unknown shape 'llama-99b'" in r.stderr and "tinyllama-1.1b" in r.stderr
    r = _run("tiny", tmp_path / "x.gguf", "--quant", "Q3_K_S")
    assert r.returncode == 2 and "Q4_K_M" in r.stderr and "Traceback" not in r.stderr
    r = _run("tiny", tmp_path / "missing" / "x.gguf")
    assert r.returncode == 2 and "does not exist" in r.stderr
    (tmp_path / "there.gguf").write_bytes(b"keep me")
    r = _run("tiny", tmp_path / "there.gguf", "--quantizer", "ember")
    assert r.returncode == 2 and "--force" in r.stderr
    assert (tmp_path / "there.gguf").read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there.gguf"]


@pytest.mark.skipif(mm.llama_cpp_module() is None, reason="llama-cpp-python is not installed")
def test_llama_cpp_quantizer_writes_the_same_mix(tmp_path):
    out = mm.make_model("tiny", tmp_path / "tiny.gguf", "Q4_K_M", quantizer="llama.cpp",
                        log=lambda line: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]   # F16 file deleted
    f = GGUFFile(out)
    assert f.get("general.quantized_by") == "llama.cpp"
    types = {name: T(info.qtype).name for name, info in f.tensors.items()}
    assert types == {name: expected_type("Q4_K_M", name).name for name, _ in TINY.tensors()}
    loaded = load_model(out)
    model = loaded.model
    ids = loaded.tokenizer.encode("the quick brown fox")
    assert torch.isfinite(model.logits(model.hidden(torch.tensor(ids), model.new_cache(64)))).all()
