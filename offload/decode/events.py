"""What `Engine.stream()` yields: small dataclasses the CLI, the TUI and the benchmarks consume."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Timings:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V the session already held (not prefilled)
    generated_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s: float = 0.0  # request start -> first generated token available
    decode_s: float = 0.0  # first token -> last token

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, over the time spent producing them."""
        n = self.generated_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prefill_tokens_per_s"] = self.prefill_tokens_per_s
        d["decode_tokens_per_s"] = self.decode_tokens_per_s
        return d


@dataclass
class TokenEvent:
    """One generated token and the text it completes (never half a UTF-8 character).

    `token_id` is None for the last event of a stream when it only releases held-back text
    (the end of a partial stop string, or a dangling incomplete character).
    """

    token_id: int | None
    text: str
    # With SamplingParams.logprobs: the draw's `decode.sampler.TokenLogprob`
    logprob: object | None = None


@dataclass
class DoneEvent:
    """Generation ended: `finish_reason` is "eos", "stop", "length", "context" or "cancelled"."""

    finish_reason: str
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    timings: Timings = field(default_factory=Timings)
