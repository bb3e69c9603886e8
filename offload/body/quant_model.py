"""The model an engine runs on the CPU: every weight read where the file keeps it, in its blocks.

Built per engine from the opened file (`ModelSource`), so two engines on one file never share
mutable state. Nothing is dequantized or requantized at load: projections are `QTensor` views
of the file's bytes (its memory map, or their copy in RAM: `--mmap`), multiplied by
`kernels.block_matmul` (activations quantized per block, integer dot products), so a 4-bit
file is held and read at ~4.5 bits a weight. The
one exception is a tensor of a type without a native kernel (Q2_K, Q3_K, IQ*...): it is
requantized to Q8_0 once, reported by `derived` and logged.

A decoded token, a prompt chunk and a speculative tree's rows all go through one call per pass
(`kernels.decoder_step`), unless an engine split the FFNs (hot rows on the GPU tier, cold ones
for the sparse kernel, sliced from these blocks: `use_ffns`); the float32 `Transformer`
(models/transformer.py) is the reference this is tested against. Same interface as it where
the runner needs one: `hidden`, `logits`, `embed`, `new_cache`, `cfg`, `device`.
"""

from __future__ import annotations

import logging

import torch

from ember.kernels import block_matmul as bm
from ember.kernels import decoder_step, q8_matmul
from ember.kernels.fused_ops import residual_norm, residual_norm_reference, rms_norm
from ember.kernels.attention import kv_row_values
from ember.kernels.tier_attention import AttendRows, TierAttentionWeights, tier_attention
from ember.models.config import ModelConfig
from ember.models.kv import ContiguousKVCache, KVCache
from ember.models.loader import ModelSource
from ember.models.quants import type_name
from ember.models.rotary import layer_rotaries
from ember.models.transformer import softcap
from ember.models.tree_rows import TreeRows, tree_positions
from ember.models.weights import QTensor, WeightStore

from .ffn_rows import FileFFNRows

log = logging.getLogger("ember.runtime")

CPU = torch.device("cpu")


def applies() -> bool:
    """The file-blocks runtime needs the C++ kernels (a compiler at first use)."""
    return bm.available() and decoder_step.available()


def runs_on_file_blocks(options, device: torch.device) -> bool:
    """Whether an engine with `options` (EngineOptions) runs on the file's own blocks: the
    default (`--weights auto`) on the CPU, or on a CUDA device with a GPU-tier budget
    (attention and the cold FFN rows on the blocks in host RAM, the hot rows on the GPU in
    their tier formats), once the kernels are built. `--weights fp32` asks for the float32
    reference."""
    tier = device.type == "cpu" or (device.type == "cuda" and options.gpu_budget is not None)
    return options.weights == "auto" and tier and applies()


# K and V in half precision on this runtime (its attention converts them on load): half the
# bytes a long context reads and holds, as llama.cpp's default f16 cache. The float32
# reference keeps float32. `--kv-type q8_0`: uint8 pools of Q8_0 blocks (kernels.attention).
KV_DTYPE = torch.float16
KV_TYPE_DTYPES = {"f16": KV_DTYPE, "q8_0": torch.uint8}


def kv_dtype(options=None, device: torch.device = CPU) -> torch.dtype:
    """K/V element type of an engine with `options` (EngineOptions; None: the defaults) on
    `device`: its --kv-type's where it runs on the file's blocks, float32 otherwise."""
    if options is None:
        blocks = device.type == "cpu" and applies()
    else:
        blocks = runs_on_file_blocks(options, device)
    kv_type = "f16" if options is None else options.kv_type
    return KV_TYPE_DTYPES[kv_type] if blocks else torch.float32


def kv_value_bytes(dtype: torch.dtype) -> float:
    """Bytes a K or V value takes in pools of `dtype` (Q8_0: 34 bytes per 32 values)."""
    return 34 / 32 if dtype == torch.uint8 else dtype.itemsize


