"""Ember's tokenizer: text <-> token ids with llama.cpp's ids.

Built from a GGUF vocabulary or from a Hugging Face folder's tokenizer.json. SentencePiece-
style GGUF vocabularies are tokenized directly from their scores (models/spm_encoder.py);
byte-level BPE vocabularies and tokenizer.json files go through Hugging Face `tokenizers`
(the GGUF ones converted once and cached: models/gguf_vocab.py).

Decoding never goes through the HF decoders: every id maps to the raw bytes it stands
for (`token_bytes`), which is what `StreamDecoder` needs to emit whole characters only.
"""

from __future__ import annotations

import codecs
import json
import re
import threading
from functools import cached_property, partial
from pathlib import Path
from typing import Callable

import tokenizers

from .support.atomic import atomic_write_bytes
from .support.errors import ModelFormatError
from .gguf_vocab import (BYTE, BYTE_TOKEN, CONTROL, KEEP_SPACE_AFTER, NORMAL, SPM_SPACE, UNKNOWN,
                         UNUSED, USER_DEFINED, VocabSpec, build_hf, load_cache, token_kinds,
                         write_cache)
from .support.heap import release_free_heap
from .spm_encoder import SpmEncoder

_UNKNOWN_PIECE = "\u2585".encode()  # llama.cpp renders the unknown token as "▅"
# Last resort for tokenizer.json folders whose configs name no bos/eos.
_USUAL_NAMES = {"bos": ["<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>"],
                "eos": ["<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>"]}

# What a Phi-3 special token swallows after it: llama.cpp skips isspace() bytes, ASCII only.
_WHITESPACE_RUN = re.compile(r"[ \t\n\v\f\r]*")

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
    if kind == BYTE and (m := BYTE_TOKEN.fullmatch(text)):
        return bytes([int(m.group(1), 16)])
    if chars is None:
        return text.replace(SPM_SPACE, " ").encode()
    if all(c in chars for c in text):
        return bytes(chars[c] for c in text)
    return text.encode()


# ----------------------------------------------------------------- the tokenizer


class _HfEncoder:
    """Hugging Face `tokenizers` doing the per-text work: tokenizer.json folders and
    byte-level BPE vocabularies."""

    def __init__(self, hf: tokenizers.Tokenizer):
        self.hf = hf
        self._lock = threading.Lock()  # encode_special_tokens is state on the shared object

    def encode(self, text: str, parse_special: bool) -> list[int]:
        with self._lock:
            self.hf.encode_special_tokens = not parse_special
            return self.hf.encode(text, add_special_tokens=False).ids

    def token_id(self, text: str) -> int | None:
        return self.hf.token_to_id(text)

    def encode_text(self, text: str) -> list[int]:
        """`text` with no added token recognized, not even the user-defined ones
        `encode_special_tokens` leaves on: a second tokenizer without them, built once."""
        return self._plain.encode(text, add_special_tokens=False).ids

    @cached_property
    def _plain(self) -> tokenizers.Tokenizer:
        spec = json.loads(self.hf.to_str())
        spec["added_tokens"] = []
        spec["post_processor"] = None
        return tokenizers.Tokenizer.from_str(json.dumps(spec))


