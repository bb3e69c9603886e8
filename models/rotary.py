"""Rotary position embeddings: cos/sin tables per RoPE base, and the rotation itself.

Shared by the reference attention (models/transformer.py) and the fused decode ops' reference
(kernels/fused_ops.py).
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


class Rotary:
    """cos/sin tables for rotary position embeddings, grown on demand, one per RoPE base.

    `factors` (head_dim / 2, or empty) divide each frequency: Llama 3.1's scaling and
    Phi-3's LongRoPE, the way llama.cpp applies a file's `rope_freqs` / `rope_factors_*`
    tensor. `attn_factor` multiplies the tables (LongRoPE's attention scaling).
    """

    def __init__(self, head_dim: int, base: float, scale: float, interleaved: bool,
                 factors: tuple[float, ...] = (), attn_factor: float = 1.0):
        self.head_dim, self.base, self.scale, self.interleaved = head_dim, base, scale, interleaved
        self.factors, self.attn_factor = tuple(factors), attn_factor
        self.cos = self.sin = torch.empty(0, head_dim // 2)
        self._last: tuple = (None, None, None)  # (start, n, device), cos, sin of the last range

    def _grow(self, n: int) -> None:
        n = max(n, 2 * self.cos.shape[0], 256)
        # float64 for the angles: positions up to 32k times frequencies lose digits in fp32.
        inv_freq = self.base ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        if self.factors:
            inv_freq = inv_freq / torch.tensor(self.factors, dtype=torch.float64)
        angles = torch.arange(n, dtype=torch.float64)[:, None] / self.scale * inv_freq[None, :]
        self.cos = (angles.cos() * self.attn_factor).float()
        self.sin = (angles.sin() * self.attn_factor).float()

    def tables(self, positions: torch.Tensor | int, n: int, device: torch.device):
        """cos, sin (n, hd/2) for `positions`: a (n,) tensor, or an int `start` for positions
        start..start+n-1 (prefill and decode)."""
        if isinstance(positions, int):
            return self._range(positions, n, device)
        if int(positions.max()) >= self.cos.shape[0]:
            self._grow(int(positions.max()) + 1)
        return self.cos[positions].to(device), self.sin[positions].to(device)

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | int):
        """Rotate q and k (T, heads, head_dim) by their positions (see `tables`)."""
        cos, sin = self.tables(positions, q.shape[0], q.device)
        cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, hd/2): every head alike
        return rotate(q, cos, sin, self.interleaved), rotate(k, cos, sin, self.interleaved)

    def _range(self, start: int, n: int, device: torch.device):
        """Every layer sharing this table asks for the same range in a step: the first lookup
        serves them all."""
        key, cos, sin = self._last
        if key != (start, n, device):
            if start + n > self.cos.shape[0]:
                self._grow(start + n)
            cos = self.cos[start:start + n].to(device)
            sin = self.sin[start:start + n].to(device)
            self._last = ((start, n, device), cos, sin)
        return cos, sin


def llama3_rope_factors(head_dim: int, base: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_context: float) -> tuple[float, ...]:
    """Llama 3.1's per-frequency divisors (what llama.cpp's converter writes to `rope_freqs`):
    wavelengths shorter than original_context / high_freq_factor keep their frequency, those
    longer than original_context / low_freq_factor are divided by `factor`, and the band
    between is interpolated smoothly (in frequency) from one to the other."""
    out = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * base ** (i / head_dim)
        if wavelength < original_context / high_freq_factor:
            out.append(1.0)
        elif wavelength > original_context / low_freq_factor:
            out.append(factor)
        else:
            smooth = (original_context / wavelength - low_freq_factor) / (high_freq_factor
                                                                          - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(out)


def yarn_rope_factors(head_dim: int, base: float, factor: float, original_context: float,
                      beta_fast: float, beta_slow: float) -> tuple[float, ...]:
    """YaRN's per-frequency divisors, as ggml's rope computes them: pairs below the
    `beta_fast` correction dimension keep their frequency (extrapolated), those past the
    `beta_slow` one are divided by `factor` (interpolated), with a linear ramp between.

    A pair's correction dimension for b rotations over the original context is
    head_dim * ln(original_context / (2 pi b)) / (2 ln base)."""
    def corr_dim(rotations: float) -> float:
        return head_dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(corr_dim(beta_fast)))
    high = min(head_dim - 1.0, math.ceil(corr_dim(beta_slow)))
    out = []
    for i in range(head_dim // 2):
        keep = 1 - min(1.0, max(0.0, (i - low) / max(0.001, high - low)))  # 1: extrapolate
        out.append(1.0 / ((1 - keep) / factor + keep))
    return tuple(out)


def yarn_attn_factor(factor: float) -> float:
    """YaRN's magnitude correction of cos and sin: 1 + 0.1 ln(factor)."""
    return 1.0 + 0.1 * math.log(factor) if factor > 1 else 1.0


def layer_rotaries(cfg: ModelConfig, n_ctx: int | None = None) -> list[Rotary]:
    """Each layer's Rotary for a context of `n_ctx` tokens (see ModelConfig.rope_factors_for);
    layers with the same base and scale share one (and its tables)."""
    shared: dict[tuple[float, float], Rotary] = {}
    factors = cfg.rope_factors_for(n_ctx)
    out = []
    for i in range(cfg.n_layers):
        key = (cfg.layer_rope_base(i), cfg.layer_rope_scale(i))
        if key not in shared:
            shared[key] = Rotary(cfg.head_dim, key[0], key[1], cfg.rope_interleaved,
                                 factors, cfg.rope_attn_factor)
        out.append(shared[key])
    return out


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotary embedding of x (..., head_dim) with cos/sin broadcasting to (..., head_dim/2):
    pairs (x0, x1), (x2, x3), ... when interleaved, else halves (x[:hd/2], x[hd/2:])."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
