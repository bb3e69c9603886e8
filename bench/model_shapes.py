"""Model shapes, quantization mixes and the vocabulary for `bench.make_model`.

The shapes are real LLaMA-architecture sizes (plus a `tiny` one for tests). The mixes pick a
GGML type per tensor the way llama.cpp's `llama-quantize` does for the same file type, so a
file written here has the tensor types (and so the size and the kernels) of the real thing.
"""

from __future__ import annotations

import itertools
import string
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

T = GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    context: int
    rope_base: float = 10_000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every tensor in file order; a matrix is (rows, cols), cols being
        GGUF's ne[0] (the dimension the blocks run along)."""
        h, f, hd = self.hidden, self.ffn, self.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"blk.{i}."
            out += [(p + "attn_norm.weight", (h,)),
                    (p + "attn_q.weight", (self.heads * hd, h)),
                    (p + "attn_k.weight", (self.kv_heads * hd, h)),
                    (p + "attn_v.weight", (self.kv_heads * hd, h)),
                    (p + "attn_output.weight", (h, self.heads * hd)),
                    (p + "ffn_norm.weight", (h,)),
                    (p + "ffn_gate.weight", (f, h)),
                    (p + "ffn_up.weight", (f, h)),
                    (p + "ffn_down.weight", (h, f))]
        return out + [("output_norm.weight", (h,)), ("output.weight", (self.vocab, h))]

    @property
    def n_params(self) -> int:
        return sum(_numel(s) for _, s in self.tensors())


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("tiny", hidden=256, layers=2, ffn=512, heads=4, kv_heads=2, vocab=512, context=512),
    Shape("tinyllama-1.1b", hidden=2048, layers=22, ffn=5632, heads=32, kv_heads=4, vocab=32000,
          context=2048),
    Shape("llama2-7b", hidden=4096, layers=32, ffn=11008, heads=32, kv_heads=32, vocab=32000,
          context=4096),
    Shape("llama2-13b", hidden=5120, layers=40, ffn=13824, heads=40, kv_heads=40, vocab=32000,
          context=4096),
)}


# ------------------------------------------------------------------ quantization mixes

@dataclass(frozen=True)
class Mix:
    name: str
    base: T                    # most matrices
    file_type: LlamaFileType   # general.file_type, llama.cpp's LLAMA_FTYPE_* of the same name
    output: T | None = None    # output.weight (None: base)
    more_bits: T | None = None  # attn_v / ffn_down in the layers `use_more_bits` picks


MIXES: dict[str, Mix] = {m.name: m for m in (
    Mix("Q4_K_M", T.Q4_K, LlamaFileType.MOSTLY_Q4_K_M, output=T.Q6_K, more_bits=T.Q6_K),
    Mix("Q5_K_M", T.Q5_K, LlamaFileType.MOSTLY_Q5_K_M, output=T.Q6_K, more_bits=T.Q6_K),
    Mix("Q4_0", T.Q4_0, LlamaFileType.MOSTLY_Q4_0, output=T.Q6_K),
    Mix("Q6_K", T.Q6_K, LlamaFileType.MOSTLY_Q6_K, output=T.Q6_K),
    Mix("Q8_0", T.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    Mix("F16", T.F16, LlamaFileType.MOSTLY_F16),
)}

# A K-quant needs rows in whole 256-element blocks; llama.cpp falls back to a 32-block type.
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's pick of layers that get more bits: the first eighth, the last eighth, and
    every third layer in between (counting from the end of the first eighth)."""
    first, last = n_layers // 8, 7 * n_layers // 8
    return layer < first or layer >= last or (layer - first) % 3 == 2


def tensor_type(mix: Mix, name: str, shape: tuple[int, ...], n_layers: int) -> T:
    """The GGML type `name` is stored as in this mix."""
    if len(shape) == 1:
        return T.F32                                  # norms
    qtype = mix.base
    if name == "output.weight" and mix.output is not None:
        qtype = mix.output
    elif mix.more_bits is not None and name.endswith(("attn_v.weight", "ffn_down.weight")):
        if use_more_bits(int(name.split(".")[1]), n_layers):
            qtype = mix.more_bits
    cols = shape[-1]
    if cols % GGML_QUANT_SIZES[qtype][0]:
        qtype = _FALLBACK.get(qtype, T.F16)
        if cols % GGML_QUANT_SIZES[qtype][0]:
            qtype = T.F16
    return qtype


def tensor_nbytes(shape: tuple[int, ...], qtype: T) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return _numel(shape) // block * size


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ------------------------------------------------------------------ vocabulary

def llama_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types) of a SentencePiece-style LLaMA vocabulary of exactly `size`.

    <unk> <s> </s>, the 256 byte tokens, then pieces: "▁", the characters and merged pieces of
    Ember's tiny test vocabulary, then made-up filler pieces ("▁a", "aa", "▁aa", "aaa", ...)
    in a fixed order. Every piece is a shorter piece plus one character, so each one can be
    reached by merging; scores fall with rank as in SentencePiece's BPE models.
    """
    from ember.models.testing.synthetic import (CHARS, PIECES, TYPE_BYTE, TYPE_CONTROL, TYPE_NORMAL,
                                        TYPE_UNKNOWN)

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TYPE_UNKNOWN, TYPE_CONTROL, TYPE_CONTROL] + [TYPE_BYTE] * 256
    scores = [0.0] * len(tokens)
    # Whitespace other than the SentencePiece space stays byte tokens, as in LLaMA's vocab.
    seeds = ["\u2581"] + [c for c in CHARS if not c.isspace()] + list(PIECES)
    minimum = len(tokens) + len(set(seeds))
    if size < minimum:
        raise ValueError(f"a vocabulary needs at least {minimum} tokens, asked for {size}")
    pieces = itertools.chain(seeds, _filler_pieces())
    seen = set(tokens)
    rank = 0
    while len(tokens) < size:
        piece = next(pieces)
        if piece in seen:
            continue
        seen.add(piece)
        tokens.append(piece)
        types.append(TYPE_NORMAL)
        scores.append(-float(rank))
        rank += 1
    return tokens, scores, types


def _filler_pieces():
    letters = string.ascii_lowercase
    for n in itertools.count(1):
        for combo in itertools.product(letters, repeat=n):
            word = "".join(combo)
            if n > 1:
                yield word
            yield "\u2581" + word


BOS_ID, EOS_ID, UNK_ID = 1, 2, 0