class Tokenizer:
    """Text <-> token ids for one model. Build with `from_vocab` or `from_tokenizer_json`."""

    def __init__(self, encoder: SpmEncoder | _HfEncoder, tokens: list[str], pieces: list[bytes],
                 control_ids: set[int], *, bos_id: int | None, eos_id: int | None, add_bos: bool,
                 strip_space: bool, as_hf: Callable[[], tokenizers.Tokenizer],
                 kind: str = "tokenizer.json", origin: str | Path = "",
                 added_texts=(), rstrip_after=()):
        self._encoder = encoder
        self._as_hf = as_hf  # the Hugging Face form, for save_tokenizer_json
        self._tokens = tokens
        self._pieces = pieces
        self.special_ids = frozenset(control_ids)
        # Tokens matched on the raw text rather than made by merges (control, user-defined,
        # unknown), and those that swallow the whitespace after them: `encode_parts` reads them.
        self._added_texts, self._rstrip_after = frozenset(added_texts), frozenset(rstrip_after)
        self.bos_id, self.eos_id = bos_id, eos_id
        self.add_bos = add_bos  # the model's own wish; encode(add_bos=True) honours it
        self._strip_space = strip_space  # undo the space prefix added while encoding
        self.kind = kind  # what it was built from, for `ember info`
        self._origin = origin or kind  # the file it was read from, for errors

    @classmethod
    def from_vocab(cls, spec: VocabSpec, cache_path: Path | None = None,
                   source: str | Path = "GGUF vocabulary") -> Tokenizer:
        """A GGUF vocabulary's tokenizer; `source` names the model file in errors.

        SentencePiece-style ("llama") vocabularies are tokenized directly from their scores
        (models/spm_encoder.py). Others are converted to Hugging Face `tokenizers` once and
        the conversion cached at `cache_path`."""
        kinds = token_kinds(spec)
        origin: str | Path = source
        if spec.model == "llama":
            encoder = SpmEncoder(spec.tokens, spec.scores, kinds, unk_id=spec.unk_id,
                                 add_space_prefix=spec.add_space_prefix,
                                 rstrip_specials=spec.rstrip_specials,
                                 keep_space_after=KEEP_SPACE_AFTER)
            as_hf = partial(build_hf, spec, kinds, str(source))
        else:
            hf = load_cache(Path(cache_path), spec.fingerprint, spec.tokens) if cache_path else None
            if hf is None:
                hf = build_hf(spec, kinds, str(source))
                if cache_path:
                    write_cache(Path(cache_path), spec.fingerprint, hf)
            else:
                origin = cache_path
            release_free_heap()  # parsing leaves its transient allocations in the heap
            encoder, as_hf = _HfEncoder(hf), lambda: hf
        pieces = _token_pieces(spec.tokens, kinds, byte_level=spec.model == "gpt2")
        control = {i for i, k in enumerate(kinds) if k in (CONTROL, UNUSED)}
        strip = spec.add_space_prefix and spec.model == "llama"
        kind = (f"byte-level BPE, pre-tokenizer {spec.pre or 'default'}" if spec.model == "gpt2"
                else "SentencePiece-style BPE")
        added = [t for t, k in zip(spec.tokens, kinds) if k in (CONTROL, USER_DEFINED, UNKNOWN)]
        rstrip = [t for t in added if spec.rstrip_specials and t not in KEEP_SPACE_AFTER]
        return cls(encoder, spec.tokens, pieces, control, bos_id=spec.bos_id, eos_id=spec.eos_id,
                   add_bos=spec.add_bos, strip_space=strip, as_hf=as_hf, kind=kind,
                   origin=origin, added_texts=added, rstrip_after=rstrip)

    @classmethod
    def from_tokenizer_json(cls, path: Path) -> Tokenizer:
        """A Hugging Face model folder (or its tokenizer.json); special ids are best effort."""
        path = Path(path)
        folder, file = (path, path / "tokenizer.json") if path.is_dir() else (path.parent, path)
        hf, raw = _read_tokenizer_json(file)
        release_free_heap()
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
                        BYTE if BYTE_TOKEN.fullmatch(text) and not byte_level else NORMAL)
        pieces = _token_pieces(tokens, kinds, byte_level)
        first = hf.encode("a", add_special_tokens=False).tokens[:1]
        strip = not byte_level and bool(first) and first[0].startswith(SPM_SPACE)
        return cls(_HfEncoder(hf), tokens, pieces, control, bos_id=bos, eos_id=eos,
                   add_bos=add_bos, strip_space=strip, as_hf=lambda: hf, origin=file,
                   added_texts=[t.content for t in added.values()],
                   rstrip_after=[t.content for t in added.values() if t.rstrip])

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    def id_of(self, text: str) -> int | None:
        return self._encoder.token_id(text)

    def token_text(self, token_id: int) -> str:
        """The token as the vocabulary spells it ("<bos>", "▁Hello", "<0x0A>")."""
        return self._tokens[token_id]

    def save_tokenizer_json(self, path: Path) -> None:
        """Write a Hugging Face tokenizer.json that `from_tokenizer_json` reads back."""
        atomic_write_bytes(path, self._as_hf().to_str().encode())

    def encode(self, text: str, add_bos: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids as llama.cpp's llama_tokenize(text, add_special=add_bos, parse_special)."""
        ids = self._encoder.encode(text, parse_special)
        if ids and max(ids) >= len(self._pieces):  # only a tampered tokenizer gets here
            raise ModelFormatError(self._origin, f"the tokenizer gave id {max(ids)}, past the "
                                   f"vocabulary of {len(self._pieces)}: the file is damaged "
                                   "(a cached conversion: delete it and Ember rebuilds it)")
        if add_bos and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def encode_parts(self, parts: list[tuple[str, bool]], add_bos: bool = True) -> list[int]:
        """Ids of the text `parts` join to, where special tokens count only inside the parts
        that are not content: (text, is_content) pairs, as `render_chat_parts` writes them.

        Every added token is covered, not only control ones: a content spelling Qwen's
        "<tool_call>" (user-defined, matched even without parse_special) stays text. The
        joined text is tokenized once between the recognized markers, so merges across a
        content's edges are those of tokenizing the whole prompt."""
        ids, pending, swallow = [], [], False
        for text, is_content in parts:
            pieces = [text] if is_content else self._marker_split(text)
            for n, piece in enumerate(pieces):
                if n % 2:  # a marker the format wrote
                    self._flush(pending, ids)
                    ids.append(self.id_of(piece))
                    swallow = piece in self._rstrip_after
                    continue
                if swallow:  # a Phi-3 style marker eats the whitespace after it
                    piece = piece[_WHITESPACE_RUN.match(piece).end():]
                    swallow = not piece
                pending.append(piece)
        self._flush(pending, ids)
        if add_bos and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def fewest_tokens(self, texts: list[str]) -> int:
        """A lower bound on the tokens `texts` take as text (each at least its bytes over
        the longest token's; what a Phi-3 style marker may swallow not counted)."""
        swallow = bool(self._rstrip_after)
        size = sum(len((t.lstrip() if swallow else t).encode("utf-8", "replace")) for t in texts)
        return -(-size // self._longest_piece)

    @cached_property
    def _longest_piece(self) -> int:
        # An unknown token stands for one character of up to 4 bytes, whatever it shows.
        return max(4, max(map(len, self._pieces), default=0))

    def _flush(self, pending: list[str], ids: list[int]) -> None:
        text = "".join(pending)
        pending.clear()
        if text:
            ids.extend(self._encoder.encode_text(text))

    def _marker_split(self, text: str) -> list[str]:
        """`text` split around the added tokens in it: text, marker, text, ... (odd places)."""
        if self._marker_pattern is None:
            return [text]
        return self._marker_pattern.split(text)

    @cached_property
    def _marker_pattern(self) -> re.Pattern | None:
        if not self._added_texts:
            return None
        longest_first = sorted(self._added_texts, key=len, reverse=True)
        return re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")

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
