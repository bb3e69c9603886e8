"""How the next token is drawn: the settings and their defaults, checked when made.

The CLI's sampling flags, the chat app's per-conversation settings and the server's unset
fields all take their defaults from `SamplingParams()`: llama.cpp's defaults (top-k 40,
top-p 0.95, min-p 0.05, temperature 0.8), so the same settings mean the same in both.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.models.support.errors import ConfigError


MAX_TOP_LOGPROBS = 20  # OpenAI's limit
GRAMMAR_KINDS = ("json_schema", "lark", "gbnf", "regex")


@dataclass(frozen=True)
class Grammar:
    """What the reply must match: a JSON schema (as JSON text), a Lark grammar in
    llguidance's dialect, a GBNF grammar (llama.cpp's; Lark accepted too), or a regular
    expression. Compiled by `decode.grammar`."""

    kind: str
    source: str

    def __post_init__(self):
        if self.kind not in GRAMMAR_KINDS:
            raise ConfigError(f"unknown grammar kind {self.kind!r}; one of {GRAMMAR_KINDS}")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40  # 0 disables
    top_p: float = 0.95  # 1.0 disables
    min_p: float = 0.05  # 0.0 disables
    repeat_penalty: float = 1.0  # 1.0 disables
    repeat_last_n: int = 64
    seed: int | None = None
    # OpenAI's penalties, over the tokens generated so far: a token's logit minus
    # count * frequency_penalty, and presence_penalty once it appeared at all.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # None: no log-probabilities; k >= 0: the chosen token's and the k likeliest (Sampler)
    logprobs: int | None = None
    grammar: Grammar | None = None  # constrained decoding: only tokens the grammar allows

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top-p must be in (0, 1] (1 disables it), got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ConfigError(f"min-p must be in [0, 1) (0 disables it), got {self.min_p}")
        if not self.repeat_penalty > 0:
            raise ConfigError(f"repeat penalty must be > 0 (1 disables it), got {self.repeat_penalty}")
        if self.repeat_last_n < 0:
            raise ConfigError(f"repeat-last-n must be >= 0, got {self.repeat_last_n}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ConfigError(f"{name} must be between -2 and 2, got {getattr(self, name)}")
        for token, bias in self.logit_bias:
            if token < 0 or not -100 <= bias <= 100:
                raise ConfigError(f"logit_bias: token ids are >= 0 and biases between -100 and "
                                  f"100, got {token}: {bias}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ConfigError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got "
                              f"{self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams(temperature=0.0)
