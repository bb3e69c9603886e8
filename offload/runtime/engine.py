"""The Engine: load a model, turn prompts into token ids, stream generated tokens as events.

Layers, innermost first: `Runner` (prefill / decode), `decode_loop` with a plain or a
speculative step (token ids and the finish reason), `reply_events` (text deltas, stop
strings, timings), `stream()` (one reply's events), `generate()` (blocking helper). The CLI,
the TUI and the benchmarks all consume `stream()`.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Iterator

from ember.kernels.block_matmul import reads_row_groups
from ember.models.chat_format import (NON_TEXT_TOKENS, ChatFormat, ChatMessage,
                                      template_tool_style)
from ember.models.support.errors import ConfigError, PromptTooLong
from ember.models.loader import OPEN_SHARE, LoadedModel, load_model
from ember.models.tokenizer import StreamDecoder

from ..body.file_blocks_model import runs_on_file_blocks
from ..decode.events import DoneEvent, Timings, TokenEvent
from ..decode.loop import PlainStep, Step, decode_loop
from ..decode.runner import Runner
from ..decode.grammar import Grammars
from ..decode.sampler import Sampler
from ..decode.stopping import StopStrings
from ..kv.paged import PagedKVCache
from ..kv.plan import DEFAULT_ROLLBACK_MARGIN, plan_kv
from ..speculative.setup import make_drafter
from ..speculative.verify import SpecStats, SpeculativeStep, TreeSizer
from .device import resolve_device, set_threads
from .context_fit import LEADING_ROLES, fit_conversation
from .engine_model import build_engine_model, kv_value_bytes
from ..options.engine_options import EngineOptions
from ..options.sampling import SamplingParams
from .prompts import ChatPrompt, PromptEncoder
from .replies import reply_events
from .resources import context_size, memory_check, weights_in_ram


class Engine:
    def __init__(self, loaded: LoadedModel, options: EngineOptions = EngineOptions()):
        set_threads(options.threads)
        self.loaded = loaded
        self.device = resolve_device(options.device)
        # the model's trained length unless asked otherwise, capped by what RAM holds
        self.context = context_size(loaded.source, options, self.device)
        n_ctx = self.context.tokens
        self.kv_plan = plan_kv(loaded.config, n_ctx, options.kv_budget, options.kv_host_budget,
                               options.kv_block_size, kv_value_bytes(options, self.device))
        built = build_engine_model(loaded, options, self.device, self.kv_plan, n_ctx)
        self.kv_dtype = built.kv_dtype  # the plan's width (attention's type where it moved)
        self.model, self.weights, self.lm_head = built.model, built.weights, built.lm_head
        self.hybrid, self.input_sparsity = built.hybrid, built.input_sparsity
        self.profile_path, self.profile_quality = built.profile_path, built.profile_quality
        self.tokenizer = loaded.tokenizer
        self.stop_ids = set(loaded.source.stop_ids)
        # Image markers some vocabularies file as text: generated, they are never shown.
        self.hidden_ids = {i for t in NON_TEXT_TOKENS
                           if (i := self.tokenizer.id_of(t)) is not None}
        self.prompts = PromptEncoder(self.tokenizer, loaded.source.chat_template, self.stop_ids)
        self.chat_format = self.resolve_chat_format(options.chat_format)
        self.kv = PagedKVCache.of_plan(loaded.config, self.kv_plan, built.compute,
                                       built.kv_dtype, DEFAULT_ROLLBACK_MARGIN, built.host_kv)
        self.runner = Runner(self.model, self.kv, n_ctx)
        self.options = options
        self.drafter, self.tree_widths = make_drafter(self, options)
        # One sizer for the engine's life: what a step and a drafted level cost are properties
        # of the machine and model, not of one reply, so later replies start well estimated.
        self.sizer = TreeSizer(self.tree_widths)
        self._spec_stats: SpecStats | None = None  # the latest stream's, with a drafter
        self.grammars = Grammars(self.tokenizer, self.stop_ids)  # constrained decoding

    @property
    def speculation(self) -> dict | None:
        """The latest stream's `SpecStats.to_dict()` (None before one, or with no drafter)."""
        return None if self._spec_stats is None else self._spec_stats.to_dict()

    def input_sparsity_report(self) -> dict | None:
        """Sparsity the profile's input thresholds realized per layer and matmul since the
        engine started (or the last reset), and the bytes of the body they skip."""
        if self.input_sparsity is None:
            return None
        dense, read = self.input_sparsity.bytes_per_token()
        return {"profile": str(self.profile_path), **self.input_sparsity.realized(),
                "body_bytes_dense": dense, "body_bytes_read": read,
                "layout_bytes": self.input_sparsity.layout_bytes(),
                "file_bytes_released": sum(self.input_sparsity.released.values())}

    def hybrid_report(self) -> dict | None:
        """The GPU-tier plan and measured per-layer FFN work (None for a dense engine), and
        with a profile, its path and the quality its end-to-end check measured."""
        if self.hybrid is None:
            return None
        report = self.hybrid.report()
        graphs = getattr(self.model, "decode_graphs", None)
        report["tier_kernels"]["decode_graphs"] = graphs() if graphs else None
        if self.profile_path is not None:
            report["profile"] = {"path": str(self.profile_path), **(self.profile_quality or {})}
        return report

    def close(self) -> None:
        """Stop the CPU worker thread (the engine is unusable afterwards)."""
        if self.hybrid is not None:
            self.hybrid.close()

    @classmethod
    def load(cls, model_path: str | Path | None = None, options: EngineOptions = EngineOptions(),
             progress: Callable[[float, str], None] | None = None):
        """Load the model and build the engine around it.

        `progress(fraction, stage)`, if given, is called as loading goes on (see `load_model`);
        the last call is (1.0, "ready"), once the engine is built.
        """
        if model_path is None:
            from ember.models.default_model import default_model_path

            model_path = default_model_path()
        report = progress or (lambda fraction, stage: None)
        # Building the weights is most of the work; the rest (split, KV pool, drafter) after.
        # On the file's blocks nothing is built: opening the file (and reading it into RAM)
        # is all of the loader's share.
        float_model = not runs_on_file_blocks(options, resolve_device(options.device))
        scale = 0.95 if float_model else 0.95 / OPEN_SHARE
        loaded = load_model(model_path, check=memory_check(options),
                            progress=lambda fraction, stage: report(
                                min(0.95, scale * fraction), stage),
                            in_ram=weights_in_ram(options),
                            row_groups=not float_model and reads_row_groups())
        if float_model:
            loaded.model  # built now, inside the progress it reports layer by layer
        report(0.95, "placing the model")
        engine = cls(loaded, options)
        report(1.0, "ready")
        return engine

    @property
    def n_ctx(self) -> int:
        return self.runner.n_ctx

    # -- prompts ------------------------------------------------------------------------
    def encode(self, text: str, parse_special: bool = False) -> list[int]:
        return self.prompts.encode(text, parse_special)

    def resolve_chat_format(self, choice: str) -> ChatFormat:
        """What a --chat-format choice means for this model (ConfigError if it cannot be)."""
        return self.prompts.resolve_chat_format(choice)

    def encode_chat(self, messages: list[ChatMessage], chat_format: str | None = None,
                    tools: list | None = None) -> ChatPrompt:
        """The conversation in this engine's chat format (or in `chat_format`, a
        --chat-format choice), as token ids that carry the format (so `stream()` ends the
        reply at its stop strings). `tools`: function definitions for the template to write
        (see `tool_style`)."""
        fmt = self.chat_format if chat_format is None else self.resolve_chat_format(chat_format)
        return self.prompts.encode_chat(messages, fmt, tools)

    @property
    def tool_style(self) -> str | None:
        """The tool-call syntax this engine's chat format writes and reads ("hermes",
        "llama3" or "mistral": `template_tool_style`), or None when it has no tool support."""
        if self.chat_format.name != "template":
            return None
        return template_tool_style(self.prompts.chat_template)

    def fit_chat(self, messages: list[ChatMessage], reply_tokens: int,
                 chat_format: str | None = None, tools: list | None = None) -> ChatPrompt:
        """`encode_chat` for a conversation that may have outgrown the context: its oldest
        exchanges are left out until the prompt and room for the reply fit (the policy and
        its cost: offload/runtime/context_fit.py); `dropped_messages` on the result says
        how many. PromptTooLong only if the newest message cannot fit even alone."""
        lead = next((i for i, m in enumerate(messages) if m.role not in LEADING_ROLES),
                    len(messages))
        kept = messages[:lead] + messages[max(lead, len(messages) - 1):]
        self.check_text_fits([m.content for m in kept])  # what no dropping can save
        return fit_conversation(messages, lambda kept: self.encode_chat(kept, chat_format, tools),
                                self.n_ctx, reply_tokens)

    def check_text_fits(self, texts: list[str]) -> None:
        """PromptTooLong when `texts`' bytes alone prove they cannot fit the context (no
        token stands for more bytes than the vocabulary's longest): a hostile 10 MB prompt
        is refused without spending seconds tokenizing it."""
        fewest = self.tokenizer.fewest_tokens(texts)
        if fewest >= self.n_ctx:
            raise PromptTooLong(f"the prompt is at least {fewest} tokens long by its bytes "
                                f"alone, but the context holds "
                                f"{self.n_ctx} for the prompt and its reply together; "
                                "shorten it or raise --ctx-size")

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """The rules a prompt must meet before it runs: not empty, room left in the context
        for one generated token (`PromptTooLong` otherwise), ids inside the vocabulary."""
        self.runner.check_prompt(prompt_ids)

    # -- conversations ------------------------------------------------------------------
    # A session is one conversation's KV cache, named by the caller. `stream()` extends it,
    # prefilling only what a prompt adds past the ids it already holds.
    def conversation_tokens(self, session: str) -> list[int]:
        """The token ids whose K/V the session holds (empty for one never used)."""
        return list(self.runner.tokens(session))

    def forget(self, session: str) -> None:
        """Free the session's KV cache: its next prompt is prefilled from the start."""
        self.runner.reset(session)

    def prefill(self, session: str, prompt_ids: list[int]) -> None:
        """Make the session hold `prompt_ids` without generating (a conversation made ready
        ahead of its next turn); reuses what it already holds, as `stream()` does."""
        self.runner.prefill(session, list(prompt_ids))

    def park(self, session: str) -> None:
        """Move the session's KV cache to the host pool, as happens when another conversation
        needs the device pool; its next use swaps it back in."""
        self.kv.swap_out(self.runner.session(session).seq_id)

    # -- generation ---------------------------------------------------------------------
    def stream(self, prompt_ids: list[int], sampling: SamplingParams = SamplingParams(),
               max_tokens: int = 256, stop: tuple[str, ...] = (), ignore_eos: bool = False,
               cancel: threading.Event | None = None,
               session: str = "default") -> Iterator[TokenEvent | DoneEvent]:
        """Generate after `prompt_ids`, yielding a TokenEvent per token and one DoneEvent.

        `session` names the conversation whose KV cache to extend (one per chat); a prompt
        that starts with what the session already holds prefills only the rest.

        Stops at an end-of-sequence/end-of-turn token (unless `ignore_eos`), a `stop` string
        (a `ChatPrompt` adds its format's), `max_tokens`, a full context, or when `cancel` is
        set (checked before each prompt chunk and every token). Control and image-marker tokens
        show no text.

        Returns the events' generator rather than being one, so while a token is computed the
        stack holds only the generators doing the work (ARCHITECTURE.md counts them).
        """
        timings = Timings(prompt_tokens=len(prompt_ids))
        fmt = prompt_ids.format if isinstance(prompt_ids, ChatPrompt) else ChatFormat("none")
        stops = StopStrings([*stop, *fmt.stop_strings], strip_leading=fmt.strip_leading_space)
        stop_ids = set() if ignore_eos else self.stop_ids
        self.check_sampling(sampling)
        if sampling.grammar is not None and ignore_eos:
            raise ConfigError("a grammar ends the reply where it is complete: it cannot be "
                              "combined with ignore_eos")
        constraint = (None if sampling.grammar is None else
                      self.grammars.constraint(sampling.grammar, self.loaded.config.vocab_size))
        sampler = Sampler(sampling, len(prompt_ids), constraint)
        tokens = decode_loop(self.runner, session, self._step(session, sampler),
                             prompt_ids, max_tokens, stop_ids, timings, cancel)
        return reply_events(tokens, StreamDecoder(self.tokenizer), stops, self.hidden_ids,
                            prompt_ids, timings, sampler.logprobs)

    def check_sampling(self, sampling: SamplingParams) -> None:
        """ConfigError for settings this model cannot honour (a logit_bias id past its
        vocabulary, a grammar llguidance cannot compile); the rest SamplingParams checks."""
        bad = [t for t, _ in sampling.logit_bias if t >= self.tokenizer.vocab_size]
        if bad:
            raise ConfigError(f"logit_bias names token {bad[0]}, past this model's vocabulary "
                              f"of {self.tokenizer.vocab_size}", setting="logit_bias")
        if sampling.grammar is not None:
            self.grammars.compile(sampling.grammar)

    def _step(self, session: str, sampler: Sampler) -> Step:
        """This engine's decode step: speculative with a drafter (fresh stats per reply),
        else plain."""
        if self.drafter is None:
            return PlainStep(self.runner, session, sampler)
        self._spec_stats = SpecStats(self.drafter.name)
        return SpeculativeStep(self.runner, session, sampler, self.drafter, self.sizer,
                               self._spec_stats)

    def kv_usage(self) -> dict:
        """Blocks used/free on each tier, swaps (count, bytes, seconds), dropped sessions."""
        return {**self.kv.usage(), "plan": self.kv_plan.to_dict()}

    def generate(self, prompt_ids: list[int], **kwargs) -> DoneEvent:
        """Blocking helper: run `stream()` to the end and return its DoneEvent."""
        done = None
        for event in self.stream(prompt_ids, **kwargs):
            if isinstance(event, DoneEvent):
                done = event
        return done