def readable(w: WeightStore, name: str, shape: tuple[int, int], derived: dict[str, int]) -> QTensor:
    """Tensor `name` itself when the kernel reads its type; else a Q8_0 copy (or float32 when
    its rows are not whole Q8_0 blocks), recorded in `derived` (name -> bytes). A type Ember
    cannot decode at all is an error naming the file and tensor."""
    t = w.get(name, shape)
    if bm.supports(t.qtype):
        return t
    values = w.load(name, shape)
    if values.shape[-1] % q8_matmul.QUANT_BLOCK == 0:
        rows = q8_matmul.q8_0_quantize(values)
        copy = QTensor(rows.reshape(-1), q8_matmul.Q8_0, t.shape)
    else:
        copy = QTensor.from_torch(values)
    derived[name] = copy.nbytes
    return copy


class BlockLMHead:
    """hidden (T, H) -> logits (T, vocab) from the output matrix's own blocks."""

    def __init__(self, stored: QTensor, cap: float | None):
        self.stored, self.cap = stored, cap

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap(bm.block_matmul(hidden.float().contiguous(), [self.stored]), self.cap)

    def scores(self, hidden: torch.Tensor, rows: QTensor) -> torch.Tensor:
        """Logits over a subset of the vocabulary (`rows`, from `stored.select_rows`)."""
        if rows.shape[0] == 0:
            return hidden.new_empty(hidden.shape[0], 0)
        return softcap(bm.block_matmul(hidden.float().contiguous(), [rows]), self.cap)


