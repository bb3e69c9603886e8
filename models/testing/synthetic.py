"""Tiny random models written to real GGUF files and Hugging Face folders, for tests.

The same seeded weights can be written both ways, through the same writers and loaders users'
files go through, so a test can check that both formats give the same logits. The vocabulary is
a small SentencePiece-style one (byte fallback, a few merged pieces, chat control tokens).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from ..config import ModelConfig
from ..quantize import quantize
from ..rotary import llama3_rope_factors

CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
PIECES = [
    "▁", "▁t", "▁th", "▁the", "▁a", "▁an", "▁and", "▁o", "▁of", "▁i", "▁in", "▁is", "▁w", "▁wh",
    "he", "in", "er", "an", "on", "at", "en", "es", "or", "re", "ing", "▁s", "▁c", "▁f", "ll",
]
CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?'\"()-\n")
TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_BYTE = 1, 2, 3, 6


def tiny_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types): control tokens, 256 byte tokens, characters, merged pieces."""
    tokens = list(CONTROL) + [f"<0x{b:02X}>" for b in range(256)]
    types = [TYPE_CONTROL] * len(CONTROL) + [TYPE_BYTE] * 256
    types[CONTROL.index("<unk>")] = TYPE_UNKNOWN
    scores = [0.0] * len(tokens)
    # Longer pieces merge later in SentencePiece-BPE order: score falls with length.
    for i, piece in enumerate(CHARS + PIECES):
        tokens.append(piece)
        types.append(TYPE_NORMAL)
        scores.append(-float(len(piece)) - i * 1e-3)
    return tokens, scores, types


# Llama 3.1-style RoPE scaling on a tiny model: an original context of 64 puts the 16-value
# heads' eight frequencies in all three of its bands (kept, interpolated, divided by 8).
LLAMA3_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_context=64)
# (llama.cpp rounds a context up to a multiple of 256: the original context is 256 so that
# its n_ctx 64 stays within it, with the short set, and 512 goes past it, with the long.)
LONGROPE_ORIGINAL, LONGROPE_CONTEXT = 256, 1024
LONGROPE = dict(context_length=LONGROPE_CONTEXT,
                rope_factors=(1.0, 1.01, 1.03, 1.08, 1.2, 1.45, 1.9, 2.6),
                rope_factors_long=(1.0, 1.3, 2.1, 3.9, 7.5, 14.0, 24.0, 38.0),
                rope_original_context=LONGROPE_ORIGINAL,
                rope_attn_factor=math.sqrt(1 + math.log(LONGROPE_CONTEXT / LONGROPE_ORIGINAL)
                                           / math.log(LONGROPE_ORIGINAL)))
_SMALL = dict(hidden_size=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_size=128,
              context_length=256, activation="silu_glu")
# The newer families' tiny shapes (tiny_config's `arch`; "llama3" is a `llama` file). Gemma 2's
# attention cap is small so that tanh bends this random model's scores, not just passes them;
# its final cap is the real one (30), which bends the logits of `confident_weights`.
FAMILY_CONFIGS = {
    "llama3": dict(_SMALL, architecture="llama", name="tiny-llama3", n_layers=3, rms_eps=1e-5,
                   rope_base=500_000.0, rope_interleaved=True, tied_embeddings=False,
                   rope_factors=llama3_rope_factors(16, 500_000.0, **LLAMA3_SCALING)),
    "qwen2": dict(_SMALL, architecture="qwen2", name="tiny-qwen2", n_layers=3, rms_eps=1e-6,
                  rope_base=1_000_000.0, qkv_bias=True, tied_embeddings=True),
    # Qwen 3's heads are wider than hidden / heads (0.6B: 16 x 128 over 1024).
    "qwen3": dict(_SMALL, architecture="qwen3", name="tiny-qwen3", n_layers=3, head_dim=32,
                  rms_eps=1e-6, rope_base=1_000_000.0, qk_norm=True, tied_embeddings=False),
    "gemma2": dict(_SMALL, architecture="gemma2", name="tiny-gemma2", n_layers=4,
                   activation="gelu_glu", rms_eps=1e-6, sliding_window=(8, None, 8, None),
                   sandwich_norms=True, embed_scale=8.0, attn_scale=16 ** -0.5,
                   attn_softcap=2.0, final_logit_softcap=30.0, tied_embeddings=True),
    # (Not named "phi3": llama.cpp then looks up Phi-3's own special tokens in the vocabulary.)
    "phi3": dict(_SMALL, architecture="phi3", name="tiny-phi", n_layers=3, rms_eps=1e-5,
                 tied_embeddings=False),
    # Phi-3.5's LongRoPE: short and long divisor sets (shaped like the real ones: near 1 at
    # high frequency, growing toward low), the converter's attention factor for 1024 / 256.
    "phi3_longrope": dict({**_SMALL, **LONGROPE}, architecture="phi3", name="tiny-phi-longrope", n_layers=3,
                          rms_eps=1e-5, tied_embeddings=False),
}


