"""The GPU tier's FFN: the hot neurons of a layer, computed with batched torch ops.

On the GPU tier every hot neuron is computed for every token (a GPU reads its weights at a
bandwidth where skipping a few percent of rows buys nothing, and a dense matmul has no
gather), optionally masked afterwards by a predictor. The layout keeps one matmul per side,
each a `TierLinear` (kernels/tier_weights.py: int4, int8, fp16/bf16 or fp32):

    gate_up  W (2n, hidden)   hot gate rows then hot up rows (gated activations), or
             W (n, hidden)    hot up rows (plain "relu"/"relu2")
    down     W (hidden, n)    the hot neurons' down columns

so a token costs two matmuls whatever the device. n is the hot count padded to the formats'
granule (int4 tiles take 32 neurons at a time): padded neurons have zero rows, so they add
exactly nothing. In the file's own blocks (format "file:<types>", kernels/tier_blocks.py) the
matrices are the file's bytes: gate/up the hot neurons' rows, down the hot neurons' whole
blocks along its input axis, so n comes in whole groups of down's block (`file_hot_bytes`). Nothing here imports a GPU library: the tensors' device decides where it
runs (CUDA when the tier is a GPU, the CPU in tests). `hot_ffn_reference` is the same FFN in
plain PyTorch (the sparse kernel's semantics, `sparse_ffn.neuron_rows_ffn`) on the float values
the stored codes stand for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.models.activations import activate, is_gated

from .sparse_ffn import neuron_rows_ffn
from ember.models import quants
from gguf import GGMLQuantizationType

from .tier_blocks import TierBlocks
from .tier_weights import INT4_GROUP, TierLinear, int4_fits, linear_bytes

FILE = "file:"  # a format in the file's blocks names their GGML types: "file:Q4_K,Q4_K"


def file_format(type_names: list[str]) -> str:
    """The format of a matrix kept in the file's blocks of these GGML types."""
    return FILE + ",".join(type_names)


def file_types(fmt: str) -> list[int] | None:
    """The GGML type ids a "file:..." format names (None: another format)."""
    if not fmt.startswith(FILE):
        return None
    return [int(GGMLQuantizationType[name]) for name in fmt[len(FILE):].split(",")]


def granule(formats: tuple[str, str]) -> int:
    """Hot neurons come in multiples of this (int4's down takes neurons as K, in groups; the
    file's down takes them in whole blocks of its input axis)."""
    down = file_types(formats[1])
    if down is not None:
        return quants.block_info(down[0])[0]
    return INT4_GROUP if "int4" in formats else 1


def file_hot_bytes(n: int, hidden: int, formats: tuple[str, str]) -> int:
    """Exact tier bytes of n hot neurons kept in the file's blocks (`formats` "file:..."):
    n rounded down to whole groups (`granule`), their gate/up rows and down's blocks at the
    file's bytes. The plan prices hot rows with this; the split builds exactly it."""
    n -= n % granule(formats)
    rows = sum(quants.row_nbytes(t, hidden) for t in file_types(formats[0]))
    return n * rows + hidden * quants.row_nbytes(file_types(formats[1])[0], n)


