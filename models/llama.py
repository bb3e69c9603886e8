"""The LLaMA family: pre-norm decoder, GQA, RoPE, a configurable FFN activation.

Activations: SwiGLU (LLaMA, Mistral), ReLU-GLU (ReluLLaMA, ProSparse), dReLU
(relu(gate) * relu(up): TurboSparse, Bamboo), and plain ReLU / squared-ReLU MLPs with no gate
(OPT-style). The ReLU family is what gives exact activation sparsity to the hybrid engine.

Neither GGUF nor `config.json` has a standard field that tells the ReLU variants apart, so
Ember reads an optional `<arch>.ffn_activation` GGUF key / `ffn_activation` config.json key
(one of `ember.models.config.ACTIVATIONS`); without it the HF `hidden_act` decides (silu or
relu, gated), and a GGUF file without `ffn_gate` tensors is a plain ReLU MLP.

llama.cpp's converter permutes the q/k rows of LLaMA GGUF files so that RoPE rotates adjacent
pairs; Hugging Face checkpoints rotate halves. `rope_interleaved` records which.
"""

from __future__ import annotations

import torch

from .activations import is_gated
from .common_fields import gguf_fields, hf_fields
from .config import ACTIVATIONS, ModelConfig
from .support.errors import ModelFormatError
from .gguf_file import GGUFFile
from .hf_config import HFConfig
from .hf_names import COMMON_LAYER_NAMES, canonical_name

_HF_ACT = {"silu": "silu_glu", "swish": "silu_glu", "relu": "relu_glu"}


def config_from_gguf(f: GGUFFile, vocab_size: int) -> ModelConfig:
    a = f.architecture + "."
    common = gguf_fields(f, vocab_size, rope_base=10_000.0, rms_eps=1e-5)
    gated = "blk.0.ffn_gate.weight" in f.tensors
    activation = f.arch_field("ffn_activation", str, "silu_glu" if gated else "relu")
    _check_activation(f.path, a + "ffn_activation", activation, gated)
    window = f.arch_field("attention.sliding_window", int, None)
    return ModelConfig(
        architecture="llama",
        activation=activation,
        rope_interleaved=True,
        sliding_window=(window,) * common["n_layers"] if window else (),
        **common,
    )


def config_from_hf(c: HFConfig) -> ModelConfig:
    common = hf_fields(c, rope_base=10_000.0, rms_eps=1e-5, tied=False)
    hidden_act = c.field("hidden_act", str, "silu")
    activation = c.field("ffn_activation", str, _HF_ACT.get(hidden_act, ""))
    if not activation:
        raise ModelFormatError(c.path, f"'hidden_act' {hidden_act!r} is not supported (silu, relu)")
    # Whether the checkpoint has gate weights shows when they load (a missing tensor is an error).
    _check_activation(c.path, "ffn_activation", activation, gated=None)
    window = c.field("sliding_window", int, None)
    return ModelConfig(
        architecture="llama",
        activation=activation,
        rope_interleaved=False,
        sliding_window=(window,) * common["n_layers"] if window else (),
        **common,
    )


def _check_activation(path, key: str, activation: str, gated: bool | None) -> None:
    if activation not in ACTIVATIONS:
        raise ModelFormatError(path, f"'{key}' {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    if gated is not None and gated != is_gated(activation):
        kind = "has" if gated else "has no"
        raise ModelFormatError(path, f"'{key}' is {activation!r} but the model {kind} FFN gate weights")


_HF_LAYER_NAMES = {**COMMON_LAYER_NAMES, "post_attention_layernorm.weight": "ffn_norm.weight"}


def hf_tensor_name(name: str) -> str | None:
    """Canonical (GGUF-style) name for a Hugging Face tensor name, None if unused."""
    return canonical_name(name, _HF_LAYER_NAMES)


def hf_transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def permute_for_gguf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF q/k rows -> llama.cpp's GGUF order (RoPE on adjacent pairs). Used by the writer."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)
