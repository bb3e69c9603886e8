"""Sparse FFN for small-batch decoding: the public API the hybrid engine calls per layer/token.

    w = SparseFFNWeights.from_dense(gate, up, down, "relu_glu", dtype="int8")
    out = sparse_ffn(x, w, active_idx)   # x (T, hidden) -> (T, hidden), active neurons only
    out = dense_ffn(x, w)                # every neuron

The fast path is the C++ extension (`cpu_extension.py`, built on first use); it reads each
active neuron's gate/up rows and its contiguous down row once, straight from these tensors.
Without it (no compiler, or EMBER_KERNELS=reference, or backend="reference") the PyTorch
reference in `sparse_ffn_reference.py` computes the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu_extension
from .sparse_ffn_reference import is_gated, quantize_rows_int8, reference_sparse_ffn

# Must match enum Act in csrc/sparse_ffn.cpp.
ACTIVATION_CODES = {"relu": 0, "relu2": 1, "relu_glu": 2, "drelu": 3, "silu_glu": 4, "gelu_glu": 5}
DTYPES = ("fp32", "int8")
BACKENDS = ("auto", "cpp", "reference")


@dataclass(frozen=True)
class SparseFFNWeights:
    """One FFN in neuron-major layout: gate/up/down_nm are (ffn, hidden) rows.

    dtype "fp32": fp32 rows, scales None. dtype "int8": int8 rows plus fp32 (ffn,) scales.
    gate (and gate_scale) is None for plain MLP activations ("relu", "relu2").
    """

    activation: str
    dtype: str
    gate: torch.Tensor | None
    up: torch.Tensor
    down_nm: torch.Tensor
    gate_scale: torch.Tensor | None = None
    up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if is_gated(self.activation) != (self.gate is not None):
            need = "needs a gate" if is_gated(self.activation) else "takes no gate"
            raise ValueError(f"activation {self.activation!r} {need}")
        want = torch.int8 if self.dtype == "int8" else torch.float32
        for name in ("gate", "up", "down_nm"):
            t = getattr(self, name)
            if t is None:
                continue
            if t.dtype != want or t.dim() != 2 or t.shape != self.up.shape or not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous {want} (ffn, hidden) = "
                                 f"{tuple(self.up.shape)}, got {t.dtype} {tuple(t.shape)}")
            s = getattr(self, name.replace("_nm", "") + "_scale")
            if (s is not None) != (self.dtype == "int8"):
                raise ValueError(f"{name}: int8 weights need a scale, fp32 weights take none")
            if s is not None and (s.dtype != torch.float32 or s.shape != (t.shape[0],)):
                raise ValueError(f"{name} scale must be fp32 ({t.shape[0]},)")

    @property
    def ffn(self) -> int:
        return self.up.shape[0]

    @property
    def hidden(self) -> int:
        return self.up.shape[1]

    @classmethod
    def from_rows(cls, gate, up, down_nm, activation: str, dtype: str = "fp32") -> "SparseFFNWeights":
        """From neuron-major fp32 tensors: gate/up/down_nm (ffn, hidden); gate None if plain."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        mats = {"gate": gate, "up": up, "down_nm": down_nm}
        if dtype == "fp32":
            kw = {k: None if v is None else v.detach().float().contiguous() for k, v in mats.items()}
            return cls(activation, dtype, **kw)
        kw = {}
        for k, v in mats.items():
            q, s = quantize_rows_int8(v) if v is not None else (None, None)
            kw[k], kw[k.replace("_nm", "") + "_scale"] = q, s
        return cls(activation, dtype, **kw)

    @classmethod
    def from_dense(cls, gate, up, down, activation: str, dtype: str = "fp32") -> "SparseFFNWeights":
        """From the usual (out, in) layouts: gate/up (ffn, hidden), down (hidden, ffn)."""
        if down.dim() != 2:
            raise ValueError(f"down must be 2-D (hidden, ffn), got {tuple(down.shape)}")
        return cls.from_rows(gate, up, down.t(), activation, dtype)

    def subset(self, neurons: torch.Tensor) -> "SparseFFNWeights":
        """A new FFN holding only these neurons' rows (copies; e.g. the hot/cold split)."""
        idx = neurons.to(torch.long)

        def pick(t):
            return None if t is None else t.index_select(0, idx).contiguous()

        return SparseFFNWeights(self.activation, self.dtype, pick(self.gate), pick(self.up),
                                pick(self.down_nm), pick(self.gate_scale), pick(self.up_scale),
                                pick(self.down_scale))

    def nbytes(self) -> int:
        ts = (self.gate, self.up, self.down_nm, self.gate_scale, self.up_scale, self.down_scale)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


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
    x2 = _as_kernel_input(x, w.up.shape[1])
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
        out = mod.ffn(x2, w.gate, w.gate_scale, w.up, w.up_scale, w.down_nm, w.down_scale, idx,
                      ACTIVATION_CODES[w.activation])
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


def fast_path_available() -> bool:
    return cpu_extension.load() is not None
