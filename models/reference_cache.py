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
                 dtype: torch.dtype = torch.float32, row_values: int | None = None,
                 host_layers: tuple[tuple[int, ...], torch.dtype, int] | None = None):
        """row_values: elements per KV head and position (default head_dim; a pool of Q8_0
        blocks holds their bytes, kernels.attention.kv_row_values). host_layers: (layers,
        dtype, row_values) of layers whose attention runs on the host beside a device: their
        K/V are kept apart, in host RAM (`k`/`v` then hold the other layers only)."""
        if max_len <= 0:
            raise ValueError(f"KV cache length must be positive, got {max_len}")
        apart = () if host_layers is None else tuple(host_layers[0])
        main = [i for i in range(config.n_layers) if i not in apart]
        shape = (len(main), max_len, config.n_kv_heads, row_values or config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        # per layer: its K and V tensors and its index in them
        self._at = {layer: (self.k, self.v, j) for j, layer in enumerate(main)}
        self.host_k = self.host_v = None
        if apart:
            _, host_dtype, host_values = host_layers
            host_shape = (len(apart), max_len, config.n_kv_heads, host_values)
            self.host_k = torch.zeros(host_shape, dtype=host_dtype)
            self.host_v = torch.zeros(host_shape, dtype=host_dtype)
            self._at.update({layer: (self.host_k, self.host_v, j)
                             for j, layer in enumerate(apart)})
        self._rows = {id(k): (k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:]))
                      for k, v, _ in self._at.values()}
        self._layer_rows = [self._rows[id(self._at[i][0])] for i in range(config.n_layers)]
        self.max_len = max_len
        self.length = 0  # tokens committed so far
        self._tables: dict[int, torch.Tensor] = {}  # slot_table's, made on first use

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
        k_all, v_all, j = self._at[layer]
        k_all[j, start:end] = k
        v_all[j, start:end] = v

    def read(self, layer: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of positions lo..hi-1 of `layer`, each (hi-lo, n_kv, hd) (views, no copy)."""
        k, v, j = self._at[layer]
        return k[j, lo:hi], v[j, lo:hi]

    def slots_of(self, layer: int, lo: int, hi: int) -> torch.Tensor:
        """Rows of `pools()` holding positions lo..hi-1 of `layer` (as the paged cache offers,
        so attention that reads keys in place works on both)."""
        k, _, j = self._at[layer]
        return torch.arange(j * self.max_len + lo, j * self.max_len + hi, device=k.device)

    def slot_table(self, layer: int) -> torch.Tensor:
        """Rows of `pools()` of every position of `layer`: one tensor, never changed (the paged
        cache's `slot_table` changes with its blocks)."""
        table = self._tables.get(layer)
        if table is None:
            table = self._tables[layer] = self.slots_of(layer, 0, self.max_len)
        return table

    def pools(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every layer and position as (rows, n_kv_heads, head_dim) views (of
        every layer but the host layers kept apart, if any: see `layer_pools`)."""
        return self.k.view(-1, *self.k.shape[2:]), self.v.view(-1, *self.v.shape[2:])

    def layer_pools(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the K and V rows its `slots_of` index (as the paged cache offers)."""
        return self._layer_rows

    def truncate(self, length: int) -> None:
        """Forget every position at or after `length` (regenerate, rejected drafts)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a {self.length}-token cache to {length}")
        self.length = length

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self._rows.values())
