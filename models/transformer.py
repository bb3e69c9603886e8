"""The decoder shared by every supported family, batch-1, fp32.

Gemma 3 and the LLaMA family differ only in switches of `ModelConfig` (q/k norms, sandwich
norms, embedding scale, sliding-window layers, FFN activation), so one readable implementation
serves both. Tensors carry no batch dimension: hidden states are (T, hidden).

Weights are read by canonical GGUF names from a `WeightStore` and dequantized to float32 here;
the hybrid engine may replace `FeedForward` modules with split ones. Every op is PyTorch, on
whatever device the model is moved to: this is the reference the CPU runtime
(offload/body/file_blocks_model.py) is tested against, and the forward a CUDA device runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .activations import activate
from .config import ModelConfig
from .reference_cache import ContiguousKVCache, KVCache
from .rotary import Rotary, layer_rotaries
from .tree_rows import TreeRows, tree_keys, tree_span
from .weights import QTensor, WeightStore


def _attach(module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    """Weights are non-persistent buffers: `Module.to(device)` moves them, autograd ignores them."""
    module.register_buffer(name, tensor, persistent=False)


def _matrix(w: WeightStore, name: str, out_features: int, in_features: int) -> torch.Tensor:
    """A projection stored (in, out) so `x @ weight` applies it.

    Files store (out, in). Measured on 2-core CPUs here, batch-1 `x @ W_t` with W_t contiguous
    reads memory ~25-40% faster than `F.linear(x, W)` over the (out, in) layout.
    """
    return w.load(name, (out_features, in_features)).t().contiguous()


class Projection(nn.Module):
    """x (T, in) -> (T, out): the float32 reference, `x @ weight` with weight stored (in, out)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        _attach(self, "weight", weight)
        _attach(self, "bias", bias)  # (out,) or None: Qwen 2's q/k/v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight
        return y if self.bias is None else y + self.bias


def _projection(w: WeightStore, name: str, out_features: int, in_features: int,
                bias: bool = False) -> Projection:
    b = w.load(name.replace(".weight", ".bias"), (out_features,)) if bias else None
    return Projection(_matrix(w, name, out_features, in_features), b)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # In place on the (T, 1) statistic: two fewer allocations per call, same values.
    return x * x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_() * weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, w: WeightStore, rotary: Rotary):
        super().__init__()
        p, hd, h = f"blk.{layer}.", cfg.head_dim, cfg.hidden_size
        self.cfg, self.layer, self.rotary = cfg, layer, rotary
        self.window = cfg.window(layer)
        self.wq = _projection(w, p + "attn_q.weight", cfg.n_heads * hd, h, cfg.qkv_bias)
        self.wk = _projection(w, p + "attn_k.weight", cfg.n_kv_heads * hd, h, cfg.qkv_bias)
        self.wv = _projection(w, p + "attn_v.weight", cfg.n_kv_heads * hd, h, cfg.qkv_bias)
        self.wo = _projection(w, p + "attn_output.weight", h, cfg.n_heads * hd)
        if cfg.qk_norm:
            _attach(self, "q_norm", w.load(p + "attn_q_norm.weight", (hd,)))
            _attach(self, "k_norm", w.load(p + "attn_k_norm.weight", (hd,)))

    def forward(self, x: torch.Tensor, start: int, cache: KVCache,
                tree: TreeRows | None = None) -> torch.Tensor:
        cfg = self.cfg
        q, k, v = self.project(x)
        if cfg.qk_norm:
            q, k = rms_norm(q, self.q_norm, cfg.rms_eps), rms_norm(k, self.k_norm, cfg.rms_eps)
        q, k = self.rotary.apply(q, k, start if tree is None else tree.positions)
        return self.wo(self.attend_rotated(q, k, v, start, cache, tree))

    def project(self, x: torch.Tensor):
        """x (T, hidden) -> q (T, n_heads, hd), k and v (T, n_kv_heads, hd)."""
        cfg, T = self.cfg, x.shape[0]
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        return (q.view(T, cfg.n_heads, cfg.head_dim), k.view(T, cfg.n_kv_heads, cfg.head_dim),
                v.view(T, cfg.n_kv_heads, cfg.head_dim))

    def attend_rotated(self, q, k, v, start: int, cache: KVCache,
                       tree: TreeRows | None = None) -> torch.Tensor:
        """Store k/v in the cache and attend: q (T, n_heads, hd) and k already normed and
        rotated. Returns (T, n_heads * hd), before the output projection."""
        if tree is not None:
            return self._attend_tree(q, k, v, cache, tree)
        T = q.shape[0]
        cache.write(self.layer, start, k, v)
        # Keys a sliding-window layer can still see: the window before the first query.
        lo = 0 if self.window is None else max(0, start - self.window + 1)
        keys, values = cache.read(self.layer, lo, start + T)
        if T == 1:  # one query sees every key it is given: no positions, no mask
            return attend(q, keys, values, None, None, self.window, self.cfg.scale,
                          self.cfg.attn_softcap)
        return attend(q, keys, values, torch.arange(start, start + T), torch.arange(lo, start + T),
                      self.window, self.cfg.scale, self.cfg.attn_softcap)

    def _attend_tree(self, q, k, v, cache: KVCache, tree: TreeRows) -> torch.Tensor:
        """Tree rows see the context (within the window) and the tree keys their mask allows.

        Each row is attended on its own, given exactly the keys it sees, in position order:
        the same shapes and values plain decoding has at that position, so the result is the
        same bit for bit however many rows are verified together (attention is a small part
        of a step; the projections are where rows are batched).
        """
        cache.write(self.layer, tree.context + tree.first, k, v)
        lo, end = tree_span(tree, self.window)
        ctx_k, ctx_v = cache.read(self.layer, lo, tree.context)
        tree_k, tree_v = cache.read(self.layer, tree.context, end)
        outs = []
        for r, (first, sel) in enumerate(tree_keys(tree, self.window, lo)):
            sel = sel.to(tree_k.device)
            keys = torch.cat((ctx_k[first - lo:], tree_k[sel]))
            values = torch.cat((ctx_v[first - lo:], tree_v[sel]))
            outs.append(attend(q[r: r + 1], keys, values, None, None, self.window,
                               self.cfg.scale, self.cfg.attn_softcap))
        return torch.cat(outs)


