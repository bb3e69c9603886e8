"""Write a random-weight LLaMA-architecture GGUF model of a real size, for speed and memory runs.

    .venv/bin/python -m bench.make_model SHAPE OUT.gguf [--quant Q4_K_M] [--seed 0]
        [--quantizer auto|ember|llama.cpp|random] [--force]

SHAPE is one of `bench.model_shapes.SHAPES` (tinyllama-1.1b, llama2-7b, llama2-13b, tiny). The
weights are seeded normal noise (std 0.02, norms 1.0), so the text the model writes is noise,
but its tensors, types, sizes and vocabulary are those of the real model: Ember and llama.cpp
load and run it at the real speed and memory.

The file is streamed: one tensor is generated (float32, in chunks of rows), quantized and
written before the next, so even a 13B never sits in memory. It is written under a temporary
name next to OUT and renamed when complete.

Quantizers: with `llama_cpp` (llama-cpp-python) importable, `auto` writes an F16 file next to
OUT and converts it with llama.cpp's own quantizer (its error-minimizing K-quants); otherwise,
or with `--quantizer ember`, Ember's round-to-nearest quantizer (`ember.models.quantize`) writes
the mix directly, choosing each tensor's type as llama.cpp would (`model_shapes.tensor_type`).
`--quantizer random` writes random codes under fixed scales that keep the weights near the
same spread instead: no float weights made or quantized, a 7B in seconds where quantizing
takes minutes (a lent GPU's short time); as noisy a model, with the same types and bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from gguf import GGML_QUANT_SIZES

from .model_shapes import (BOS_ID, EOS_ID, MIXES, SHAPES, UNK_ID, Mix, Shape, T, llama_vocab,
                           tensor_nbytes, tensor_type)

WEIGHT_STD = 0.02
CHUNK_ELEMENTS = 1 << 23   # float32 values generated and quantized at a time (32 MiB)
QUANTIZERS = ("auto", "ember", "llama.cpp", "random")
# --quantizer random: each type's float16 fields (byte offset in a block, value), chosen so
# that the codes' weights spread about as far as WEIGHT_STD (for a K-quant the 6-bit or
# 8-bit sub-block scales are random too)
# and their mean near 0 (a K-quant's min offsets the mean code times the mean scale)
_RANDOM_SCALES = {T.Q4_0: ((0, 0.005),), T.Q5_0: ((0, 0.0025),),
                  T.Q5_1: ((0, 0.002), (2, -0.031)), T.Q8_0: ((0, 3e-4),),
                  T.Q4_K: ((0, 7.7e-5), (2, 5.8e-4)), T.Q5_K: ((0, 3.8e-5), (2, 5.9e-4)),
                  T.Q6_K: ((208, 1.5e-5),)}


class UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""


def llama_cpp_module():
    """The llama_cpp module, or None when llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except Exception:  # not installed, or its shared library does not load
        return None
    return llama_cpp


