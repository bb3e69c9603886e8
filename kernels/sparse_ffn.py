"""Sparse FFN for small-batch decoding: the public API the hybrid engine calls per layer/token.

    w = SparseFFNWeights.from_dense(gate, up, down, "relu_glu", dtype="int8")
    out = sparse_ffn(x, w, active_idx)   # x (T, hidden) -> (T, hidden), active neurons only
    out = dense_ffn(x, w)                # every neuron

The weights are stored as one contiguous bundle per neuron (`ffn_bundles.py`). The fast path
is the C++ extension (`cpu_extension.py`, built on first use); it reads each active neuron's
bundle once, as one sequential stream. Without it (no compiler, or EMBER_KERNELS=reference,
or backend="reference") the PyTorch reference in `sparse_ffn_reference.py` computes the same
thing, from views into the bundles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu_extension
from .ffn_bundles import bundle_layout, pack_rows, scale_view, select_bundles
from .sparse_ffn_reference import is_gated, quantize_rows_int8, reference_sparse_ffn

# Must match enum Act in csrc/sparse_ffn.cpp.
ACTIVATION_CODES = {"relu": 0, "relu2": 1, "relu_glu": 2, "drelu": 3, "silu_glu": 4, "gelu_glu": 5}
DTYPES = ("fp32", "int8")
BACKENDS = ("auto", "cpp", "reference")


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
        length, _ = bundle_layout(self.hidden, is_gated(self.activation), self.dtype)
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
        return 3 if is_gated(self.activation) else 2

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
        if is_gated(activation) != (gate is not None):
            need = "needs a gate" if is_gated(activation) else "takes no gate"
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

    @classmethod
    def from_dense(cls, gate, up, down, activation: str, dtype: str = "fp32") -> "SparseFFNWeights":
        """From the usual (out, in) layouts: gate/up (ffn, hidden), down (hidden, ffn)."""
        if down.dim() != 2:
            raise ValueError(f"down must be 2-D (hidden, ffn), got {tuple(down.shape)}")
        return cls.from_rows(gate, up, down.t(), activation, dtype)

    def subset(self, neurons: torch.Tensor) -> "SparseFFNWeights":
        """A new FFN holding only these neurons' bundles (copies; e.g. the hot/cold split)."""
        idx = neurons.to(torch.long)
        return SparseFFNWeights(self.activation, self.dtype, select_bundles(self.packed, idx),
                                self.hidden)

    def nbytes(self) -> int:
        """Weight bytes: rows and scales (the bundle padding, under 64 B a neuron, not counted)."""
        per_row = self.hidden * (1 if self.dtype == "int8" else 4) + (4 if self.dtype == "int8" else 0)
        return self.ffn * self.nrows * per_row


def _pick_backend(backend: str):
    """The compiled module, or None for the reference."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return None
    mod = cpu_extension.load()
    if mod is None and backend == "cpp":
        raise RuntimeError(f"C++ kernels unavailable: {cpu_extension.unavailable_reason()}")
    return mod


def _as_kernel_input(x: torch.Tensor, hidden: int) -> torch.Tensor:
    """x as contiguous fp32 (T, hidden); no copy when it already is (the per-token case)."""
    if x.dim() not in (1, 2) or x.shape[-1] != hidden:
        raise ValueError(f"x must be (T, {hidden}) or ({hidden},), got {tuple(x.shape)}")
    if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
        return x
    return x.reshape(-1, hidden).to(torch.float32).contiguous()


def _run(x: torch.Tensor, w: SparseFFNWeights, idx: torch.Tensor | None, backend: str):
    # Called per layer per token: checks are cheap attribute reads, copies only when needed.
    x2 = _as_kernel_input(x, w.hidden)
    if idx is not None and (idx.dtype != torch.int64 or idx.dim() != 1 or not idx.is_contiguous()):
        if idx.dim() != 1 or idx.dtype not in (torch.int64, torch.int32, torch.int16):
            raise ValueError(f"active_idx must be a 1-D integer tensor, got {idx.dtype} {tuple(idx.shape)}")
        idx = idx.to(torch.int64).contiguous()
    mod = _pick_backend(backend)
    if mod is None:
        out = reference_sparse_ffn(x2, w.gate, w.up, w.down_nm, idx, w.activation,
                                   gate_scale=w.gate_scale, up_scale=w.up_scale,
                                   down_scale=w.down_scale)
    else:
        out = mod.ffn(x2, w.packed, w.hidden, idx, ACTIVATION_CODES[w.activation])
    return out if x.dim() == 2 else out.reshape(x.shape)


def sparse_ffn(x: torch.Tensor, weights: SparseFFNWeights, active_idx: torch.Tensor,
               backend: str = "auto") -> torch.Tensor:
    """sum over active neurons i of act(gate_i . x, up_i . x) * down_nm[i].

    Args:
        x: (T, hidden) or (hidden,) activations (fp32; other float dtypes are converted).
        weights: the FFN, fp32 or int8 rows.
        active_idx: (n,) neuron indices, any order; empty gives zeros.
        backend: "auto" (C++ if it builds, else reference), "cpp" (error if unavailable),
            "reference". EMBER_KERNELS=reference turns "auto" into "reference".
    Returns:
        (T, hidden) fp32 (same leading shape as x).
    """
    return _run(x, weights, active_idx, backend)


def dense_ffn(x: torch.Tensor, weights: SparseFFNWeights, backend: str = "auto") -> torch.Tensor:
    """Every neuron active (same kernel, no index list)."""
    return _run(x, weights, None, backend)

