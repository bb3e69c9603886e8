"""Ember's tokenizer: GGUF vocabularies on top of Hugging Face `tokenizers`, with llama.cpp's ids.

A GGUF file carries a vocabulary, not a tokenizer. We translate it once into a
`tokenizers.Tokenizer` (Rust does the per-text work) and cache the result as JSON:

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

Decoding never goes through the HF decoders: every id maps to the raw bytes it stands
for (`token_bytes`), which is what `StreamDecoder` needs to emit whole characters only.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import re
import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from .atomic import atomic_write_bytes
from .errors import ModelFormatError, UnsupportedModelError
from .pre_tokenizers import PRE_TOKENIZERS, pre_tokenizer
from .user_dirs import cache_dir

# Bump when the conversion changes, so caches written by older code are rebuilt.
CONVERTER_VERSION = 3

SPM_SPACE = "\u2581"  # SentencePiece's visible space, "▁"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_UNKNOWN_PIECE = "\u2585".encode()  # llama.cpp renders the unknown token as "▅"

# With rstrip_specials, the special tokens that still leave the whitespace after them alone
# (llama.cpp's Phi-3 rule).
_KEEP_SPACE_AFTER = frozenset({"<unk>", "<s>", "<|endoftext|>"})
# Last resort for tokenizer.json folders whose configs name no bos/eos.
_USUAL_NAMES = {"bos": ["<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>"],
                "eos": ["<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>"]}


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


# ----------------------------------------------------------------- conversion


def _token_kinds(spec: VocabSpec) -> list[int]:
    """tokenizer.ggml.token_type, or a guess when the file has none."""
    if spec.token_types is not None:
        return [int(k) for k in spec.token_types]
    # Recognise byte tokens by name; bos/eos are control tokens.
    return [BYTE if spec.model == "llama" and _BYTE_TOKEN.fullmatch(t) else
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


def _build_hf(spec: VocabSpec, kinds: list[int], source: str) -> tokenizers.Tokenizer:
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
                              rstrip=spec.rstrip_specials and t not in _KEEP_SPACE_AFTER)
                   for t, k in zip(spec.tokens, kinds) if k in (USER_DEFINED, CONTROL, UNKNOWN)])
    if spec.add_bos and spec.bos_id is not None:  # so a saved tokenizer.json stands alone
        bos = spec.tokens[spec.bos_id]
        hf.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, spec.bos_id)])
    return hf


def _load_cache(path: Path, fingerprint: str, n_tokens: int) -> tokenizers.Tokenizer | None:
    """The cached tokenizer if its sidecar names this fingerprint, its bytes check out and its
    ids fit the vocabulary of `n_tokens` (an id past it would index past the embeddings)."""
    try:
        meta = json.loads(Path(f"{path}.meta").read_text())
        data = path.read_bytes()
        if meta.get("fingerprint") != fingerprint or \
                meta.get("sha256") != hashlib.sha256(data).hexdigest():
            return None
        hf = tokenizers.Tokenizer.from_str(data.decode())
        if max(hf.get_vocab(with_added_tokens=True).values(), default=-1) >= n_tokens:
            return None
        return hf
    except Exception:  # missing, unreadable or corrupt: the caller rebuilds
        return None


def _write_cache(path: Path, fingerprint: str, hf: tokenizers.Tokenizer) -> None:
    data = hf.to_str().encode()
    meta = {"fingerprint": fingerprint, "sha256": hashlib.sha256(data).hexdigest()}
    try:  # the cache is an optimisation: an unwritable location is not an error
        atomic_write_bytes(path, data)  # data before sidecar, so a sidecar never vouches early
        atomic_write_bytes(Path(f"{path}.meta"), json.dumps(meta).encode())
    except OSError:
        pass


# ----------------------------------------------------------------- token bytes


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte: printable Latin-1 bytes stand for
    themselves, the other bytes are shifted to U+0100 onwards in byte order."""
    direct = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in direct}
    rest = [b for b in range(256) if chr(b) not in table]
    table.update({chr(0x100 + n): b for n, b in enumerate(rest)})
    return table


