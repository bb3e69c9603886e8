"""Sparse FFN for small-batch decoding: the public API the hybrid engine calls per layer/token.

    w = SparseFFNWeights.from_rows(gate, up, down_nm, "relu_glu", dtype="int8")
    out = sparse_ffn(x, w, active_idx)   # x (T, hidden) -> (T, hidden), active neurons only
    out = sparse_ffn(x, w)               # every neuron (the dense FFN, same bundles)
    out, kept = sparse_ffn_thresholded(x, w, t)  # each token drops neurons with |h| <= t

Semantics (`sparse_ffn_reference`, what the C++ kernel is tested against): for x (T, hidden),
neuron rows gate, up, down_nm (ffn, hidden) (down_nm: the transpose of the usual (hidden, ffn)
down matrix, so one neuron's down weights are one row) and a set of active neurons A,

    h[t, i] = act(gate[i] . x[t], up[i] . x[t])        (i in A; no gate for plain activations)
    out[t]  = sum_{i in A} h[t, i] * down_nm[i]          -> (T, hidden)

Duplicates in A count twice. int8 weights are symmetric per row: w[i, :] ~= q[i, :] * scale[i].

The weights are stored as one contiguous bundle per neuron (`ffn_bundles.py`). The fast path
is the C++ extension (`cpu_extension.py`, built on first use); it reads each active neuron's
bundle once, as one sequential stream. Without it (no compiler, or EMBER_KERNELS=reference)
the reference computes the same thing from views into the bundles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.models import activations

from . import cpu_extension
from .ffn_bundles import (bundle_layout, dequantize_rows_int8, pack_rows, quantize_rows_int8,
                          scale_view)

DTYPES = ("fp32", "int8")


@dataclass(frozen=True)
class SparseFFNWeights:
    """One FFN as neuron bundles (see `ffn_bundles`): packed (ffn, bundle) holds each neuron's
    gate, up and down rows back to back (int8: then their three fp32 scales).

    gate/up/down_nm (ffn, hidden) and gate/up/down_scale (ffn,) are views into it (strided,
    not contiguous). dtype "fp32": fp32 rows, scales None. dtype "int8": int8 rows, fp32
    scales (w = q * scale). gate (and gate_scale) is None for plain MLP activations.
    """

    activation: str
    dtype: str
    packed: torch.Tensor
    hidden: int

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        length, _ = bundle_layout(self.hidden, activations.is_gated(self.activation), self.dtype)
        want = torch.int8 if self.dtype == "int8" else torch.float32
        p = self.packed
        if p.dtype != want or p.dim() != 2 or p.shape[1] != length or not p.is_contiguous():
            raise ValueError(f"packed must be contiguous {want} (ffn, {length}), "
                             f"got {p.dtype} {tuple(p.shape)}")

    @property
    def ffn(self) -> int:
        return self.packed.shape[0]

    @property
    def nrows(self) -> int:
        return 3 if activations.is_gated(self.activation) else 2

    def _row(self, j: int) -> torch.Tensor:
        return self.packed[:, j * self.hidden:(j + 1) * self.hidden]

    def _scale(self, j: int) -> torch.Tensor | None:
        if self.dtype != "int8":
            return None
        _, off = bundle_layout(self.hidden, self.nrows == 3, self.dtype)
        return scale_view(self.packed, off, self.nrows)[:, j]

    @property
    def gate(self) -> torch.Tensor | None:
        return self._row(0) if self.nrows == 3 else None

    @property
    def up(self) -> torch.Tensor:
        return self._row(self.nrows - 2)

    @property
    def down_nm(self) -> torch.Tensor:
        return self._row(self.nrows - 1)

    @property
    def gate_scale(self) -> torch.Tensor | None:
        return self._scale(0) if self.nrows == 3 else None

    @property
    def up_scale(self) -> torch.Tensor | None:
        return self._scale(self.nrows - 2)

    @property
    def down_scale(self) -> torch.Tensor | None:
        return self._scale(self.nrows - 1)

    @classmethod
    def from_rows(cls, gate, up, down_nm, activation: str, dtype: str = "fp32") -> "SparseFFNWeights":
        """From neuron-major tensors: gate/up/down_nm (ffn, hidden); gate None if plain.

        Any float dtype and strides (e.g. a transposed view); the rows are copied once into
        the bundles (int8: quantized per row first).
        """
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if activations.is_gated(activation) != (gate is not None):
            need = "needs a gate" if activations.is_gated(activation) else "takes no gate"
            raise ValueError(f"activation {activation!r} {need}")
        named = [("gate", gate), ("up", up), ("down_nm", down_nm)][0 if gate is not None else 1:]
        for name, t in named:
            if t.dim() != 2 or t.shape != up.shape or not t.is_floating_point():
                raise ValueError(f"{name} must be a float (ffn, hidden) = {tuple(up.shape)} "
                                 f"tensor, got {t.dtype} {tuple(t.shape)}")
        rows, scales = [t for _, t in named], None
        if dtype == "int8":
            quantized = [quantize_rows_int8(t) for t in rows]
            rows, scales = [q for q, _ in quantized], [s for _, s in quantized]
        return cls(activation, dtype, pack_rows(rows, scales, dtype), up.shape[1])

    def nbytes(self) -> int:
        """Weight bytes: rows and scales (the bundle padding, under 64 B a neuron, not counted)."""
        per_row = self.hidden * (1 if self.dtype == "int8" else 4) + (4 if self.dtype == "int8" else 0)
        return self.ffn * self.nrows * per_row

    def float_rows(self, idx: torch.Tensor | None = None):
        """(gate or None, up, down_nm) as fp32 (n, hidden) copies of the neurons `idx` (all
        when None), int8 rows dequantized: a gathered copy, for references, not for speed."""
        def rows(w, scale):
            if w is None:
                return None
            if idx is not None:
                w = w.index_select(0, idx)
                scale = None if scale is None else scale.index_select(0, idx)
            return w.float() if scale is None else dequantize_rows_int8(w, scale)

        return (rows(self.gate, self.gate_scale), rows(self.up, self.up_scale),
                rows(self.down_nm, self.down_scale))


def available() -> bool:
    """Whether `sparse_ffn` runs the C++ kernel (else it runs `sparse_ffn_reference`)."""
    module = cpu_extension.load()
    return module is not None and hasattr(module, "ffn")


def _as_kernel_input(x: torch.Tensor, hidden: int) -> torch.Tensor:
    """x as contiguous fp32 (T, hidden); no copy when it already is (the per-token case)."""
    if x.dim() not in (1, 2) or x.shape[-1] != hidden:
        raise ValueError(f"x must be (T, {hidden}) or ({hidden},), got {tuple(x.shape)}")
    if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
        return x
    return x.reshape(-1, hidden).to(torch.float32).contiguous()


def _as_index(idx: torch.Tensor | None) -> torch.Tensor | None:
    """active_idx as a contiguous int64 vector (no copy when it already is)."""
    if idx is None or (idx.dtype == torch.int64 and idx.dim() == 1 and idx.is_contiguous()):
        return idx
    if idx.dim() != 1 or idx.dtype not in (torch.int64, torch.int32, torch.int16):
        raise ValueError(f"active_idx must be a 1-D integer tensor, got {idx.dtype} {tuple(idx.shape)}")
    return idx.to(torch.int64).contiguous()


def sparse_ffn(x: torch.Tensor, weights: SparseFFNWeights,
               active_idx: torch.Tensor | None = None) -> torch.Tensor:
    """sum over active neurons i of act(gate_i . x, up_i . x) * down_nm[i].

    Called per layer per token: checks are cheap attribute reads, copies only when needed.

    Args:
        x: (T, hidden) or (hidden,) activations (fp32; other float dtypes are converted).
        weights: the FFN, fp32 or int8 rows.
        active_idx: (n,) neuron indices, any order; empty gives zeros; None: every neuron
            (the same kernel with no index list).
    Returns:
        (T, hidden) fp32 (same leading shape as x).
    """
    x2, idx = _as_kernel_input(x, weights.hidden), _as_index(active_idx)
    module = cpu_extension.load()
    if module is None:
        out = sparse_ffn_reference(x2, weights, idx)
    else:
        out = module.ffn(x2, weights.packed, weights.hidden, idx,
                         activations.code(weights.activation))
    return out if x.dim() == 2 else out.reshape(x.shape)


def sparse_ffn_thresholded(x: torch.Tensor, weights: SparseFFNWeights, h_threshold: float,
                           active_idx: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_ffn` with the down projection's input thresholded (issue 18): token t drops
    neuron i when |h[t, i]| <= h_threshold, and the neuron's down row is read only when some
    token keeps it. Returns (out (T, hidden), kept (T,) int64: the neurons each token kept).
    """
    if not h_threshold >= 0:
        raise ValueError(f"h_threshold must be >= 0, got {h_threshold}")
    x2, idx = _as_kernel_input(x, weights.hidden), _as_index(active_idx)
    module = cpu_extension.load()
    if module is None or not hasattr(module, "ffn_thresholded"):
        out, kept = sparse_ffn_thresholded_reference(x2, weights, h_threshold, idx)
    else:
        out, kept = module.ffn_thresholded(x2, weights.packed, weights.hidden, idx,
                                           activations.code(weights.activation),
                                           float(h_threshold))
    return (out if x.dim() == 2 else out.reshape(x.shape)), kept


