"""What `ember info` reports: sizes, quant types, bytes by part, memory needed."""

from __future__ import annotations

from collections import Counter

from .loader import ModelSource


def part_of(name: str) -> str:
    if name == "token_embd.weight":
        return "embeddings"
    if name == "output.weight":
        return "lm_head"
    if ".attn_" in name and not name.endswith("norm.weight"):
        return "attention"
    if ".ffn_" in name and not name.endswith("norm.weight"):
        return "ffn"
    return "norms"


def _rope_scaling(cfg) -> str | None:
    if cfg.rope_factors_long:
        return (f"LongRoPE past {cfg.rope_original_context} tokens (factors "
                f"{min(cfg.rope_factors_long):g}..{max(cfg.rope_factors_long):g}, within: "
                f"{min(cfg.rope_factors):g}..{max(cfg.rope_factors):g}), "
                f"attention x{cfg.rope_attn_factor:.4g}")
    if cfg.rope_factors:
        return f"per-frequency factors {min(cfg.rope_factors):g}..{max(cfg.rope_factors):g}"
    return f"linear x{cfg.rope_scale:g}" if cfg.rope_scale != 1.0 else None


# Bytes per K or V value of the file-blocks runtime's cache by --kv-type (Q8_0: 34 per 32).
KV_VALUE_BYTES = {"f16": 2, "q8_0": 34 / 32, "bf16": 2}


def summarize(src: ModelSource, n_ctx: int, kv_type: str = "f16") -> dict:
    cfg, w = src.config, src.weights
    stored = Counter()
    elements = 0
    quant_types = Counter()
    for name in w.names():
        t = w.get(name)
        stored[part_of(name)] += t.nbytes
        quant_types[t.qtype_name] += 1
        n = 1
        for d in t.shape:
            n *= d
        elements += n
    n_ctx = min(n_ctx, cfg.context_length)
    kv_values = 2 * cfg.n_layers * n_ctx * cfg.n_kv_heads * cfg.head_dim  # K and V, one context
    return {
        "path": str(src.path),
        "format": src.format,
        "name": cfg.name,
        "architecture": cfg.architecture,
        "activation": cfg.activation,
        "parameters": elements,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "layers": cfg.n_layers,
        "heads": cfg.n_heads,
        "kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "ffn_size": cfg.ffn_size,
        "context_length": cfg.context_length,
        "sliding_window": sorted({x for x in cfg.sliding_window if x}) or None,
        "global_layers": [i for i, x in enumerate(cfg.sliding_window) if x is None] or None,
        "tied_embeddings": cfg.tied_embeddings,
        "rope": {"base": cfg.rope_base, "scaling": _rope_scaling(cfg),
                 "layout": "pairs" if cfg.rope_interleaved else "halves"},
        # What sets the family apart, each None/False when absent.
        "qkv_bias": cfg.qkv_bias,
        "qk_norm": cfg.qk_norm,
        "attn_softcap": cfg.attn_softcap,
        "final_logit_softcap": cfg.final_logit_softcap,
        "quant_types": dict(quant_types),
        # Bytes as stored in the file; a tied LM head reads the embedding matrix.
        "stored_bytes": dict(stored),
        "lm_head_bytes_per_token": stored["embeddings"] if cfg.tied_embeddings else stored["lm_head"],
        "file_bytes": w.total_bytes(),
        # The engine runs on the file's own blocks (mapped, or copied into RAM: the same
        # bytes, see ram_copy.py): the file is what it holds
        # of the weights, and its KV cache is float16 or Q8_0 (--kv-type; one full context
        # here). The float32
        # model (4 bytes a parameter, for `--weights fp32` or a GPU device) keeps a float32
        # KV cache.
        "memory": {
            "weights_bytes": w.total_bytes(),
            "weights_fp32_bytes": elements * 4,
            "kv_type": kv_type,
            "kv_cache_bytes": round(kv_values * KV_VALUE_BYTES[kv_type]),
            "kv_cache_fp32_bytes": kv_values * 4,
            "kv_cache_ctx": n_ctx,
            "total_bytes": w.total_bytes() + round(kv_values * KV_VALUE_BYTES[kv_type]),
            "total_fp32_bytes": elements * 4 + kv_values * 4,
        },
        "fingerprint": src.fingerprint,
        "tokenizer": _tokenizer(src),
    }


def _tokenizer(src: ModelSource) -> dict:
    """How prompts are tokenized and which tokens end a reply."""
    tok = src.tokenizer
    return {"kind": tok.kind,
            "bos": tok.token_text(tok.bos_id) if tok.add_bos and tok.bos_id is not None else None,
            "stop_tokens": [tok.token_text(i) for i in src.stop_ids]}
