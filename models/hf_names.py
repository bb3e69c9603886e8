"""Hugging Face tensor names -> Ember's canonical (GGUF-style) names."""

from __future__ import annotations

import re

# Names every supported family shares. Norm names differ by family (Gemma's
# post_attention_layernorm is a sandwich norm, LLaMA's is the FFN's input norm).
COMMON_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def canonical_name(name: str, layer_names: dict[str, str]) -> str | None:
    """Canonical name for HF tensor `name` given a family's per-layer table; None if unused."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in layer_names:
        return f"blk.{m.group(1)}.{layer_names[m.group(2)]}"
    return None
