"""What the host reads per decoded token, by part: how `--tier-attention auto` weighs moving
attention and its KV pool to the GPU tier against giving that room to hot FFN rows.

Moving attention costs the tier its 16-bit copy (about 3.5 times a Q4_K file's bytes) and a
full context's KV pool; it spares the host the file's attention blocks and the context's K/V
every token. The same room as hot FFN rows (int4: about a Q4_K file's own size) spares the
host those rows instead. The memory plan (`plan_memory`) makes both plans and keeps the one
that leaves the host fewer bytes to read: on a Llama-2 7B Q4_K_M at 8 GiB attention moves
(the FFN rows fit beside it nearly whole); on a 70B at 24 GiB it would take all the room and
leave every FFN row to the host, so the rows win. Dense reads (every cold neuron): a
predictor's sparsity makes cold rows cheaper, which the comparison leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.models.config import ModelConfig

KV_HOST_BYTES = 2  # the host runtime's float16 K/V


@dataclass(frozen=True)
class HostReads:
    attention: int  # per token, attention on the host: its blocks and the KV at half context
    neuron: tuple[int, ...]  # per layer, the file's bytes of one FFN neuron (gate, up, down)

    @classmethod
    def of_file(cls, cfg: ModelConfig, weights, n_ctx: int) -> "HostReads":
        """From the file's tensors (`WeightStore`) at a context of n_ctx tokens (a decoded
        token sees half of it on average; a windowed layer at most its window)."""
        attention, neuron = 0, []
        kv_row = 2 * cfg.n_kv_heads * cfg.head_dim * KV_HOST_BYTES  # K and V of one position
        ffn = (["ffn_gate"] if cfg.gated else []) + ["ffn_up", "ffn_down"]
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            attention += sum(weights.get(f"{p}attn_{n}.weight").nbytes
                             for n in ("q", "k", "v", "output"))
            window = cfg.window(i)
            seen = n_ctx // 2 if window is None else min(window, n_ctx // 2)
            attention += seen * kv_row
            neuron.append(sum(weights.get(f"{p}{n}.weight").nbytes for n in ffn) // cfg.ffn_size)
        return cls(attention, tuple(neuron))
