"""A deliberately naive forward pass, written independently of `ember.models.transformer`.

Loops over heads and positions, explicit masks, explicit rotary formulas: slow and obvious, so
the real implementation can be checked against it. Weights use canonical names with q/k rows in
Hugging Face order (RoPE rotates the two halves of each head).
"""

from __future__ import annotations

import math

import torch

from ember.models.config import ModelConfig


def _norm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _act(kind, gate, up):
    gelu_tanh = lambda v: 0.5 * v * (1 + torch.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))
    return {
        "gelu_glu": lambda: gelu_tanh(gate) * up,
        "silu_glu": lambda: gate / (1 + torch.exp(-gate)) * up,
        "relu_glu": lambda: gate.clamp(min=0) * up,
        "drelu": lambda: gate.clamp(min=0) * up.clamp(min=0),
        "relu": lambda: up.clamp(min=0),
        "relu2": lambda: up.clamp(min=0) ** 2,
    }[kind]()


def _rope(vec, pos, base, scale):
    half = vec.shape[0] // 2
    out = vec.clone()
    for i in range(half):
        angle = (pos / scale) * base ** (-2 * i / vec.shape[0])
        c, s = math.cos(angle), math.sin(angle)
        out[i] = vec[i] * c - vec[i + half] * s
        out[i + half] = vec[i + half] * c + vec[i] * s
    return out


def reference_logits(cfg: ModelConfig, w: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Logits (T, vocab) for every position of `ids`, float64 throughout."""
    w = {k: v.double() for k, v in w.items()}
    T, hd, eps = len(ids), cfg.head_dim, cfg.rms_eps
    x = w["token_embd.weight"][ids] * cfg.embed_scale
    group = cfg.n_heads // cfg.n_kv_heads
    for layer in range(cfg.n_layers):
        p = f"blk.{layer}."
        window = cfg.sliding_window[layer] if cfg.sliding_window else None
        base = cfg.local_rope_base if (window and cfg.local_rope_base) else cfg.rope_base
        xn = _norm(x, w[p + "attn_norm.weight"], eps)
        heads_out = []
        for h in range(cfg.n_heads):
            kvh = h // group
            wq = w[p + "attn_q.weight"][h * hd:(h + 1) * hd]
            wk = w[p + "attn_k.weight"][kvh * hd:(kvh + 1) * hd]
            wv = w[p + "attn_v.weight"][kvh * hd:(kvh + 1) * hd]
            q, k, v = xn @ wq.T, xn @ wk.T, xn @ wv.T
            if cfg.qk_norm:
                q, k = _norm(q, w[p + "attn_q_norm.weight"], eps), _norm(k, w[p + "attn_k_norm.weight"], eps)
            q = torch.stack([_rope(q[t], t, base, cfg.rope_scale) for t in range(T)])
            k = torch.stack([_rope(k[t], t, base, cfg.rope_scale) for t in range(T)])
            out = torch.zeros(T, hd, dtype=torch.float64)
            for t in range(T):
                visible = [s for s in range(t + 1) if window is None or t - s < window]
                scores = torch.stack([q[t] @ k[s] * cfg.scale for s in visible])
                probs = torch.exp(scores - scores.max())
                probs = probs / probs.sum()
                out[t] = sum(pr * v[s] for pr, s in zip(probs, visible))
            heads_out.append(out)
        a = torch.cat(heads_out, dim=1) @ w[p + "attn_output.weight"].T
        if cfg.sandwich_norms:
            a = _norm(a, w[p + "post_attention_norm.weight"], eps)
        x = x + a
        xn = _norm(x, w[p + "ffn_norm.weight"], eps)
        gate = xn @ w[p + "ffn_gate.weight"].T if cfg.gated else None
        f = _act(cfg.activation, gate, xn @ w[p + "ffn_up.weight"].T) @ w[p + "ffn_down.weight"].T
        if cfg.sandwich_norms:
            f = _norm(f, w[p + "post_ffw_norm.weight"], eps)
        x = x + f
    x = _norm(x, w["output_norm.weight"], eps)
    head = w["token_embd.weight"] if cfg.tied_embeddings else w["output.weight"]
    return x @ head.T
