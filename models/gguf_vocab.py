"""A GGUF vocabulary (the tokenizer.ggml.* fields) converted to a `tokenizers.Tokenizer`,
and the cache of conversions under the user's cache directory.

Ember tokenizes "gpt2" vocabularies through this conversion. "llama" ones it tokenizes
directly (models/spm_encoder.py, faster to start); their conversion is what
`Tokenizer.save_tokenizer_json` writes and what the tests check the direct route against.

* "llama" (SentencePiece-style) vocabularies: llama.cpp repeatedly merges the adjacent
  pair whose concatenation is the vocab token with the highest score (ties: leftmost).
  That is a BPE model whose merges are every (left, right) split of every token, ranked
  by the merged token's score; characters missing from the vocab fall back to <0xXX>.
* "gpt2" vocabularies: byte-level BPE with the file's merges, split first by the
  pre-tokenizer regexes llama.cpp uses for `tokenizer.ggml.pre` (models/pre_tokenizers.py).

Special tokens are split out of the raw text first, as llama.cpp does: user-defined
tokens always, control/unknown tokens only with parse_special=True. They are added
tokens matched on un-normalized text (leftmost-longest); control tokens are marked
special so `encode_special_tokens` can switch them off per call.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from .support.atomic import atomic_write_bytes
from .support.errors import UnsupportedModelError
from .pre_tokenizers import PRE_TOKENIZERS, pre_tokenizer
from .support.user_dirs import cache_dir

# Bump when the conversion changes, so caches written by older code are rebuilt.
CONVERTER_VERSION = 3

SPM_SPACE = "\u2581"  # SentencePiece's visible space, "▁"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# With rstrip_specials, the special tokens that still leave the whitespace after them alone
# (llama.cpp's Phi-3 rule).
KEEP_SPACE_AFTER = frozenset({"<unk>", "<s>", "<|endoftext|>"})


@dataclass(frozen=True)
class VocabSpec:
    """The tokenizer.ggml.* fields of a GGUF file.

    token_types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte (<0xXX>).
    model: "llama" (SentencePiece-style, uses scores) or "gpt2" (byte-level BPE, uses
    merges and pre). add_bos: the model wants BOS in front of prompts.
    """

    tokens: list[str]
    scores: list[float] | None = None
    token_types: list[int] | None = None
    model: str = "llama"
    merges: list[str] | None = None
    pre: str | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool = True
    add_space_prefix: bool = False
    rstrip_specials: bool = False  # special tokens swallow the whitespace after them (Phi-3)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 over everything the conversion reads, plus CONVERTER_VERSION."""
        h = hashlib.sha256()
        flags = [CONVERTER_VERSION, self.model, self.pre, self.bos_id, self.eos_id, self.unk_id,
                 self.pad_id, self.add_bos, self.add_space_prefix, len(self.tokens)]
        if self.rstrip_specials:  # only when set, so other vocabularies keep their caches
            flags.append("rstrip")
        h.update(json.dumps(flags).encode())
        for part in (self.tokens, self.merges):
            h.update(json.dumps(part, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        for arr, dtype in ((self.scores, np.float32), (self.token_types, np.int32)):
            h.update(b"-" if arr is None else np.asarray(arr, dtype=dtype).tobytes())
        return h.hexdigest()


def tokenizer_cache_path(model_fingerprint: str) -> Path:
    """Where the converted tokenizer of the model with this fingerprint is cached: under the
    user's cache directory, never beside the model (its folder may be read-only). The sidecar
    `.meta` records the vocabulary's own fingerprint, so a stale entry is rebuilt."""
    return cache_dir() / "tokenizers" / f"{model_fingerprint[:24]}.tokenizer.json"


def token_kinds(spec: VocabSpec) -> list[int]:
    """tokenizer.ggml.token_type, or a guess when the file has none."""
    if spec.token_types is not None:
        return [int(k) for k in spec.token_types]
    # Recognise byte tokens by name; bos/eos are control tokens.
    return [BYTE if spec.model == "llama" and BYTE_TOKEN.fullmatch(t) else
            CONTROL if i in (spec.bos_id, spec.eos_id) else NORMAL
            for i, t in enumerate(spec.tokens)]


# Splitting a token of n characters tries n cuts of O(n) each: a crafted file with megabyte
# tokens would take hours. Real vocabularies stay far below this (the default model's
# longest token has 31 characters); longer tokens get no merges, so the tokenizer never
# produces them (they still decode).
MAX_MERGE_CHARS = 256


def _spm_merges(spec: VocabSpec, kinds: list[int], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of every token into two vocab tokens, best-scored merged token first."""
    scores = np.asarray(spec.scores if spec.scores is not None else np.zeros(len(spec.tokens)))
    # Byte tokens are not text: a fallback <0xXX> must never merge with its neighbours.
    parts = set(vocab).difference(t for t, k in zip(spec.tokens, kinds) if k == BYTE)
    merges = []
    tokens = spec.tokens
    for i in np.argsort(-scores, kind="stable").tolist():  # hot loop: ~2M splits for 262k
        tok = tokens[i]
        if len(tok) > MAX_MERGE_CHARS:
            continue
        for cut in range(1, len(tok)):
            if tok[:cut] in parts and tok[cut:] in parts:
                merges.append((tok[:cut], tok[cut:]))
    return merges


def _spm_tokenizer(spec: VocabSpec, kinds: list[int], vocab: dict[str, int]):
    unk = spec.tokens[spec.unk_id] if spec.unk_id is not None else None
    merges = _spm_merges(spec, kinds, vocab)
    hf = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token=unk, byte_fallback=True))
    normalize = [normalizers.Replace(" ", SPM_SPACE)]
    decode = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if spec.add_space_prefix:
        normalize.insert(0, normalizers.Prepend(SPM_SPACE))
        decode.append(decoders.Strip(" ", 1, 0))
    hf.normalizer = normalizers.Sequence(normalize)
    hf.decoder = decoders.Sequence(decode)  # for other `tokenizers` users; Ember uses pieces
    return hf


def _byte_level_tokenizer(spec: VocabSpec, vocab: dict[str, int], source: str):
    pre = pre_tokenizer(spec.pre)
    if pre is None:
        raise UnsupportedModelError(source, f"unknown pre-tokenizer {spec.pre!r} "
                                    f"(tokenizer.ggml.pre); Ember reads llama.cpp's "
                                    f"{len(PRE_TOKENIZERS)}, such as llama-bpe, qwen2, gpt-2")
    merges = [tuple(m.split(" ", 1)) for m in spec.merges or []]
    hf = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=pre.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    return hf


def build_hf(spec: VocabSpec, kinds: list[int], source: str) -> tokenizers.Tokenizer:
    vocab = {t: i for i, t in enumerate(spec.tokens)}  # later duplicates win, as in llama.cpp
    if spec.model == "llama":
        hf = _spm_tokenizer(spec, kinds, vocab)
    elif spec.model == "gpt2":
        hf = _byte_level_tokenizer(spec, vocab, source)
    else:
        raise UnsupportedModelError(source, f"tokenizer.ggml.model {spec.model!r} is not "
                                    "supported (Ember reads 'llama' and 'gpt2')")
    # Matched on the raw text; `special` marks the ones only parse_special may split out.
    hf.add_tokens([AddedToken(t, special=k != USER_DEFINED, normalized=False,
                              rstrip=spec.rstrip_specials and t not in KEEP_SPACE_AFTER)
                   for t, k in zip(spec.tokens, kinds) if k in (USER_DEFINED, CONTROL, UNKNOWN)])
    if spec.add_bos and spec.bos_id is not None:  # so a saved tokenizer.json stands alone
        bos = spec.tokens[spec.bos_id]
        hf.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, spec.bos_id)])
    return hf


def load_cache(path: Path, fingerprint: str, tokens: list[str]) -> tokenizers.Tokenizer | None:
    """The cached tokenizer if its sidecar names this fingerprint, its bytes check out, and
    its ids are the vocabulary's (`tokens`): the largest one the writer recorded fits (an
    id past it would index past the embeddings) and a spread sample maps to the same text.
    Asking the tokenizer for all its ids (`get_vocab`) would cost ~0.3 s on every start."""
    try:
        meta = json.loads(Path(f"{path}.meta").read_text())
        data = path.read_bytes()
        if meta.get("fingerprint") != fingerprint or \
                meta.get("sha256") != hashlib.sha256(data).hexdigest():
            return None
        max_id = meta.get("max_id")
        if not isinstance(max_id, int) or max_id >= len(tokens):  # older caches lack it
            return None
        # From bytes, not str: a str of the JSON costs ~80 MB more at the peak of the parse.
        hf = tokenizers.Tokenizer.from_buffer(data)
        return hf if _ids_agree(hf, tokens) else None
    except Exception:  # missing, unreadable or corrupt: the caller rebuilds
        return None


def _ids_agree(hf: tokenizers.Tokenizer, tokens: list[str], samples: int = 256) -> bool:
    """Spot check: sampled vocabulary entries get ids that name the same text (a duplicate
    entry's id is another position holding the same text)."""
    step = max(1, len(tokens) // samples)
    for i in [*range(0, len(tokens), step), len(tokens) - 1]:
        got = hf.token_to_id(tokens[i])
        if got is None or not 0 <= got < len(tokens) or tokens[got] != tokens[i]:
            return False
    return True


def write_cache(path: Path, fingerprint: str, hf: tokenizers.Tokenizer) -> None:
    data = hf.to_str().encode()
    meta = {"fingerprint": fingerprint, "sha256": hashlib.sha256(data).hexdigest(),
            "max_id": max(hf.get_vocab(with_added_tokens=True).values(), default=-1)}
    try:  # the cache is an optimisation: an unwritable location is not an error
        atomic_write_bytes(path, data)  # data before sidecar, so a sidecar never vouches early
        atomic_write_bytes(Path(f"{path}.meta"), json.dumps(meta).encode())
    except OSError:
        pass
