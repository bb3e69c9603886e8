"""How many KV blocks each tier gets: from budgets in bytes, or just enough for one
full-length conversation on the device and one more in host RAM."""

from __future__ import annotations

from dataclasses import dataclass

from ember.models.config import ModelConfig
from ember.models.support.errors import ConfigError

from ember.models.support.sizes import format_size

from ..options.choices import DEFAULT_BLOCK_SIZE

DEFAULT_ROLLBACK_MARGIN = 64
DEFAULT_PREFILL_CHUNK = 512


@dataclass(frozen=True)
class KVPlan:
    block_size: int
    block_bytes: int
    device_blocks: int
    host_blocks: int
    min_device_blocks: int  # one sequence of n_ctx tokens

    def to_dict(self) -> dict:
        return {"block_size": self.block_size, "block_bytes": self.block_bytes,
                "device_blocks": self.device_blocks, "host_blocks": self.host_blocks,
                "device_bytes": self.device_blocks * self.block_bytes,
                "host_bytes": self.host_blocks * self.block_bytes}


def blocks_for_one_sequence(cfg: ModelConfig, n_ctx: int, block_size: int,
                            margin: int = DEFAULT_ROLLBACK_MARGIN,
                            chunk: int = DEFAULT_PREFILL_CHUNK) -> int:
    """Blocks a sequence of n_ctx tokens holds at most: all of them on global layers; on
    windowed ones the window, the rollback margin and one prefill chunk (a chunk's blocks are
    reserved before the blocks it pushes out of the window are released), plus a partial
    block at the start."""
    full = -(-n_ctx // block_size)
    total = 0
    for layer in range(cfg.n_layers):
        window = cfg.window(layer)
        held = full if window is None else -(-(window + margin + chunk) // block_size) + 1
        total += min(full, held)
    return total


def plan_kv(cfg: ModelConfig, n_ctx: int, device_budget: int | None = None,
            host_budget: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
            value_bytes: float = 4) -> KVPlan:
    """Blocks per tier; `value_bytes` per K or V value (4: float32, 2: the file-blocks
    runtime's float16, 34/32: its Q8_0 blocks; offload/body/file_blocks_model.kv_value_bytes)."""
    if block_size < 1:
        raise ConfigError(f"KV block size must be at least 1, got {block_size}")
    block_bytes = round(2 * block_size * cfg.n_kv_heads * cfg.head_dim * value_bytes)  # K and V
    need = blocks_for_one_sequence(cfg, n_ctx, block_size)
    device = need if device_budget is None else device_budget // block_bytes
    if device < need:
        raise ConfigError(
            f"--kv-budget {format_size(device_budget)} cannot hold a {n_ctx}-token context: "
            f"it needs at least {format_size(need * block_bytes)} ({need} blocks of "
            f"{block_size} tokens); raise --kv-budget or lower --ctx-size")
    host = need if host_budget is None else host_budget // block_bytes
    return KVPlan(block_size, block_bytes, device, host, need)