def tensor_seed(seed: int, name: str) -> int:
    """Each tensor's own generator seed, so a tensor's values do not depend on the others."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def tensor_bytes(name: str, shape: tuple[int, ...], qtype: T, seed: int) -> np.ndarray:
    """The stored bytes of one random tensor: generated and quantized CHUNK_ELEMENTS at a time."""
    import torch

    from ember.models.quantize import quantize

    out = np.empty(tensor_nbytes(shape, qtype), dtype=np.uint8)
    if len(shape) == 1:   # norms: the multiplier 1.0
        out[:] = np.ones(shape, dtype=np.float32).view(np.uint8)
        return out
    rows, cols = shape
    g = torch.Generator().manual_seed(tensor_seed(seed, name))
    step = max(1, CHUNK_ELEMENTS // cols)
    row_bytes = tensor_nbytes((cols,), qtype)
    for lo in range(0, rows, step):
        n = min(step, rows - lo)
        x = torch.randn(n, cols, generator=g).mul_(WEIGHT_STD)
        out[lo * row_bytes:(lo + n) * row_bytes] = quantize(x, qtype).numpy()
    return out


def random_codes(name: str, shape: tuple[int, ...], qtype: T, seed: int) -> np.ndarray:
    """The stored bytes of one tensor of random codes (`--quantizer random`)."""
    rng = np.random.default_rng(tensor_seed(seed, name))
    n = int(np.prod(shape))
    if len(shape) == 1:   # norms: the multiplier 1.0
        return np.ones(n, dtype=np.float32).view(np.uint8)
    if qtype in (T.F16, T.F32):
        values = rng.standard_normal(n, dtype=np.float32) * WEIGHT_STD
        return values.astype(np.float16 if qtype == T.F16 else np.float32).view(np.uint8)
    out = rng.integers(0, 256, size=tensor_nbytes(shape, qtype), dtype=np.uint8)
    blocks = out.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    for at, scale in _RANDOM_SCALES[qtype]:
        blocks[:, at:at + 2] = np.array([scale], dtype=np.float16).view(np.uint8)
    return out


def plan(shape: Shape, mix: Mix) -> list[tuple[str, tuple[int, ...], T]]:
    return [(name, dims, tensor_type(mix, name, dims, shape.layers))
            for name, dims in shape.tensors()]


def write_gguf(path: Path, shape: Shape, mix: Mix, seed: int, quantized_by: str,
               progress=None, tensor_data=tensor_bytes) -> int:
    """Write the model at `path` with each tensor stored as `plan` says. Returns its size."""
    import gguf

    tensors = plan(shape, mix)
    w = gguf.GGUFWriter(str(path), "llama")
    _add_metadata(w, shape, mix, quantized_by)
    for name, dims, qtype in tensors:
        # The element shape with raw_dtype set (and a non-uint8 dtype) is taken as is.
        w.add_tensor_info(name, dims, np.dtype(np.float32), tensor_nbytes(dims, qtype),
                          raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (name, dims, qtype) in enumerate(tensors):
        w.write_tensor_data(tensor_data(name, dims, qtype, seed))
        if progress is not None:
            progress(i + 1, len(tensors), name)
    w.close()
    return path.stat().st_size


def _add_metadata(w, shape: Shape, mix: Mix, quantized_by: str) -> None:
    import gguf

    w.add_name(shape.name)
    w.add_type("model")
    w.add_quantized_by(quantized_by)
    w.add_description(f"random weights (seeded normal, std {WEIGHT_STD}) written by "
                      f"bench.make_model; not a trained model")
    w.add_file_type(int(mix.file_type))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_vocab_size(shape.vocab)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    tokens, scores, types = llama_vocab(shape.vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)


def quantize_with_llama_cpp(llama_cpp, src: Path, dst: Path, mix: Mix) -> None:
    import ctypes

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{mix.name}", int(mix.file_type))
    params.nthread = os.cpu_count() or 1
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama.cpp's llama_model_quantize failed (returned {rc})")


def make_model(shape_name: str, out: str | Path, quant: str = "Q4_K_M", seed: int = 0,
               quantizer: str = "auto", force: bool = False, log=print) -> Path:
    """Check the arguments, write the model; returns its path. Bad input: UsageError."""
    shape, mix, out, llama_cpp = _check(shape_name, out, quant, quantizer, force)
    used = "llama.cpp" if llama_cpp is not None else \
        "random" if quantizer == "random" else "ember"
    how = {"llama.cpp": "llama.cpp's llama_model_quantize, from an F16 file",
           "ember": "Ember's round-to-nearest ember.models.quantize",
           "random": "random codes under fixed scales, nothing quantized"}[used]
    log(f"quantizer: {used} ({how})")
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    f16 = out.with_name(f".{out.name}.f16-{os.getpid()}.tmp")
    started = time.monotonic()
    try:
        if used == "random":
            write_gguf(partial, shape, mix, seed, used, _progress, random_codes)
        elif llama_cpp is None:
            write_gguf(partial, shape, mix, seed, used, _progress)
        else:
            write_gguf(f16, shape, MIXES["F16"], seed, used, _progress)
            quantize_with_llama_cpp(llama_cpp, f16, partial, mix)
        os.replace(partial, out)
    finally:
        for leftover in (partial, f16):
            leftover.unlink(missing_ok=True)
    size = out.stat().st_size
    n = shape.n_params
    params = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"
    log(f"wrote {out}: {shape.name} {mix.name}, {params} parameters, {size / 1e6:,.1f} MB, "
        f"{time.monotonic() - started:.1f} s")
    return out


def _check(shape_name: str, out, quant: str, quantizer: str, force: bool):
    shape = SHAPES.get(shape_name.lower())
    if shape is None:
        raise UsageError(f"unknown shape {shape_name!r}; choose from {', '.join(SHAPES)}")
    mix = MIXES.get(quant.upper())
    if mix is None:
        raise UsageError(f"unknown quant {quant!r}; choose from {', '.join(MIXES)}")
    if quantizer not in QUANTIZERS:
        raise UsageError(f"unknown quantizer {quantizer!r}; choose from {', '.join(QUANTIZERS)}")
    out = Path(out).expanduser()
    if not out.parent.is_dir():
        raise UsageError(f"output folder {out.parent} does not exist")
    if not os.access(out.parent, os.W_OK):
        raise UsageError(f"output folder {out.parent} is not writable")
    if out.is_dir():
        raise UsageError(f"{out} is a folder; give a file name such as {out / 'model.gguf'}")
    if out.exists() and not force:
        raise UsageError(f"{out} already exists (pass --force to overwrite it)")
    llama_cpp = None
    if quantizer not in ("ember", "random"):
        llama_cpp = llama_cpp_module()
        if llama_cpp is None and quantizer == "llama.cpp":
            raise UsageError("--quantizer llama.cpp needs the llama-cpp-python package "
                             "(import llama_cpp failed); use --quantizer ember")
    need = sum(tensor_nbytes(d, q) for _, d, q in plan(shape, mix))
    if llama_cpp is not None:
        need += sum(tensor_nbytes(d, q) for _, d, q in plan(shape, MIXES["F16"]))
    free = shutil.disk_usage(out.parent).free
    if need > free:
        raise UsageError(f"{out.parent} has {free / 1e9:.1f} GB free; this needs about "
                         f"{need / 1e9:.1f} GB")
    return shape, mix, out, llama_cpp


def _progress(done: int, total: int, name: str) -> None:
    if done not in (1, total) and not name.endswith("ffn_down.weight"):
        return   # one line per layer
    print(f"  {done}/{total} tensors ({name})", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.make_model", description=__doc__.split("\n")[0])
    p.add_argument("shape", help=f"one of: {', '.join(SHAPES)}")
    p.add_argument("out", help="the .gguf file to write")
    p.add_argument("--quant", default="Q4_K_M", help=f"one of: {', '.join(MIXES)} (default Q4_K_M)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--quantizer", default="auto", help="auto (llama.cpp if importable, else "
                   "ember), ember, llama.cpp or random (random codes: seconds, not minutes)")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    args = p.parse_args(argv)
    try:
        make_model(args.shape, args.out, args.quant, args.seed, args.quantizer, args.force)
    except UsageError as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{p.prog}: interrupted; nothing written", file=sys.stderr)
        return 130
    except (OSError, RuntimeError) as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
