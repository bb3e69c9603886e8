"""The model an engine runs on the file's own blocks, built once for its placement.

`FileBlocksModel(file, runs, head)` takes the file's layers (`FileLayers`: every weight
where the file keeps it, offload/body/file_layers.py) and, per layer, how it runs
(`LayerRun`, offload/body/layer_runs.py): on the host's blocks in C++, its FFN split into
GPU-tier and host neurons, or with attention on the GPU tier. The pass is chosen here, once:
with no runs given, every layer runs in one C++ call per pass (a decoded token, a prompt
chunk or a speculative tree's rows alike, `kernels.decoder_step`), and the model is
batch-invariant; otherwise the layers run as their runs say, grouped once into segments.
Nothing changes how a built model computes.

Projections are multiplied by `kernels.block_matmul` (activations quantized per block,
integer dot products), so a 4-bit file is held and read at ~4.5 bits a weight. The float32
`Transformer` (models/transformer.py) is the reference this is tested against; both
satisfy the runner's `BodyModel` protocol (offload/body/protocol.py).
"""

from __future__ import annotations

import torch

from ember.kernels import block_matmul as bm
from ember.kernels.attention import kv_row_values
from ember.kernels import decoder_step
from ember.kernels.fused_ops import rms_norm
from ember.models.reference_cache import ContiguousKVCache, KVCache
from ember.models.loader import ModelSource
from ember.models.rotary import layer_rotaries
from ember.models.tree_rows import TreeRows

from .file_layers import BlockLMHead, FileLayers
from .layer_runs import LayerRun, NativeRun, PassRows, segments
from .tier_graph import GraphedTierRuns, graphed_segments

CPU = torch.device("cpu")


def applies() -> bool:
    """The file-blocks runtime needs the C++ kernels (a compiler at first use)."""
    return bm.available() and decoder_step.available()


def runs_on_file_blocks(options, device: torch.device) -> bool:
    """Whether an engine with `options` (EngineOptions) runs on the file's own blocks: the
    default (`--weights auto`) on the CPU, or on a CUDA device with a GPU-tier budget (what
    the plan leaves on the host runs on the blocks in host RAM, the tier holds its share),
    once the kernels are built. `--weights fp32` asks for the float32 reference."""
    tier = device.type == "cpu" or (device.type == "cuda" and options.gpu_budget is not None)
    return options.weights == "auto" and tier and applies()


# K and V in half precision on this runtime (its attention converts them on load): half the
# bytes a long context reads and holds, as llama.cpp's default f16 cache. The float32
# reference keeps float32.
KV_DTYPE = torch.float16


# --kv-type q8_0: Q8_0 blocks as bytes
KV_TYPE_DTYPES = {"f16": KV_DTYPE, "q8_0": torch.uint8, "bf16": torch.bfloat16}


def kv_value_bytes(dtype: torch.dtype) -> float:
    """Bytes a K or V value takes in pools of `dtype` (Q8_0: 34 bytes per 32 values)."""
    return 34 / 32 if dtype == torch.uint8 else dtype.itemsize


def kv_dtype(options=None, device: torch.device = CPU) -> torch.dtype:
    """K/V element type of an engine with `options` (EngineOptions; None: the defaults) on
    `device`: its --kv-type's where it runs on the file's blocks, float32 otherwise."""
    if options is None:
        blocks = device.type == "cpu" and applies()
    else:
        blocks = runs_on_file_blocks(options, device)
    kv_type = "f16" if options is None else options.kv_type
    return KV_TYPE_DTYPES[kv_type] if blocks else torch.float32