def padded(n: int, formats: tuple[str, str]) -> int:
    g = granule(formats)
    return -(-n // g) * g


def fitted(formats: tuple[str, str], n: int, hidden: int, gated: bool) -> tuple[str, str]:
    """`formats` with int4 swapped for int8 on a side whose shape the int4 tiles cannot take
    (hidden not in whole groups)."""
    rows = (2 if gated else 1) * padded(n, formats)
    gu, down = formats
    if gu == "int4" and not int4_fits(rows, hidden):
        gu = "int8"
    if down == "int4" and not int4_fits(hidden, padded(max(n, 1), (down, down))):
        down = "int8"
    return gu, down


def hot_ffn_bytes(n: int, hidden: int, gated: bool, formats: tuple[str, str],
                  half: torch.dtype = torch.bfloat16) -> int:
    """Exact tier bytes of n hot neurons in `formats` (gate_up, down), padding included:
    what `HotFFNWeights.nbytes()` will be."""
    if n == 0:
        return 0
    if file_types(formats[0]) is not None:
        return file_hot_bytes(n, hidden, formats)
    formats = fitted(formats, n, hidden, gated)
    p = padded(n, formats)
    return (linear_bytes(formats[0], (2 if gated else 1) * p, hidden, half)
            + linear_bytes(formats[1], hidden, p, half))


@dataclass(frozen=True)
class HotFFNWeights:
    activation: str
    gate_up: TierLinear  # W (2n or n, hidden), see the module docstring
    down: TierLinear  # W (hidden, n)
    n_real: int  # hot neurons (the rest of n is padding)

    @classmethod
    def from_rows(cls, gate: torch.Tensor | None, up: torch.Tensor, down_nm: torch.Tensor,
                  activation: str, device: torch.device | str = "cpu",
                  formats: tuple[str, str] = ("fp32", "fp32"),
                  half: torch.dtype = torch.bfloat16, fast_int8: bool | None = None) -> "HotFFNWeights":
        """From neuron-major float rows (n, hidden) each (gate None for plain activations),
        stored in `formats` (gate_up's, down's) on `device`."""
        if is_gated(activation) != (gate is not None):
            raise ValueError(f"activation {activation!r} "
                             f"{'needs' if is_gated(activation) else 'takes no'} gate rows")
        n, hidden = up.shape
        formats = fitted(formats, n, hidden, gate is not None)
        pad = padded(n, formats) - n

        def rows(t: torch.Tensor) -> torch.Tensor:
            t = t.float()
            return torch.cat((t, t.new_zeros(pad, hidden))) if pad else t

        gu = rows(up) if gate is None else torch.cat((rows(gate), rows(up)))
        return cls(activation,
                   TierLinear.pack(gu, formats[0], device, half, fast_int8),
                   TierLinear.pack(rows(down_nm).t(), formats[1], device, half, fast_int8), n)

    @classmethod
    def from_file(cls, gate_up: list, down, activation: str, device: torch.device | str = "cpu",
                  half: torch.dtype = torch.bfloat16) -> "HotFFNWeights":
        """From the file's blocks of the hot neurons: gate_up [gate rows, up rows] or [up
        rows] (n, hidden) each, down (hidden, n) their whole blocks (QTensors), kept as they
        are on `device`."""
        if is_gated(activation) != (len(gate_up) == 2):
            raise ValueError(f"activation {activation!r} takes "
                             f"{2 if is_gated(activation) else 1} gate/up tensors")
        return cls(activation, TierBlocks.of(gate_up, device, half),
                   TierBlocks.of([down], device, half), down.shape[1])

    @property
    def n(self) -> int:
        """Neurons the matmuls compute (hot ones plus padding)."""
        return self.down.shape[1]

    @property
    def device(self) -> torch.device:
        return self.down.device

    @property
    def formats(self) -> tuple[str, str]:
        return self.gate_up.fmt, self.down.fmt

    def nbytes(self) -> int:
        return self.gate_up.nbytes() + self.down.nbytes()

    def down_nbytes(self) -> int:
        return self.down.nbytes()

    def conversion_error(self) -> dict[str, float]:
        """Relative error of each stored matrix against the float rows it was made from."""
        return {"gate_up": self.gate_up.error, "down": self.down.error}


def available() -> bool:
    """Always: plain torch ops, on whatever device the weights are (the kernel convention's
    `available()`, for a uniform check across kernels/)."""
    return True


def hot_ffn(x: torch.Tensor, w: HotFFNWeights, mask: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, hidden) on w's device -> (T, hidden) float32: sum over hot neurons of h * down.

    mask (T, n_real) bool, optional: the neurons each token keeps (a predictor's verdict)."""
    if w.n_real == 0:
        return torch.zeros_like(x, dtype=torch.float32)
    # The matmuls in the formats' compute types; the activation in float32 (T, n elements).
    both = w.gate_up(x).float()  # (T, 2n) or (T, n)
    if is_gated(w.activation):
        gate, up = both.split(w.n, dim=1)
    else:
        gate, up = None, both
    h = activate(w.activation, gate, up)  # (T, n)
    if mask is not None:
        h = h * torch.nn.functional.pad(mask, (0, w.n - w.n_real)).to(h.dtype)
    return w.down(h).float()


def hot_ffn_reference(x: torch.Tensor, w: HotFFNWeights,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """`hot_ffn` in plain PyTorch on the host, from the float rows w's codes stand for
    (`TierLinear.dequantize`; padding neurons left out): (T, hidden) float32."""
    n, gate_up = w.n_real, w.gate_up.dequantize()
    gate, up = (gate_up[:n], gate_up[w.n:w.n + n]) if is_gated(w.activation) else (None, gate_up[:n])
    down_nm = w.down.dequantize().t()[:n]
    return neuron_rows_ffn(x.cpu().float(), gate, up, down_nm, w.activation,
                           None if mask is None else mask.cpu())