def sparse_ffn_thresholded_reference(x: torch.Tensor, weights: SparseFFNWeights,
                                     h_threshold: float, active_idx: torch.Tensor | None = None
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_ffn_thresholded` in plain PyTorch: the masked h times the down rows."""
    x2, idx = _as_kernel_input(x, weights.hidden), _as_index(active_idx)
    gate, up, down_nm = weights.float_rows(idx)
    h = activations.activate(weights.activation, None if gate is None else x2 @ gate.t(),
                             x2 @ up.t())
    keep = h.abs() > h_threshold
    return (h * keep) @ down_nm, keep.sum(dim=1)


def sparse_ffn_reference(x: torch.Tensor, weights: SparseFFNWeights,
                         active_idx: torch.Tensor | None = None) -> torch.Tensor:
    """`sparse_ffn` in plain PyTorch, from the bundles' rows: (T, hidden) fp32."""
    x2, idx = _as_kernel_input(x, weights.hidden), _as_index(active_idx)
    gate, up, down_nm = weights.float_rows(idx)
    out = neuron_rows_ffn(x2, gate, up, down_nm, weights.activation)
    return out if x.dim() == 2 else out.reshape(x.shape)


def neuron_rows_ffn(x: torch.Tensor, gate: torch.Tensor | None, up: torch.Tensor,
                    down_nm: torch.Tensor, activation: str,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """The FFN of float neuron rows (n, hidden) each (gate None for a plain activation), in
    plain PyTorch: x (T, hidden) -> (T, hidden). The semantics both FFN kernels (this
    module's and hot_ffn's) are tested against. mask (T, n) bool: the neurons each row keeps."""
    if activations.is_gated(activation) != (gate is not None):
        need = "needs" if activations.is_gated(activation) else "takes no"
        raise ValueError(f"activation {activation!r} {need} gate rows")
    x = x.float()
    h = activations.activate(activation, None if gate is None else x @ gate.t(), x @ up.t())
    if mask is not None:
        h = h * mask.to(h.dtype)
    return h @ down_nm  # (T, n) @ (n, hidden)
