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
    # Per layer, its share of device_blocks (in proportion to what it holds of one sequence):
    # what the plan charges a layer whose K/V sit on the tier, and what a pool split by
    # layer (PagedKVCache's host_layers) gives each side.
    layer_blocks: tuple[int, ...] = ()

    def blocks_of(self, layers) -> int:
        """Device blocks of `layers`' share."""
        return sum(self.layer_blocks[i] for i in layers)

    def layer_bytes(self) -> tuple[int, ...]:
        """Per layer, the bytes of its share of the device pool."""
        return tuple(n * self.block_bytes for n in self.layer_blocks)

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
    return sum(_layer_needs(cfg, n_ctx, block_size, margin, chunk))


def _layer_needs(cfg: ModelConfig, n_ctx: int, block_size: int,
                 margin: int = DEFAULT_ROLLBACK_MARGIN,
                 chunk: int = DEFAULT_PREFILL_CHUNK) -> list[int]:
    """Per layer, the blocks one sequence of n_ctx tokens holds at most there."""
    full = -(-n_ctx // block_size)
    needs = []
    for layer in range(cfg.n_layers):
        window = cfg.window(layer)
        held = full if window is None else -(-(window + margin + chunk) // block_size) + 1
        needs.append(min(full, held))
    return needs


def share_blocks(needs: list[int], total: int) -> tuple[int, ...]:
    """`total` blocks shared out in proportion to `needs`, whole blocks (largest remainder,
    ties to the first layer), summing to `total`: with total == sum(needs), exactly them."""
    whole = sum(needs)
    shares = [total * n // whole for n in needs]
    rest = sorted(range(len(needs)), key=lambda i: (-(total * needs[i] % whole), i))
    for i in rest[:total - sum(shares)]:
        shares[i] += 1
    return tuple(shares)


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
    return KVPlan(block_size, block_bytes, device, host, need,
                  share_blocks(_layer_needs(cfg, n_ctx, block_size), device))