def tiny_config(arch: str = "gemma3", activation: str | None = None, **overrides) -> ModelConfig:
    vocab = len(tiny_vocab()[0])
    if arch == "gemma3":
        cfg = ModelConfig(
            architecture="gemma3", name="tiny-gemma3", vocab_size=vocab, hidden_size=64,
            n_layers=6, n_heads=4, n_kv_heads=2, head_dim=16, ffn_size=128, context_length=256,
            activation="gelu_glu", rms_eps=1e-6, rope_base=1_000_000.0, local_rope_base=10_000.0,
            sliding_window=(8, 8, 8, 8, 8, None), qk_norm=True, sandwich_norms=True,
            embed_scale=math.sqrt(64), attn_scale=16 ** -0.5, tied_embeddings=True,
        )
    elif arch == "llama":
        cfg = ModelConfig(
            architecture="llama", name=f"tiny-llama-{activation or 'relu_glu'}", vocab_size=vocab,
            hidden_size=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, ffn_size=128,
            context_length=256, activation=activation or "relu_glu", rms_eps=1e-5,
            rope_base=10_000.0, tied_embeddings=False,
        )
    elif arch in FAMILY_CONFIGS:
        cfg = ModelConfig(vocab_size=vocab, **FAMILY_CONFIGS[arch])
    else:
        raise ValueError(f"no tiny model for architecture {arch!r}")
    return replace(cfg, **overrides)