def attend(q, k, v, q_pos, k_pos, window: int | None, scale: float,
           softcap: float | None = None) -> torch.Tensor:
    """Causal (optionally sliding-window) attention with grouped K/V heads.

    q (T, n_heads, hd); k, v (S, n_kv, hd); q_pos (T,), k_pos (S,) -> (T, n_heads * hd).
    A key is visible when k_pos <= q_pos and, for windowed layers, q_pos - k_pos < window.
    With a single query the caller must pass only visible keys (decode always does).
    `softcap` (Gemma 2): scaled scores s become softcap * tanh(s / softcap) before softmax.
    """
    T, n_heads, hd = q.shape
    mask = None
    if T > 1:  # one query sees every key it is given (callers pass only visible ones)
        mask = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            mask &= (q_pos[:, None] - k_pos[None, :]) < window
        mask = mask.to(q.device)
    if softcap:
        return _attend_capped(q, k, v, mask, scale, softcap)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=True,
    )  # (1, n_heads, T, hd)
    return out[0].transpose(0, 1).reshape(T, n_heads * hd)


def _attend_capped(q, k, v, mask, scale: float, cap: float) -> torch.Tensor:
    """`attend` with soft-capped scores, written out (scaled_dot_product_attention has no
    hook between the scores and the softmax). mask (T, S) or None."""
    T, n_heads, hd = q.shape
    group = n_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # (n_heads, S, hd)
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * scale  # (n_heads, T, S)
    scores = torch.tanh(scores / cap) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # (n_heads, T, hd)
    return out.transpose(0, 1).reshape(T, n_heads * hd)


class FeedForward(nn.Module):
    """down(act(gate x, up x)); gate is absent for plain MLP activations."""

    def __init__(self, cfg: ModelConfig, layer: int, w: WeightStore):
        super().__init__()
        p, h, f = f"blk.{layer}.", cfg.hidden_size, cfg.ffn_size
        self.activation = cfg.activation
        _attach(self, "gate", _matrix(w, p + "ffn_gate.weight", f, h) if cfg.gated else None)
        _attach(self, "up", _matrix(w, p + "ffn_up.weight", f, h))
        _attach(self, "down", _matrix(w, p + "ffn_down.weight", h, f))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = x @ self.gate if self.gate is not None else None
        return activate(self.activation, gate, x @ self.up) @ self.down


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, w: WeightStore, rotary: Rotary):
        super().__init__()
        p, h = f"blk.{layer}.", cfg.hidden_size
        self.cfg = cfg
        _attach(self, "attn_norm", w.load(p + "attn_norm.weight", (h,)))
        self.attn = Attention(cfg, layer, w, rotary)
        _attach(self, "ffn_norm", w.load(p + "ffn_norm.weight", (h,)))
        self.ffn = FeedForward(cfg, layer, w)
        if cfg.sandwich_norms:
            _attach(self, "post_attn_norm", w.load(p + "post_attention_norm.weight", (h,)))
            _attach(self, "post_ffn_norm", w.load(p + "post_ffw_norm.weight", (h,)))

    def forward(self, x: torch.Tensor, start: int, cache: KVCache,
                tree: TreeRows | None = None) -> torch.Tensor:
        eps = self.cfg.rms_eps
        a = self.attn(rms_norm(x, self.attn_norm, eps), start, cache, tree)
        if self.cfg.sandwich_norms:
            a = rms_norm(a, self.post_attn_norm, eps)
        x = x + a
        f = self.ffn(rms_norm(x, self.ffn_norm, eps))
        if self.cfg.sandwich_norms:
            f = rms_norm(f, self.post_ffn_norm, eps)
        return x + f


