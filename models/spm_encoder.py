"""llama.cpp's SentencePiece-style ("llama" vocabulary) tokenization, computed directly from
the vocabulary's scores.

Ember used to convert these vocabularies to a Hugging Face BPE model whose merges are every
split of every token (514k merges for the default model's 262k tokens). Loading that took
1.2-1.5 s and ~50 MB on every start, with a ~350 MB transient peak. The algorithm itself
needs only a text -> id map and the scores, built in ~0.1 s:

1. Special tokens are split out of the raw text first, leftmost-longest: user-defined ones
   always, control and unknown ones only with parse_special (llama.cpp's
   tokenizer_st_partition).
2. Each remaining fragment (with "▁" for spaces, and a leading "▁" after the start or a
   special token when the vocabulary asks for a space prefix) starts as one symbol per
   character. Repeatedly, the adjacent pair whose concatenation is the vocabulary token
   with the highest score is merged; ties go to the leftmost pair.
3. Every final symbol is its token; a character the vocabulary lacks falls back to the
   <0xXX> tokens of its UTF-8 bytes.

tests/test_tokenizer.py checks this against a plain quadratic rewrite of the same rules,
against llama.cpp's own ids (fixtures) and against Hugging Face `tokenizers` running the
converted merges.
"""

from __future__ import annotations

import heapq
import re
from functools import cached_property

from .gguf_vocab import BYTE, CONTROL, SPM_SPACE, UNKNOWN, USER_DEFINED

# What a Phi-3 special token swallows after it: llama.cpp skips isspace() bytes, ASCII only.
_WHITESPACE_RUN = re.compile(r"[ \t\n\v\f\r]*")


class SpmEncoder:
    """Text -> ids for one "llama" vocabulary. Holds no per-call state: thread-safe."""

    def __init__(self, tokens: list[str], scores, kinds: list[int], *, unk_id: int | None,
                 add_space_prefix: bool, rstrip_specials: bool = False,
                 keep_space_after: frozenset[str] = frozenset()):
        self._ids = {t: i for i, t in enumerate(tokens)}  # later duplicates win, as in llama.cpp
        # Negated once: the merge heap is a min-heap, and the best score merges first.
        self._neg_scores = [0.0] * len(tokens) if scores is None else [-float(s) for s in scores]
        self._tokens, self._kinds = tokens, kinds
        self._unk_id = unk_id
        self._space_prefix = add_space_prefix
        self._rstrip = rstrip_specials
        self._keep_space_after = keep_space_after
        # A byte token's text ("<0x41>") is not text: it never takes part in a merge.
        self._byte_texts = {t for t, k in zip(tokens, kinds) if k == BYTE}
        self._byte_text_lengths = {len(t) for t in self._byte_texts}
        self._byte_ids = [self._ids.get(f"<0x{b:02X}>") for b in range(256)]

    # -- special tokens -------------------------------------------------------------------
    def _splitter(self, kinds: frozenset[int]) -> tuple[re.Pattern | None, dict[str, int]]:
        """A pattern matching the special tokens of `kinds` leftmost-longest (alternatives
        longest first), and their ids."""
        specials = {t: self._ids[t] for t, k in zip(self._tokens, self._kinds) if k in kinds and t}
        if not specials:
            return None, specials
        longest_first = sorted(specials, key=len, reverse=True)
        return re.compile("|".join(map(re.escape, longest_first))), specials

    @cached_property
    def _user_splitter(self):
        return self._splitter(frozenset({USER_DEFINED}))

    @cached_property
    def _special_splitter(self):
        return self._splitter(frozenset({USER_DEFINED, CONTROL, UNKNOWN}))

    # -- encoding -------------------------------------------------------------------------
    def encode(self, text: str, parse_special: bool = False) -> list[int]:
        pattern, specials = self._special_splitter if parse_special else self._user_splitter
        out: list[int] = []
        prev_special, pos = True, 0  # the start counts as "after a special token"
        while pattern is not None and (m := pattern.search(text, pos)):
            if m.start() > pos:
                self._encode_fragment(text[pos:m.start()], prev_special, out)
            out.append(specials[m.group()])
            prev_special, pos = True, m.end()
            if self._rstrip and m.group() not in self._keep_space_after:
                pos = _WHITESPACE_RUN.match(text, pos).end()  # swallowed, as in Phi-3
        if pos < len(text):
            self._encode_fragment(text[pos:], prev_special, out)
        return out

    def encode_text(self, text: str) -> list[int]:
        """`text` as one fragment after a marker: no special token recognized in it."""
        out: list[int] = []
        self._encode_fragment(text, True, out)
        return out

    def _encode_fragment(self, fragment: str, prefix: bool, out: list[int]) -> None:
        text = fragment.replace(" ", SPM_SPACE)
        if prefix and self._space_prefix:
            text = SPM_SPACE + text
        n = len(text)
        ids, neg_scores = self._ids, self._neg_scores
        bytes_only, byte_lengths = self._byte_texts, self._byte_text_lengths
        length = [1] * n  # characters in the symbol starting here; 0 once merged away
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prev = list(range(-1, n - 1))

        def is_byte_token(start: int) -> bool:
            return length[start] in byte_lengths and text[start:start + length[start]] in bytes_only

        # A heap entry: (-score, left, right, size): max score first, then the leftmost pair;
        # `size` spots pairs whose sides changed since. The first pairs, one lookup each in C.
        pair_tokens = map(ids.get, map(str.__add__, text, text[1:]))
        heap = [(neg_scores[t], i, i + 1, 2) for i, t in enumerate(pair_tokens) if t is not None]
        if 1 in byte_lengths:  # a vocabulary with one-character byte tokens (none known)
            heap = [h for h in heap if not is_byte_token(h[1]) and not is_byte_token(h[2])]
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            _, left, right, size = pop(heap)
            if length[left] == 0 or length[right] == 0 or length[left] + length[right] != size:
                continue  # one side was merged into something else meanwhile
            length[left], length[right] = size, 0
            nxt[left] = after = nxt[right]
            if after >= 0:
                prev[after] = left
            for a, b in ((prev[left], left), (left, after)):
                if a < 0 or b < 0:
                    continue
                pair = length[a] + length[b]
                token = ids.get(text[a:a + pair])
                if token is not None and not (is_byte_token(a) or is_byte_token(b)):
                    push(heap, (neg_scores[token], a, b, pair))

        i = 0
        while i >= 0:
            piece = text[i:i + length[i]]
            token = ids.get(piece)
            if token is not None:
                out.append(token)
            else:
                out.extend(self._fallback(piece))
            i = nxt[i]

    def _fallback(self, piece: str) -> list[int]:
        """A character the vocabulary lacks: its UTF-8 bytes as <0xXX> tokens, else the
        unknown token (a vocabulary without byte tokens)."""
        ids = [self._byte_ids[b] for b in piece.encode("utf-8", "surrogatepass")]
        if None not in ids:
            return ids
        if self._unk_id is None:
            return []
        return [self._unk_id]

    def token_id(self, text: str) -> int | None:
        return self._ids.get(text)
