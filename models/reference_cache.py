"""The contiguous KV cache: the plain reference every other cache layout is tested against.

Shapes: one K and one V tensor per layer, (max_len, n_kv_heads, head_dim). Positions are the
token indices 0..length-1 of the sequence. The paged cache in `offload/` implements the same
protocol: reserve(n) -> write/read per layer -> commit(n), plus truncate(length).
"""

from __future__ import annotations

from typing import Protocol

import torch

from .config import ModelConfig


class KVCache(Protocol):
    """What attention needs from a cache, for one sequence.

    A forward pass of T tokens calls reserve(T), then write/read for each layer, then
    commit(T). Positions are absolute token indices of the sequence.
    """

    length: int

    def reserve(self, n: int) -> None: ...
    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None: ...
    def read(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def commit(self, n: int) -> None: ...
    def truncate(self, length: int) -> None: ...


class ContiguousKVCache:
    def __init__(self, config: ModelConfig, max_len: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, row_values: int | None = None):
        """row_values: elements per KV head and position (default head_dim; a pool of Q8_0
        blocks holds their bytes, kernels.attention.kv_row_values)."""
        if max_len <= 0:
            raise ValueError(f"KV cache length must be positive, got {max_len}")
        shape = (config.n_layers, max_len, config.n_kv_heads, row_values or config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.length = 0  # tokens committed so far

    def reserve(self, n: int) -> None:
        """Check that n more positions fit (the paged cache allocates blocks here)."""
        if self.length + n > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; {self.length + n} needed")

    def commit(self, n: int) -> None:
        """The n reserved positions now hold valid K/V."""
        self.length += n

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V (T, n_kv, hd) for positions start..start+T-1 of `layer`."""
        end = start + k.shape[0]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; position {end - 1} is past it")
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v

    def read(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of positions lo..hi-1 of `layer`, each (hi-lo, n_kv, hd) (views, no copy)."""
        return self.k[layer, lo:hi], self.v[layer, lo:hi]

    def slots_of(self, layer: int, lo: int, hi: int) -> torch.Tensor:
        """Rows of `pools()` holding positions lo..hi-1 of `layer` (as the paged cache offers,
        so attention that reads keys in place works on both)."""
        return torch.arange(layer * self.max_len + lo, layer * self.max_len + hi,
                            device=self.k.device)

    def pools(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every layer and position as (rows, n_kv_heads, head_dim) views."""
        return self.k.view(-1, *self.k.shape[2:]), self.v.view(-1, *self.v.shape[2:])

    def truncate(self, length: int) -> None:
        """Forget every position at or after `length` (regenerate, rejected drafts)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a {self.length}-token cache to {length}")
        self.length = length

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