def tiny_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights under canonical names, q/k rows in Hugging Face order.

    Norm tensors are the multipliers the model applies (GGUF convention: Gemma's 1 + w).
    """
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std

    def norm(n):
        return 1.0 + rand(n, std=0.1)

    h, hd, f = cfg.hidden_size, cfg.head_dim, cfg.ffn_size
    w = {"token_embd.weight": rand(cfg.vocab_size, h, std=0.5 / math.sqrt(h) * 4),
         "output_norm.weight": norm(h)}
    if not cfg.tied_embeddings:
        w["output.weight"] = rand(cfg.vocab_size, h, std=0.1)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = norm(h)
        w[p + "attn_q.weight"] = rand(cfg.n_heads * hd, h, std=0.2)
        w[p + "attn_k.weight"] = rand(cfg.n_kv_heads * hd, h, std=0.2)
        w[p + "attn_v.weight"] = rand(cfg.n_kv_heads * hd, h, std=0.2)
        w[p + "attn_output.weight"] = rand(h, cfg.n_heads * hd, std=0.1)
        w[p + "ffn_norm.weight"] = norm(h)
        if cfg.gated:
            w[p + "ffn_gate.weight"] = rand(f, h, std=0.2)
        w[p + "ffn_up.weight"] = rand(f, h, std=0.2)
        w[p + "ffn_down.weight"] = rand(h, f, std=0.1)
        if cfg.qk_norm:
            w[p + "attn_q_norm.weight"] = norm(hd)
            w[p + "attn_k_norm.weight"] = norm(hd)
        if cfg.qkv_bias:
            w[p + "attn_q.bias"] = rand(cfg.n_heads * hd, std=0.5)
            w[p + "attn_k.bias"] = rand(cfg.n_kv_heads * hd, std=0.5)
            w[p + "attn_v.bias"] = rand(cfg.n_kv_heads * hd, std=0.5)
        if cfg.sandwich_norms:
            w[p + "post_attention_norm.weight"] = norm(h)
            w[p + "post_ffw_norm.weight"] = norm(h)
    return w


# `confident_weights`: what is left of each block's output (the rest of the residual stream is
# the token's embedding), and how far a token's own next token leads the output layer.
BLOCK_SHARE = 0.05
NEXT_TOKEN_WEIGHT = 2.0


def confident_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor],
                      seed: int = 0) -> dict[str, torch.Tensor]:
    """`weights` changed so that the logits look like a trained model's at its confident
    positions: one token several logits ahead of the rest.

    A random model's logits are a random projection of its last hidden state: at a few
    positions in a hundred its top two are closer than float16 K/V arithmetic moves them
    (~0.01), and two correct engines pick different tokens. Here the residual stream is
    mostly the current token's embedding (each block's output scaled by BLOCK_SHARE: its
    output projections, or with sandwich norms the norms after them), and an untied output
    layer maps each token's embedding direction to one next token (a permutation), as a
    trained model's bigram statistics do; a tied one favours the token itself. Attention and
    the FFN still move the logits by units (the family tests' ablations measure it).
    """
    g = torch.Generator().manual_seed(seed)
    scaled = ("post_attention_norm.weight", "post_ffw_norm.weight") if cfg.sandwich_norms \
        else ("attn_output.weight", "ffn_down.weight")
    w = {name: t * BLOCK_SHARE if name.endswith(scaled) else t for name, t in weights.items()}
    if "output.weight" in w:
        embd = w["token_embd.weight"]
        unit = embd / embd.norm(dim=1, keepdim=True)
        perm = torch.randperm(cfg.vocab_size, generator=g)
        w["output.weight"] = w["output.weight"] + NEXT_TOKEN_WEIGHT * unit[perm]
    return w


def write_gguf(path: str | Path, cfg: ModelConfig, weights: dict[str, torch.Tensor],
               qtype: int | Callable[[str], int] = 0, vocab=None,
               chat_template: str | None = None, split_tensors: int = 0) -> Path:
    """Write a GGUF file the way llama.cpp's converter lays it out. qtype 0 is F32.

    `vocab`: a byte-level BPE vocabulary (tests/synthetic_vocab.py's ByteLevelVocab,
    cfg.vocab_size its length) instead of the tiny SentencePiece one; `chat_template`: tokenizer.chat_template.
    `split_tensors` > 0 splits the file into parts of at most that many tensors, named as
    llama.cpp's gguf-split names them; the path returned is then the first part's.

    2-D matrices are stored as `qtype`, or as `qtype(name)` for a mix such as Q4_K_M's
    (norms stay F32); LLaMA q/k rows are permuted so RoPE rotates adjacent pairs, as in
    llama.cpp's LLaMA files.
    """
    import gguf

    from ..llama import permute_for_gguf

    path = Path(path)
    arch = cfg.architecture
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_tensors)
    writer.add_name(cfg.name)
    a = arch + "."
    writer.add_uint32(a + "context_length", cfg.context_length)
    writer.add_uint32(a + "embedding_length", cfg.hidden_size)
    writer.add_uint32(a + "block_count", cfg.n_layers)
    writer.add_uint32(a + "feed_forward_length", cfg.ffn_size)
    writer.add_uint32(a + "attention.head_count", cfg.n_heads)
    writer.add_uint32(a + "attention.head_count_kv", cfg.n_kv_heads)
    writer.add_uint32(a + "attention.key_length", cfg.head_dim)
    writer.add_uint32(a + "attention.value_length", cfg.head_dim)
    writer.add_float32(a + "attention.layer_norm_rms_epsilon", cfg.rms_eps)
    writer.add_float32(a + "rope.freq_base", cfg.rope_base)
    writer.add_uint32(a + "rope.dimension_count", cfg.head_dim)
    windows = [x for x in cfg.sliding_window if x]
    if windows:
        writer.add_uint32(a + "attention.sliding_window", windows[0])
    if cfg.attn_softcap:
        writer.add_float32(a + "attn_logit_softcapping", cfg.attn_softcap)
    if cfg.final_logit_softcap:
        writer.add_float32(a + "final_logit_softcapping", cfg.final_logit_softcap)
    if arch == "llama":
        writer.add_string(a + "ffn_activation", cfg.activation)
    if vocab is None:
        _add_vocab(writer)
    else:
        vocab.write(writer)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    weights = dict(weights)
    weights.update(_rope_tensors(cfg))
    if cfg.rope_factors_long:
        writer.add_rope_scaling_attn_factors(cfg.rope_attn_factor)
        writer.add_rope_scaling_orig_ctx_len(cfg.rope_original_context)
    if arch == "phi3":
        weights = _fuse_phi3(cfg, weights)
    for name, tensor in weights.items():
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.n_heads if name.endswith("attn_q.weight") else cfg.n_kv_heads
            tensor = permute_for_gguf(tensor, heads)
        t = (qtype(name) if callable(qtype) else qtype) if tensor.dim() == 2 else 0
        raw = quantize(tensor.float(), t).numpy()
        byte_shape = (*tensor.shape[:-1], raw.size // max(1, math.prod(tensor.shape[:-1])))
        # uint8 rows of packed blocks; the writer derives the element shape from the type.
        writer.add_tensor(name, raw.reshape(byte_shape), raw_dtype=gguf.GGMLQuantizationType(t))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(path)[0]


def _rope_tensors(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Llama 3.1's one F32 divisor per frequency, or Phi-3's LongRoPE pair of them."""
    def f32(values):
        return torch.tensor(values, dtype=torch.float32)

    if cfg.rope_factors_long:
        return {"rope_factors_long.weight": f32(cfg.rope_factors_long),
                "rope_factors_short.weight": f32(cfg.rope_factors)}
    return {"rope_freqs.weight": f32(cfg.rope_factors)} if cfg.rope_factors else {}


def _fuse_phi3(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Phi-3's fused layout: `attn_qkv` (q, k, v rows) and `ffn_up` (gate rows, then up)."""
    out = {}
    for name, tensor in weights.items():
        if name.endswith(("attn_k.weight", "attn_v.weight", "ffn_gate.weight")):
            continue
        p = name[:name.index(".", 4) + 1] if name.startswith("blk.") else ""
        if name.endswith("attn_q.weight"):
            name = p + "attn_qkv.weight"
            tensor = torch.cat([weights[p + f"attn_{x}.weight"] for x in "qkv"])
        elif name.endswith("ffn_up.weight"):
            tensor = torch.cat([weights[p + "ffn_gate.weight"], tensor])
        out[name] = tensor
    return out


def _add_vocab(writer) -> None:
    tokens, scores, types = tiny_vocab()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(CONTROL.index("<bos>"))
    writer.add_eos_token_id(CONTROL.index("<eos>"))
    writer.add_unk_token_id(CONTROL.index("<unk>"))
    writer.add_pad_token_id(CONTROL.index("<pad>"))
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)


_HF_TYPES = {"gemma3": "gemma3_text", "llama": "llama", "gemma2": "gemma2", "phi3": "phi3",
             "qwen2": "qwen2", "qwen3": "qwen3"}
_GEMMA = ("gemma2", "gemma3")


def write_hf(folder: str | Path, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> Path:
    """Write config.json, model.safetensors and tokenizer.json (Hugging Face layout)."""
    from safetensors.torch import save_file

    from .. import registry
    from ..gguf_vocab import VocabSpec
    from ..tokenizer import Tokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    family = registry.family_for_hf(_HF_TYPES[cfg.architecture], folder)
    if cfg.architecture == "phi3":  # qkv_proj and gate_up_proj, as Phi-3 checkpoints have them
        weights = _fuse_phi3(cfg, weights)
    hf_names = {}
    for hf_name in _hf_candidate_names(cfg):
        canonical = family.hf_tensor_name(hf_name)
        if canonical in weights:
            hf_names[canonical] = hf_name
    tensors = {}
    for name, tensor in weights.items():
        if cfg.architecture in _GEMMA and name.endswith("norm.weight"):
            tensor = tensor - 1.0  # HF Gemma stores w, the model multiplies by 1 + w
        tensors[hf_names[name]] = tensor.contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(_hf_config(cfg), indent=2))
    tokens, scores, types = tiny_vocab()
    spec = VocabSpec(tokens=tokens, scores=scores, token_types=types, model="llama", merges=None,
                     pre=None, bos_id=2, eos_id=1, unk_id=3, pad_id=0, add_bos=True,
                     add_space_prefix=False)
    Tokenizer.from_vocab(spec).save_tokenizer_json(folder / "tokenizer.json")
    return folder


def _hf_candidate_names(cfg: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    per_layer = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                 # Phi-3's fused projections (after up_proj: they win where both map)
                 "self_attn.qkv_proj", "mlp.gate_up_proj"]
    for i in range(cfg.n_layers):
        names += [f"model.layers.{i}.{n}.weight" for n in per_layer]
        names += [f"model.layers.{i}.self_attn.{x}_proj.bias" for x in "qkv"]
    return names


def _hf_config(cfg: ModelConfig) -> dict:
    c = {
        "model_type": _HF_TYPES[cfg.architecture],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.context_length,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_base,
        "tie_word_embeddings": cfg.tied_embeddings,
    }
    windows = [x for x in cfg.sliding_window if x]
    if cfg.architecture == "gemma3":
        c.update(rope_local_base_freq=cfg.local_rope_base, sliding_window=windows[0],
                 query_pre_attn_scalar=cfg.scale ** -2, hidden_activation="gelu_pytorch_tanh")
    elif cfg.architecture == "gemma2":
        c.update(sliding_window=windows[0], query_pre_attn_scalar=cfg.scale ** -2,
                 attn_logit_softcapping=cfg.attn_softcap,
                 final_logit_softcapping=cfg.final_logit_softcap,
                 hidden_activation="gelu_pytorch_tanh")
    elif cfg.architecture != "llama":
        c.update(hidden_act="silu")
    else:
        c.update(hidden_act={"silu_glu": "silu"}.get(cfg.activation, "relu"),
                 ffn_activation=cfg.activation)
    if cfg.rope_factors_long:
        c["original_max_position_embeddings"] = cfg.rope_original_context
        c["rope_scaling"] = {"type": "longrope", "long_factor": list(cfg.rope_factors_long),
                             "short_factor": list(cfg.rope_factors)}
    elif cfg.rope_factors:  # the tiny Llama 3's (FAMILY_CONFIGS): config.json's form of them
        s = LLAMA3_SCALING
        c["rope_scaling"] = {"rope_type": "llama3", "factor": s["factor"],
                             "low_freq_factor": s["low_freq_factor"],
                             "high_freq_factor": s["high_freq_factor"],
                             "original_max_position_embeddings": s["original_context"]}
    return c
