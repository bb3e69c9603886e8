"""Constrained decoding: a grammar's token mask, computed by llguidance, applied in the sampler.

llguidance compiles a JSON schema, a regex, a Lark or a GBNF grammar against the model's vocabulary
(`GrammarVocabulary`: Ember's token bytes, control tokens marked special) and, for each
step, says which tokens keep the text inside the grammar. The sampler lowers every other
token to -inf before anything draws, so plain decoding and speculative verification (which
calls the same sampler at every tree node) draw the same tokens: a draft that breaks the
grammar can never match the target's draw and is rejected. Once the grammar is complete
only the end-of-turn tokens remain allowed.
"""

from __future__ import annotations

import json
import threading
from typing import Sequence

import numpy as np
import torch

from ember.models.support.errors import ConfigError
from ember.models.tokenizer import Tokenizer

from ..options.sampling import Grammar

# JSON written as models write it (and as json.dumps does): ", " and ": ", no free whitespace
# (which a model could fill forever).
JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class GrammarVocabulary:
    """The model's vocabulary as llguidance reads it (its `TokenizerWrapper` protocol):
    each token's bytes, control and marker tokens as 0xFF + their name (so a grammar can
    name them, as `<tool_call>`, but never spells them out of text), and tokenization."""

    def __init__(self, tokenizer: Tokenizer, stop_ids: set[int]):
        self._tokenizer = tokenizer
        stops = sorted(stop_ids)
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id in stop_ids else stops[0]
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = sorted(tokenizer.special_ids)
        self.tokens = [self._bytes(i) for i in range(tokenizer.vocab_size)]
        self.stop_ids = stops

    def _bytes(self, i: int) -> bytes:
        text, raw = self._tokenizer.token_text(i), self._tokenizer.token_bytes(i)
        marker = text.startswith("<") and text.endswith(">") and raw == text.encode()
        return b"\xff" + text.encode() if i in self._tokenizer.special_ids or marker else raw

    def __call__(self, text: str) -> list[int]:
        # Text, with no marker recognized in it: llguidance tokenizes forced text this way.
        return self._tokenizer.encode_parts([(text, True)], add_bos=False)


def ll_tokenizer(vocabulary: GrammarVocabulary):
    """llguidance's tokenizer for the vocabulary (about a second for 150k tokens: build once)."""
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary),
                                  eos_token=vocabulary.stop_ids)


def compile_grammar(grammar: Grammar, ll_tok) -> str:
    """llguidance's grammar for `grammar`, checked against the vocabulary; ConfigError with
    llguidance's reason when it cannot be compiled."""
    import llguidance

    try:
        if grammar.kind == "json_schema":
            text = llguidance.LLMatcher.grammar_from_json_schema(
                grammar.source, defaults=JSON_STYLE)
        elif grammar.kind == "regex":
            text = llguidance.LLMatcher.grammar_from_regex(grammar.source)
        elif grammar.kind == "gbnf":  # converted to Lark by llguidance (Lark passes as is)
            text = llguidance.grammar_from("gbnf", grammar.source)
        else:
            text = llguidance.LLMatcher.grammar_from_lark(grammar.source)
    except (ValueError, json.JSONDecodeError) as exc:
        raise ConfigError(f"the {grammar.kind} cannot be compiled: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(text, ll_tok)
    if error and not error.startswith("WARNING"):
        raise ConfigError(f"the {grammar.kind} cannot be compiled: {_one_line(error)}")
    return text


class Grammars:
    """One model's grammars: llguidance's view of its vocabulary (built on first use: about a
    second for 150k tokens) and the latest few compiled grammars (a client repeats its
    schema). Thread-safe: a server checks requests' grammars while its worker generates."""

    KEEP = 16

    def __init__(self, tokenizer: Tokenizer, stop_ids: set[int]):
        self._tokenizer, self._stop_ids = tokenizer, stop_ids
        self._ll_tok = None
        self._compiled: dict[Grammar, str] = {}
        self._lock = threading.Lock()

    def compile(self, grammar: Grammar) -> str:
        """llguidance's grammar text; ConfigError when it cannot be compiled."""
        with self._lock:
            if self._ll_tok is None:
                self._ll_tok = ll_tokenizer(GrammarVocabulary(self._tokenizer, self._stop_ids))
            if grammar not in self._compiled:
                if len(self._compiled) >= self.KEEP:
                    self._compiled.pop(next(iter(self._compiled)))
                self._compiled[grammar] = compile_grammar(grammar, self._ll_tok)
            return self._compiled[grammar]

    def constraint(self, grammar: Grammar, n_logits: int) -> GrammarConstraint:
        """A fresh matcher for one reply."""
        return GrammarConstraint(self.compile(grammar), self._ll_tok, n_logits)


class GrammarConstraint:
    """One reply's matcher (the sampler's `Constraint`): fed the generated tokens as they
    come, it sets the logits of every token that may not follow to -inf. `n_logits`: the width of the model's logits (a vocabulary
    padded past the tokenizer's: the padding is never allowed)."""

    def __init__(self, compiled: str, ll_tok, n_logits: int):
        import llguidance

        self._matcher = llguidance.LLMatcher(ll_tok, compiled, log_level=0)
        if self._matcher.is_error():
            raise ConfigError(f"the grammar cannot be used: {_one_line(self._matcher.get_error())}")
        # One bit per token, 32 to a word (llguidance.torch's layout; that module is not
        # imported: it compiles a kernel with torch.compile when loaded).
        self._bitmask = np.zeros((ll_tok.vocab_size + 31) // 32, dtype=np.int32)
        self._n_vocab, self._n_logits = ll_tok.vocab_size, n_logits
        self._consumed: list[int] = []

    def apply(self, logits: torch.Tensor, generated: Sequence[int]) -> None:
        self._catch_up(generated)
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        # Bit i of the mask is token i (little-endian words); numpy does this in a fraction
        # of a millisecond where torch's bool ops on 150k entries cost several.
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        banned = np.ones(self._n_logits, dtype=bool)
        n = min(self._n_vocab, self._n_logits)
        banned[:n] = bits[:n] == 0
        if logits.device.type == "cpu":
            np.copyto(logits.numpy(), -np.inf, where=banned)
        else:
            logits.masked_fill_(torch.from_numpy(banned).to(logits.device), float("-inf"))

    def _catch_up(self, generated: Sequence[int]) -> None:
        """Make the matcher hold exactly `generated` (a sampler sees each history grow;
        rolled back only if a caller went back)."""
        done = len(self._consumed)
        if list(generated[:done]) != self._consumed:
            keep = next((i for i, (a, b) in enumerate(zip(self._consumed, generated)) if a != b),
                        len(generated))
            self._matcher.rollback(done - keep)
            del self._consumed[keep:]
        for token in generated[len(self._consumed):]:
            if not self._matcher.consume_token(token):
                raise ConfigError(f"the grammar rejects token {token}: "
                                  f"{_one_line(self._matcher.get_error())}")
            self._consumed.append(token)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:500]