def _token_pieces(tokens: list[str], kinds: list[int], byte_level: bool) -> list[bytes]:
    """The bytes each token stands for, as llama.cpp renders it (control tokens: nothing)."""
    chars = _byte_level_chars() if byte_level else None
    return [_piece(t, k, chars) for t, k in zip(tokens, kinds)]


def _piece(text: str, kind: int, chars: dict[str, int] | None) -> bytes:
    if kind in (CONTROL, UNUSED):
        return b""
    if kind == UNKNOWN:
        return _UNKNOWN_PIECE
    if kind == USER_DEFINED:  # matched on the raw text, so it stands for itself
        return text.encode()
    if kind == BYTE and (m := _BYTE_TOKEN.fullmatch(text)):
        return bytes([int(m.group(1), 16)])
    if chars is None:
        return text.replace(SPM_SPACE, " ").encode()
    if all(c in chars for c in text):
        return bytes(chars[c] for c in text)
    return text.encode()


# ----------------------------------------------------------------- the tokenizer


class Tokenizer:
    """Text <-> token ids for one model. Build with `from_vocab` or `from_tokenizer_json`."""

    def __init__(self, hf: tokenizers.Tokenizer, tokens: list[str], pieces: list[bytes],
                 control_ids: set[int], *, bos_id: int | None, eos_id: int | None, add_bos: bool,
                 strip_space: bool, kind: str = "tokenizer.json"):
        self._hf = hf
        self._tokens = tokens
        self._pieces = pieces
        self._lock = threading.Lock()  # encode_special_tokens is state on the shared object
        self.special_ids = frozenset(control_ids)
        self.bos_id, self.eos_id = bos_id, eos_id
        self.add_bos = add_bos  # the model's own wish; encode(add_bos=True) honours it
        self._strip_space = strip_space  # undo the space prefix added while encoding
        self.kind = kind  # what it was built from, for `ember info`

    @classmethod
    def from_vocab(cls, spec: VocabSpec, cache_path: Path | None = None,
                   source: str | Path = "GGUF vocabulary") -> Tokenizer:
        """Convert `spec` (or load the conversion cached at `cache_path`); `source` names
        the model file in errors."""
        kinds = _token_kinds(spec)
        hf = None
        if cache_path:
            hf = _load_cache(Path(cache_path), spec.fingerprint, len(spec.tokens))
        if hf is None:
            hf = _build_hf(spec, kinds, str(source))
            if cache_path:
                _write_cache(Path(cache_path), spec.fingerprint, hf)
        pieces = _token_pieces(spec.tokens, kinds, byte_level=spec.model == "gpt2")
        control = {i for i, k in enumerate(kinds) if k in (CONTROL, UNUSED)}
        strip = spec.add_space_prefix and spec.model == "llama"
        kind = (f"byte-level BPE, pre-tokenizer {spec.pre or 'default'}" if spec.model == "gpt2"
                else "SentencePiece-style BPE")
        return cls(hf, spec.tokens, pieces, control, bos_id=spec.bos_id, eos_id=spec.eos_id,
                   add_bos=spec.add_bos, strip_space=strip, kind=kind)

    @classmethod
    def from_tokenizer_json(cls, path: Path) -> Tokenizer:
        """A Hugging Face model folder (or its tokenizer.json); special ids are best effort."""
        path = Path(path)
        folder, file = (path, path / "tokenizer.json") if path.is_dir() else (path.parent, path)
        hf, raw = _read_tokenizer_json(file)
        tok_config, config = (_read_json(folder / n) for n in ("tokenizer_config.json",
                                                                "config.json"))
        vocab = hf.get_vocab(with_added_tokens=True)
        added = hf.get_added_tokens_decoder()
        control = {i for i, t in added.items() if t.special}
        template = hf.encode("", add_special_tokens=True).ids  # what the post-processor adds
        bos, eos = (_hf_special_id(n, tok_config, config, vocab) for n in ("bos", "eos"))
        bos = template[0] if bos is None and len(template) == 1 else bos
        add_bos = tok_config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            add_bos = bos is not None and template[:1] == [bos]
        byte_level = '"ByteLevel"' in json.dumps([raw.get("pre_tokenizer"), raw.get("decoder")])
        size = max(vocab.values(), default=-1) + 1
        tokens, kinds = [""] * size, [UNUSED] * size  # ids nobody names decode to nothing
        for text, i in vocab.items():
            tokens[i] = text
            kinds[i] = (CONTROL if i in control else USER_DEFINED if i in added else
                        BYTE if _BYTE_TOKEN.fullmatch(text) and not byte_level else NORMAL)
        pieces = _token_pieces(tokens, kinds, byte_level)
        first = hf.encode("a", add_special_tokens=False).tokens[:1]
        strip = not byte_level and bool(first) and first[0].startswith(SPM_SPACE)
        return cls(hf, tokens, pieces, control, bos_id=bos, eos_id=eos, add_bos=add_bos,
                   strip_space=strip)

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    def id_of(self, text: str) -> int | None:
        return self._hf.token_to_id(text)

    def token_text(self, token_id: int) -> str:
        """The token as the vocabulary spells it ("<bos>", "▁Hello", "<0x0A>")."""
        return self._tokens[token_id]

    def save_tokenizer_json(self, path: Path) -> None:
        """Write a Hugging Face tokenizer.json that `from_tokenizer_json` reads back."""
        atomic_write_bytes(path, self._hf.to_str().encode())

    def encode(self, text: str, add_bos: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids as llama.cpp's llama_tokenize(text, add_special=add_bos, parse_special)."""
        with self._lock:
            self._hf.encode_special_tokens = not parse_special
            ids = self._hf.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (b"" for control tokens)."""
        return self._pieces[token_id]

    def decode(self, ids) -> str:
        """The text of a whole id sequence (control tokens vanish, bad bytes become U+FFFD)."""
        text = b"".join(self._pieces[i] for i in ids).decode("utf-8", errors="replace")
        return text[1:] if self._strip_space and text.startswith(" ") else text


def _hf_special_id(name: str, tok_config: dict, config: dict, vocab: dict) -> int | None:
    text = tok_config.get(f"{name}_token")  # a string or {"content": ...}
    text = text.get("content") if isinstance(text, dict) else text
    if isinstance(text, str) and text in vocab:
        return vocab[text]
    ids = config.get(f"{name}_token_id")  # an int, or a list (several eos ids)
    ids = ids[:1] if isinstance(ids, list) else [ids]
    if ids and isinstance(ids[0], int):
        return ids[0]
    return next((vocab[t] for t in _USUAL_NAMES[name] if t in vocab), None)


def _read_tokenizer_json(file: Path) -> tuple[tokenizers.Tokenizer, dict]:
    """The parsed tokenizer and its raw JSON; a malformed file is a ModelFormatError."""
    try:
        hf = tokenizers.Tokenizer.from_file(str(file))
        raw = json.loads(file.read_text(encoding="utf-8"))
    # The Rust library raises plain Exception for every kind of bad file (bad JSON, bad UTF-8,
    # unknown model type), so nothing narrower catches them all.
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelFormatError(file, f"not a valid tokenizer.json ({reason})") from None
    return hf, raw


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError, RecursionError):  # RecursionError: absurdly nested JSON
        return {}


class StreamDecoder:
    """Turns generated ids into text deltas that never split a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        # The incremental decoder holds back an incomplete trailing sequence until the
        # next bytes complete it; invalid bytes become U+FFFD as soon as they are seen.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is pending; a dangling partial character becomes U+FFFD."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out