class FileBlocksModel:
    """See the module docstring. `runs`: per layer a `LayerRun` (None: every layer whole on
    the host's blocks); `head`: the LM head (None: the file's head matrix in its blocks on
    the host); `kv`: (device, dtype) of the K/V pool the attention reads (None: the host's,
    in KV_DTYPE); `host_kv`: (layers, dtype) of the layers whose attention runs on the host
    beside a device tier, their K/V kept in host RAM in that type (`kv_host_layers`)."""

    def __init__(self, file: FileLayers, runs: list[LayerRun] | None = None, head=None,
                 kv: tuple[torch.device, torch.dtype] | None = None,
                 host_kv: tuple[tuple[int, ...], torch.dtype] | None = None):
        cfg = file.cfg
        self.file, self.cfg, self.device = file, cfg, CPU
        self.layers = file.layers
        self.embedding, self.output_norm = file.embedding, file.output_norm
        self.head = BlockLMHead(file.head, cfg.final_logit_softcap) if head is None else head
        self.derived = file.derived
        self.attention_device, self.kv_dtype = (CPU, KV_DTYPE) if kv is None else kv
        self.kv_host_layers = host_kv if host_kv is not None and host_kv[0] else None
        self.rotary = layer_rotaries(cfg)
        self.windows = [cfg.window(i) for i in range(cfg.n_layers)]
        if runs is not None and len(runs) != len(file.layers):
            raise ValueError(f"{len(runs)} layer runs for {len(file.layers)} layers")
        self.runs = None if runs is None or all(r.whole_native for r in runs) else list(runs)
        # Every op of the one-call pass is row by row in a fixed order: a row's result does
        # not depend on how many rows share the pass, so speculative tree rows can be
        # verified in one pass. Not so with a split FFN (its hot side is a float matmul, and
        # a T-row pass computes every cold neuron where one row computes the predicted ones)
        # or tier attention (a masked SDPA): tree rows then go through one at a time.
        self.batch_invariant = self.runs is None
        # The one-call pass over every layer (`whole.run`), or the segments of a placement
        self.whole = NativeRun(list(range(len(self.layers))), self.layers) \
            if self.runs is None else None
        # (stretches of layers wholly on a CUDA tier decode a token from a CUDA graph)
        self._segments = None if self.runs is None else \
            graphed_segments(segments(self.runs, self.layers))

    @classmethod
    def plain(cls, source: ModelSource) -> "FileBlocksModel":
        """Every layer on the host's file blocks, one C++ call per pass."""
        return cls(FileLayers.read(source))

    def use_context(self, n_ctx: int) -> None:
        """Rotate for a context of `n_ctx` tokens (see Transformer.use_context)."""
        self.rotary = layer_rotaries(self.cfg, n_ctx)

    def native_step(self):
        """The C++ DecoderStep that runs every pass (offload/body/input_sparsity.py thresholds its
        matmuls); ValueError when layers are placed otherwise or the step is the Python
        reference."""
        step = None if self.whole is None else getattr(self.whole.run, "__self__", None)
        if step is None or not hasattr(step, "set_input_sparse"):
            raise ValueError("input thresholds need the C++ decoder step on an unsplit model")
        return step

    # -- the runner's interface (offload/body/protocol.py) ----------------------------------
    @property
    def head_batch_invariant(self) -> bool:
        return getattr(self.head, "batch_invariant", False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(T,) ids -> (T, hidden) scaled embeddings, from the embedding's own blocks."""
        if ids.shape[0] == 1:
            rows = bm.dequantize_row(self.embedding, int(ids[0]))
        else:
            rows = self.embedding.select_rows(ids.cpu()).dequantize()
        return rows * self.cfg.embed_scale

    def new_cache(self, max_len: int) -> ContiguousKVCache:
        apart = None
        if self.kv_host_layers is not None:
            layers, dtype = self.kv_host_layers
            apart = (layers, dtype, kv_row_values(dtype, self.cfg.head_dim))
        return ContiguousKVCache(self.cfg, max_len, device=self.attention_device,
                                 dtype=self.kv_dtype,
                                 row_values=kv_row_values(self.kv_dtype, self.cfg.head_dim),
                                 host_layers=apart)

    @torch.inference_mode()
    def hidden(self, ids: torch.Tensor, cache: KVCache, tree: TreeRows | None = None) -> torch.Tensor:
        """Run ids (T,) at positions cache.length.. and commit them to the cache; with `tree`,
        the rows are token-tree nodes placed as it says (the caller reserved their slots and
        commits or truncates them). Returns the final-normed hidden states (T, hidden)."""
        start, T = cache.length, ids.shape[0]
        if tree is None:
            cache.reserve(T)
        rows = PassRows(start, T, cache, tree, self.rotary, self.windows)
        x = self.embed(ids)
        if self.whole is not None:
            x = self.whole.run(x, *cache.pools(), *rows.host(self.whole.idx))
        else:
            pools = cache.layer_pools()
            for segment in self._segments:
                x = segment(x.to(segment.device), pools, rows)
            x = x.to(CPU)
        if tree is None:
            cache.commit(T)
        return rms_norm(x, self.output_norm, self.cfg.rms_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def decode_graphs(self) -> dict | None:
        """The stretches of tier layers a decoded token replays from a CUDA graph
        (offload/body/tier_graph.py): their layers, the graphs' memory (the growth of what
        the allocator reserved, in its 2 MiB segments), the seconds their capture took and
        replays so far (None: no stretch is graphed)."""
        graphed = [s for s in self._segments or [] if isinstance(s, GraphedTierRuns)]
        if not graphed:
            return None
        return {"layers": [g.layers for g in graphed],
                "captured": [g.graph_bytes is not None for g in graphed],
                "bytes": sum(g.graph_bytes or 0 for g in graphed),
                "capture_s": round(sum(g.capture_s for g in graphed), 4),
                "replays": sum(g.replays for g in graphed)}

    # -- what it costs ---------------------------------------------------------------------
    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: every projection of every layer and the LM
        head, as held (norms and the embedding row are under 0.1%)."""
        total = self.head.nbytes
        for i, layer in enumerate(self.layers):
            run = LayerRun() if self.runs is None else self.runs[i]
            if run.attention is None:
                total += sum(t.nbytes for t in (*layer.qkv, layer.wo))
            else:  # the tier's copies (norms too: under 0.1% of them)
                total += run.attention.nbytes()
            if run.ffn is None:
                total += sum(t.nbytes for t in (*layer.gate_up, layer.down))
            else:  # a split layer: both sides in full (a dense step; sparse ones read less)
                total += ffn_bytes(run.ffn)
        return total


def ffn_bytes(ffn) -> int:
    """Bytes an FFN callable reads for a dense token: a HybridFFN's dense twin (the file's
    blocks) when it runs that, else its hot rows and cold side; a whole tier FFN its bytes."""
    fallback = getattr(ffn, "dense_fallback", None)
    if fallback is None:
        return ffn.nbytes()
    dense = fallback()
    if dense is not None:
        return dense.nbytes
    return ffn.gpu_bytes() + ffn.host_bytes()