class LMHead(nn.Module):
    """hidden (T, H) -> logits (T, vocab), float32 reference.

    The float weight (H, vocab) is made on first use rather than at load (671 MB on the
    default model): only what scores tokens with the float model pays for it.
    """

    def __init__(self, stored: QTensor, softcap: float | None):
        super().__init__()
        self.stored, self.softcap = stored, softcap
        _attach(self, "weight", None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            self.weight = self.stored.dequantize().t().contiguous().to(hidden.device)
        return softcap(hidden @ self.weight, self.softcap)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return torch.tanh(logits / cap) * cap if cap else logits


class Transformer(nn.Module):
    """Token ids -> hidden states -> logits, with a KV cache. Inference only."""

    # Whether a T-row pass gives each row the bits a one-row pass gives (what verifying a
    # speculative tree's rows in one pass needs): not here. A T-row float32 matmul may round
    # differently from a one-row one (MKL's GEMM for T >= 4 rows vs its GEMV), which can flip
    # a near-tie greedy token, so the runner verifies this model's tree rows one at a time.
    batch_invariant = False
    head_batch_invariant = False  # its float32 head, likewise

    def __init__(self, cfg: ModelConfig, w: WeightStore, on_layer=None):
        """`on_layer(i)`, if given, is called after block i is built (loading progress)."""
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        # Embedding rows are dequantized per token from the file's own blocks (host memory),
        # so a tied model keeps at most one float copy of the big matrix: the LM head's.
        self.embedding = w.get("token_embd.weight", (cfg.vocab_size, h))
        head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        self.head = LMHead(w.get(head, (cfg.vocab_size, h)), cfg.final_logit_softcap)
        _attach(self, "output_norm", w.load("output_norm.weight", (h,)))
        rotaries = layer_rotaries(cfg)
        self.blocks = nn.ModuleList()
        for i in range(cfg.n_layers):
            self.blocks.append(Block(cfg, i, w, rotaries[i]))
            if on_layer is not None:
                on_layer(i)

    def use_context(self, n_ctx: int) -> None:
        """Rotate for a context of `n_ctx` tokens from now on (LongRoPE's factor set follows
        it; built, a model rotates as for a context within the original one)."""
        for block, rotary in zip(self.blocks, layer_rotaries(self.cfg, n_ctx)):
            block.attn.rotary = rotary

    @property
    def device(self) -> torch.device:
        return self.output_norm.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(T,) ids -> (T, hidden) scaled embeddings, on the model's device."""
        rows = self.embedding.dequantize_rows(ids.cpu())
        return (rows * self.cfg.embed_scale).to(self.device)

    def new_cache(self, max_len: int) -> ContiguousKVCache:
        return ContiguousKVCache(self.cfg, max_len, device=self.device)

    @torch.inference_mode()
    def hidden(self, ids: torch.Tensor, cache: KVCache, tree: TreeRows | None = None) -> torch.Tensor:
        """Run ids (T,) at positions cache.length.. ; commits them to the cache.

        With `tree`, the rows are token-tree nodes placed as it says; the caller has reserved
        their slots and commits (or truncates) them itself.
        Returns the final-normed hidden states (T, hidden).
        """
        start = cache.length
        if tree is None:
            cache.reserve(ids.shape[0])
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, start, cache, tree)
        if tree is None:
            cache.commit(ids.shape[0])
        return rms_norm(x, self.output_norm, self.cfg.rms_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(T, hidden) -> (T, vocab) float32."""
        return self.head(hidden)

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: every block's projections and FFN as they
        run now (a split FFN's own tensors) and the float32 LM head. Norms and the embedding
        row are left out (under 0.1%)."""
        total = self.cfg.vocab_size * self.cfg.hidden_size * 4
        for block in self.blocks:
            for module in (block.attn.wq, block.attn.wk, block.attn.wv, block.attn.wo, block.ffn):
                total += sum(b.numel() * b.element_size() for b in module.buffers())
        return total

    def forward(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits of the last position only (1, vocab): what decoding needs."""
        return self.logits(self.hidden(ids, cache)[-1:])