class QuantModel:
    def __init__(self, source: ModelSource, kv_dtype: torch.dtype = KV_DTYPE):
        cfg, w = source.config, source.weights
        self.cfg, self.device = cfg, CPU
        # Every op is row by row in a fixed order: a row's result does not depend on how
        # many rows share the pass, so speculative tree rows can be verified in one pass.
        # (Not so once the FFNs are split: see `use_ffns`.)
        self.batch_invariant = True
        self.ffns: list | None = None  # per layer FFN modules replacing the blocks' own
        # Per layer attention on the GPU tier (`use_tier_attention`), None: on the blocks here
        self.tier: list[TierAttentionWeights] | None = None
        self.attention_device = CPU  # where attention runs and its K/V live
        self.kv_dtype = kv_dtype  # what its caches hold (new_cache; the engine's paged cache)
        self._file = w  # the file's tensors, for the tier's copies of attention
        self.derived: dict[str, int] = {}  # tensors requantized at load: name -> bytes
        h = cfg.hidden_size
        self.embedding = w.get("token_embd.weight", (cfg.vocab_size, h))
        head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        self.head = BlockLMHead(readable(w, head, (cfg.vocab_size, h), self.derived),
                                cfg.final_logit_softcap)
        self.output_norm = w.load("output_norm.weight", (h,))
        self.rotary = layer_rotaries(cfg)
        self.windows = [cfg.window(i) for i in range(cfg.n_layers)]
        self.layers = [self._layer(w, i) for i in range(cfg.n_layers)]
        self._run = decoder_step.decoder_step(self.layers)
        if self.derived:
            kinds = sorted({type_name(w.get(n).qtype) for n in self.derived})
            log.warning("ember: %s tensors are not read natively; %d of them were requantized "
                        "to Q8_0 at load (%.1f MB)", "/".join(kinds), len(self.derived),
                        sum(self.derived.values()) / 1e6)

    def use_context(self, n_ctx: int) -> None:
        """Rotate for a context of `n_ctx` tokens (see Transformer.use_context)."""
        self.rotary = layer_rotaries(self.cfg, n_ctx)

    def ffn_rows(self) -> list[FileFFNRows]:
        """Each layer's FFN in the file's blocks, as a hybrid split reads its rows."""
        return [FileFFNRows(layer.gate_up, layer.down, layer.activation) for layer in self.layers]

    def use_ffns(self, ffns: list) -> None:
        """From now on each layer's FFN is `ffns[i]` (h (T, hidden) -> (T, hidden): a
        HybridFFN, hot rows on the GPU tier and cold rows on the host): attention still runs
        on the file's blocks, one C++ call per layer, and the FFN in between. Called once, by
        the engine that built this model, before it runs.

        The hybrid FFN is not batch-invariant (its hot side is a float matmul, and a T-row
        pass computes every cold neuron where one row computes the predicted ones), so
        speculative tree rows then go through one at a time, each exactly as decoded."""
        if len(ffns) != len(self.layers):
            raise ValueError(f"{len(ffns)} FFNs for {len(self.layers)} layers")
        self.ffns = list(ffns)
        self.batch_invariant = False
        self._attention = decoder_step.layer_attention(self.layers)

    def use_tier_attention(self, device: torch.device,
                           dtype: torch.dtype) -> list[TierAttentionWeights]:
        """From now on attention runs on `device` (the GPU tier) from copies of each layer's
        attention weights in `dtype`, each made once from the file's values (their conversion
        error measured), and its K/V pools are there in `dtype` too; the FFN between runs
        where `use_ffns` put it (called first). Embedding, final norm and LM head stay on the
        file's blocks here: the pass returns to the host once, at its end."""
        if self.ffns is None:
            raise ValueError("attention moves to the tier of a split model: call use_ffns first")
        self.tier = [self._tier_layer(i, layer, device, dtype)
                     for i, layer in enumerate(self.layers)]
        self.attention_device, self.kv_dtype = torch.device(device), dtype
        return self.tier

    def _tier_layer(self, i: int, layer: decoder_step.DecoderLayer, device: torch.device,
                    dtype: torch.dtype) -> TierAttentionWeights:
        cfg, p, L = self.cfg, f"blk.{i}.", layer

        def values(name: str, t: QTensor) -> torch.Tensor:  # the file's own values
            return self._file.load(p + name, tuple(t.shape))

        qkv = torch.cat([values(f"attn_{n}.weight", t) for n, t in zip("qkv", L.qkv)])
        norms = {"attn_norm": L.attn_norm, "ffn_norm": L.ffn_norm, "qkv_bias": L.qkv_bias,
                 "post_attn_norm": L.post_attn_norm, "post_ffn_norm": L.post_ffn_norm,
                 "q_norm": L.q_norm, "k_norm": L.k_norm}
        return TierAttentionWeights.pack(qkv, values("attn_output.weight", L.wo), norms,
                                         L.n_heads, L.n_kv, L.head_dim, L.interleaved, L.eps,
                                         L.scale, L.attn_softcap, device, dtype)

    def native_step(self):
        """The C++ DecoderStep that runs every pass (offload/body/input_sparsity.py thresholds its
        matmuls); ValueError when the FFNs are split or the step is the Python reference."""
        step = getattr(self._run, "__self__", None)
        if self.ffns is not None or step is None or not hasattr(step, "set_input_sparse"):
            raise ValueError("input thresholds need the C++ decoder step on an unsplit model")
        return step

    def _layer(self, w: WeightStore, i: int) -> decoder_step.DecoderLayer:
        cfg, p, h, hd = self.cfg, f"blk.{i}.", self.cfg.hidden_size, self.cfg.head_dim

        def matrix(name: str, out_features: int, in_features: int) -> QTensor:
            return readable(w, p + name, (out_features, in_features), self.derived)

        def norm(name: str, n: int) -> torch.Tensor:  # (also the 1-D biases)
            return w.load(p + name, (n,))

        f, kv = cfg.ffn_size, cfg.n_kv_heads * hd
        bias = None
        if cfg.qkv_bias:  # one vector for the q, k and v outputs side by side
            bias = torch.cat([norm("attn_q.bias", cfg.n_heads * hd), norm("attn_k.bias", kv),
                              norm("attn_v.bias", kv)])
        gate_up = [matrix("ffn_gate.weight", f, h)] if cfg.gated else []
        gate_up.append(matrix("ffn_up.weight", f, h))
        return decoder_step.DecoderLayer(
            attn_norm=norm("attn_norm.weight", h),
            qkv=[matrix("attn_q.weight", cfg.n_heads * hd, h),
                 matrix("attn_k.weight", cfg.n_kv_heads * hd, h),
                 matrix("attn_v.weight", cfg.n_kv_heads * hd, h)],
            n_heads=cfg.n_heads, n_kv=cfg.n_kv_heads, head_dim=hd,
            q_norm=norm("attn_q_norm.weight", hd) if cfg.qk_norm else None,
            k_norm=norm("attn_k_norm.weight", hd) if cfg.qk_norm else None,
            interleaved=cfg.rope_interleaved,
            wo=matrix("attn_output.weight", h, cfg.n_heads * hd),
            post_attn_norm=norm("post_attention_norm.weight", h) if cfg.sandwich_norms else None,
            ffn_norm=norm("ffn_norm.weight", h),
            gate_up=gate_up, down=matrix("ffn_down.weight", h, f), activation=cfg.activation,
            post_ffn_norm=norm("post_ffw_norm.weight", h) if cfg.sandwich_norms else None,
            eps=cfg.rms_eps, scale=cfg.scale, qkv_bias=bias,
            attn_softcap=cfg.attn_softcap or 0.0)

    # -- the runner's interface ------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(T,) ids -> (T, hidden) scaled embeddings, from the embedding's own blocks."""
        if ids.shape[0] == 1:
            rows = bm.dequantize_row(self.embedding, int(ids[0]))
        else:
            rows = self.embedding.select_rows(ids.cpu()).dequantize()
        return rows * self.cfg.embed_scale

    def new_cache(self, max_len: int) -> ContiguousKVCache:
        return ContiguousKVCache(self.cfg, max_len, device=self.attention_device,
                                 dtype=self.kv_dtype, row_values=kv_row_values(self.kv_dtype,
                                                                               self.cfg.head_dim))

    @torch.inference_mode()
    def hidden(self, ids: torch.Tensor, cache: KVCache, tree: TreeRows | None = None) -> torch.Tensor:
        """Run ids (T,) at positions cache.length.. and commit them to the cache; with `tree`,
        the rows are token-tree nodes placed as it says (the caller reserved their slots and
        commits or truncates them). Returns the final-normed hidden states (T, hidden)."""
        start, T = cache.length, ids.shape[0]
        if tree is None:
            cache.reserve(T)
        if self.tier is not None:
            x = self._tier_pass(self.embed(ids), *cache.pools(),
                                *self._tier_inputs(start, T, cache, tree))
        else:
            slots, cos, sin = self._row_inputs(start, T, cache, tree)
            positions = torch.arange(start, start + T) if tree is None else tree.positions
            run = self._run if self.ffns is None else self._layer_by_layer
            x = run(self.embed(ids), *cache.pools(), slots, positions, cos, sin)
        if tree is None:
            cache.commit(T)
        return rms_norm(x, self.output_norm, self.cfg.rms_eps)

    def _layer_by_layer(self, x, k_pool, v_pool, slots, positions, cos, sin) -> torch.Tensor:
        """The split model's pass: per layer, attention in C++ then the layer's own FFN and
        the residual step (what DecoderStep does after its own FFN)."""
        for i, (layer, ffn) in enumerate(zip(self.layers, self.ffns)):
            mid, h = self._attention(i, x, k_pool, v_pool, slots[i], positions, cos[i], sin[i])
            x = residual_norm(mid, ffn(h).contiguous(), layer.post_ffn_norm, None,
                              layer.eps)[0]
        return x

    def _tier_pass(self, x, k_pool, v_pool, rows, cos, sin) -> torch.Tensor:
        """The pass with attention on the tier: the residual stream moves there once and
        stays (the FFN takes its input there and returns its sum there), back at the end."""
        x = x.to(self.attention_device)
        for i, (w, ffn) in enumerate(zip(self.tier, self.ffns)):
            mid, h = tier_attention(w, x, k_pool, v_pool, rows[i], cos[i], sin[i])
            f = ffn(h).float()
            x = residual_norm_reference(mid, f, w.norm("post_ffn_norm"), None, w.eps)[0]
        return x.to(CPU)

    def _tier_inputs(self, start: int, T: int, cache, tree: TreeRows | None):
        """Per layer the pool rows the pass reads and writes (`AttendRows`) and the rows'
        rotary cos/sin on the tier; layers with one window share a mask, a base its tables."""
        device, rows, cos, sin, made = self.attention_device, [], [], [], {}
        for i, (rotary, window) in enumerate(zip(self.rotary, self.windows)):
            if id(rotary) not in made:
                made[id(rotary)] = rotary.tables(start if tree is None else tree.positions,
                                                 T, device)
            rows.append(self._attend_rows(i, window, start, T, cache, tree, made))
            cos.append(made[id(rotary)][0])
            sin.append(made[id(rotary)][1])
        return rows, cos, sin

    def _attend_rows(self, layer: int, window: int | None, start: int, T: int, cache,
                     tree: TreeRows | None, made: dict) -> AttendRows:
        device = self.attention_device
        if tree is not None:  # each row: the context in its window, then its ancestors
            positions, end = tree_positions(tree, window)
            table = cache.slots_of(layer, 0, end)
            if T == 1:  # exactly its keys, unmasked: the bits decoding that token gives
                keys = table.index_select(0, positions[0].to(table.device))
                return AttendRows(keys, keys[-1:], None)
            if ("tree", window) not in made:
                made["tree", window] = AttendRows.listed_mask(positions, end, device)
            mask, own = made["tree", window]
            return AttendRows(table, table.index_select(0, own), mask)
        lo = 0 if window is None else max(0, start - window + 1)
        if ("causal", window) not in made:
            made["causal", window] = AttendRows.causal_mask(lo, start, T, window, device)
        table = cache.slots_of(layer, lo, start + T)
        return AttendRows(table, table[start - lo:], made["causal", window])

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def _row_inputs(self, start: int, T: int, cache, tree: TreeRows | None):
        """Per layer: the pool slots each row reads (its own last) and the rows' rotary
        cos/sin. Layers sharing a window share positions, and a rotary base its tables."""
        slots, cos, sin, tables = [], [], [], {}
        for i, (rotary, window) in enumerate(zip(self.rotary, self.windows)):
            if id(rotary) not in tables:
                positions = start if tree is None else tree.positions
                tables[id(rotary)] = rotary.tables(positions, T, CPU)
            c, s = tables[id(rotary)]
            cos.append(c)
            sin.append(s)
            slots.append(self._slots(i, window, start, T, cache, tree))
        return slots, cos, sin

    @staticmethod
    def _slots(layer: int, window: int | None, start: int, T: int, cache,
               tree: TreeRows | None) -> list[torch.Tensor]:
        if tree is not None:  # each row: the context in its window, then its ancestors
            positions, end = tree_positions(tree, window)
            table = cache.slots_of(layer, 0, end)
            return [table.index_select(0, pos) for pos in positions]
        # Row t sits at position start + t and sees the keys in its window up to itself.
        first = [0 if window is None else max(0, start + t - window + 1) for t in range(T)]
        lo = first[0]
        table = cache.slots_of(layer, lo, start + T)
        return [table[first[t] - lo: start + t + 1 - lo] for t in range(T)]

    # -- what it costs ---------------------------------------------------------------------
    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: every projection of every layer and the LM
        head, as stored (norms and the embedding row are under 0.1%)."""
        total = self.head.stored.nbytes
        for i, layer in enumerate(self.layers):
            if self.tier is None:
                total += sum(t.nbytes for t in (*layer.qkv, layer.wo))
            else:  # the tier's copies (norms too: under 0.1% of them)
                total += self.tier[i].nbytes()
            if self.ffns is None:
                total += sum(t.nbytes for t in (*layer.gate_up, layer.down))
            else:  # a split layer: both sides in full (a dense step; sparse ones read less)
                total += split_ffn_bytes(self.ffns[i])
        return total


def split_ffn_bytes(ffn) -> int:
    """Bytes a HybridFFN reads for a dense token: its dense twin's (the file's blocks) when
    it runs that, else its hot rows and cold bundles."""
    dense = ffn.dense_fallback()
    if dense is not None:
        return dense.nbytes
    return ffn.gpu_bytes() + ffn.host_bytes()


def file_bytes_per_token(cfg: ModelConfig, weights: WeightStore) -> int:
    """What one decode step must read of the file as it is stored: every layer's projections
    and the LM head (a tied head reads the embedding matrix)."""
    head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    total = weights.get(head).nbytes
    for name in weights.names():
        t = weights.get(name)
        if name.startswith("blk.") and not name.endswith("norm.weight") and len(t.shape) == 2:
            total += t.nbytes
    return total
