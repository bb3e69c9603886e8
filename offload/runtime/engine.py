"""The Engine: load a model, turn prompts into token ids, stream generated tokens as events.

Layers, innermost first: `Runner` (prefill / decode), `decode_loop` with a plain or a
speculative step (token ids and the finish reason), `stream()` (text deltas, stop strings,
timings, events), `generate()` (blocking helper). The CLI, the TUI and the benchmarks all
consume `stream()`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator


from ember.models.chat_format import (CHAT_FORMATS, NON_TEXT_TOKENS, ChatFormat, ChatMessage,
                                      render_chat, resolve_chat_format)
from ember.models.errors import ConfigError
from ember.models.loader import OPEN_SHARE, LoadedModel, load_model
from ember.models.tokenizer import StreamDecoder

from .device import resolve_device, set_threads
from ..decode.events import DoneEvent, Timings, TokenEvent
from ..hybrid.setup import (UNLIMITED, HostLMHead, HybridModel, attach_predictors, build_hybrid,
                           profile_chooser, profile_predictors, resolve_cold_dtype,
                           restore_dense, split_ffns)
from ..kv.plan import DEFAULT_BLOCK_SIZE, DEFAULT_ROLLBACK_MARGIN, plan_kv
from ..hybrid.memory_plan import SPLITS
from .profile_file import default_profile_path, load_profile
from ..body.input_sparsity import apply_input_sparsity
from ..body.quant_model import QuantModel, kv_dtype, runs_on_file_blocks
from ..kv.paged import PagedKVCache
from .resources import memory_check, weights_in_ram
from ..decode.loop import PlainStep, Step, decode_loop
from ..decode.runner import Runner
from ..decode.sampler import Sampler, SamplingParams
from ..speculative.verify import SpecStats, SpeculativeStep, TreeSizer
from ..speculative.setup import SPECULATE_CHOICES, make_drafter
from ..hybrid.tier_dtypes import TIER_CHOICES, TierChoice
from ..speculative.token_tree import parse_tree
from ..decode.stopping import StopStrings

DEFAULT_CTX = 4096
FFN_MODES = ("auto", "dense", "sparse")
MMAP_CHOICES = ("auto", "on", "off")
# --weights: "auto" the file's own blocks (QuantModel) where the kernels are built, "fp32" the
# float32 reference (what perplexity comparisons are made against).
WEIGHT_CHOICES = ("auto", "fp32")
# Choices that once selected the requantized Q8_0 copies of the float32 model (issue 21).
REMOVED_WEIGHTS = {"q8": "removed: the default runtime (--weights auto) reads the file's own "
                         "blocks; --weights fp32 runs the float32 reference"}


@dataclass(frozen=True)
class EngineOptions:
    device: str = "auto"
    n_ctx: int = DEFAULT_CTX  # capped at the model's own context length
    threads: int | None = None
    kv_budget: int | None = None  # device KV pool in bytes; None: one full-length context
    kv_host_budget: int | None = None  # host-RAM pool for swapped-out conversations
    kv_block_size: int = DEFAULT_BLOCK_SIZE
    weights: str = "auto"  # WEIGHT_CHOICES: the file's own blocks, or the float32 reference
    # Hybrid FFN: a GPU-tier byte budget splits FFN layers into hot (GPU tier) and cold
    # (host) neurons; None with split "auto" runs the dense model on one device.
    gpu_budget: int | None = None
    split: str = "auto"  # "auto" | "cpu-only" | "gpu-only" (see memory_plan)
    cold_dtype: str = "auto"  # host-side FFN rows: "fp32", "int8", "auto" (int8 with a q8 body)
    # GPU-tier hot rows: "auto" (by file type and device: int4/int8/fp16, tier_dtypes.py) or
    # one format for every matrix ("int4", "int8", "fp16", "bf16", "fp32").
    tier_dtype: str = "auto"
    # A profile artifact (`ember profile`): its placement guides the split and its
    # predictors gate the cold side. ffn_mode "auto" runs sparse when a profile is given.
    profile: str | None = None  # a path, "auto" (this model's default profile if any) or None
    ffn_mode: str = "auto"  # "auto" | "dense" (every neuron) | "sparse" (predictor-gated)
    # Speculative decoding (lossless): "off", "self", "lookup" or "model" (with draft_model);
    # tree: expansion per depth such as "1,1,3,1" (None: the drafter's default).
    speculate: str = "off"
    tree: str | None = None
    draft_model: str | None = None
    # How `encode_chat` writes a conversation: "auto" (the file's template, else a transcript
    # a base model continues), "template", "transcript" or a family format ("gemma", ...).
    chat_format: str = "auto"
    # Where the file's bytes live: "on" the memory map, "off" a copy in RAM on huge pages
    # (faster decode), "auto" the copy when the file fits easily in free RAM and the FFNs
    # are not split (resources.reads_weights_into_ram).
    mmap: str = "auto"

    def __post_init__(self):
        if self.mmap not in MMAP_CHOICES:
            raise ConfigError(f"unknown --mmap {self.mmap!r}; choose one of {', '.join(MMAP_CHOICES)}")
        if self.chat_format not in CHAT_FORMATS:
            raise ConfigError(f"unknown --chat-format {self.chat_format!r}; choose one of "
                              f"{', '.join(CHAT_FORMATS)}")
        if self.speculate not in SPECULATE_CHOICES:
            raise ConfigError(f"unknown --speculate {self.speculate!r}; choose one of "
                              f"{', '.join(SPECULATE_CHOICES)}")
        if (self.speculate == "model") != (self.draft_model is not None):
            raise ConfigError("--speculate model needs --draft-model PATH, and --draft-model "
                              "needs --speculate model")
        if self.tree is not None:
            parse_tree(self.tree)
        if self.n_ctx < 1:
            raise ConfigError(f"--ctx-size must be at least 1, got {self.n_ctx}")
        if self.weights in REMOVED_WEIGHTS:
            raise ConfigError(f"--weights {self.weights}: {REMOVED_WEIGHTS[self.weights]}")
        if self.weights not in WEIGHT_CHOICES:
            raise ConfigError(f"unknown --weights {self.weights!r}; choose one of "
                              f"{', '.join(WEIGHT_CHOICES)}")
        if self.ffn_mode not in FFN_MODES:
            raise ConfigError(f"unknown --ffn-mode {self.ffn_mode!r}; choose one of "
                              f"{', '.join(FFN_MODES)}")
        if self.ffn_mode == "sparse" and self.profile is None:
            raise ConfigError("--ffn-mode sparse needs --profile (the predictors come from "
                              "`ember profile`)")
        if self.tier_dtype not in TIER_CHOICES:
            raise ConfigError(f"unknown --tier-dtype {self.tier_dtype!r}; choose one of "
                              f"{', '.join(TIER_CHOICES)}")
        if self.split not in SPLITS:
            raise ConfigError(f"unknown --split {self.split!r}; choose one of {', '.join(SPLITS)}")
        if self.gpu_budget is not None and self.gpu_budget < 0:
            raise ConfigError("--gpu-budget must not be negative")


class Engine:
    def __init__(self, loaded: LoadedModel, options: EngineOptions = EngineOptions()):
        set_threads(options.threads)
        self.loaded = loaded
        self.device = resolve_device(options.device)
        n_ctx = min(options.n_ctx, loaded.config.context_length)
        self.kv_dtype = kv_dtype(options, self.device)
        self.kv_plan = plan_kv(loaded.config, n_ctx, options.kv_budget, options.kv_host_budget,
                               options.kv_block_size, self.kv_dtype.itemsize)
        # The file's own blocks, in a model this engine owns (nothing shared is rewired); a
        # hybrid split slices its FFN rows from them too.
        blocks = QuantModel(loaded.source) if runs_on_file_blocks(options, self.device) else None
        self.input_sparsity = None  # a profile's input thresholds, when applied (_split_ffn)
        self.hybrid = self._split_ffn(loaded, options, blocks)
        if blocks is not None:
            if self.hybrid is not None:
                blocks.use_ffns(self.hybrid.layers)
            self.model, compute = blocks, blocks.device
            self.weights, self.lm_head = "native", self.model.head.stored.qtype_name.lower()
        else:
            compute = self.device if self.hybrid is None else self.hybrid.attention_device
            self.model = self._float_model(loaded, options, compute)
        self.tokenizer = loaded.tokenizer
        self.stop_ids = set(loaded.source.stop_ids)
        # Image markers some vocabularies file as text: generated, they are never shown.
        self.hidden_ids = {i for t in NON_TEXT_TOKENS
                           if (i := self.tokenizer.id_of(t)) is not None}
        self.chat_format = self.resolve_chat_format(options.chat_format)
        self.kv = PagedKVCache(loaded.config, self.kv_plan.device_blocks, self.kv_plan.host_blocks,
                               self.kv_plan.block_size, compute, DEFAULT_ROLLBACK_MARGIN,
                               self.kv_dtype)
        self.runner = Runner(self.model, self.kv, n_ctx)
        self.options = options
        self.drafter, self.tree_widths = make_drafter(self, options)
        # One sizer for the engine's life: what a step and a drafted level cost are properties
        # of the machine and model, not of one reply, so later replies start well estimated.
        self.sizer = TreeSizer(self.tree_widths)
        self._spec_stats: SpecStats | None = None  # the latest stream's, with a drafter

    @property
    def speculation(self) -> dict | None:
        """The latest stream's `SpecStats.to_dict()` (None before one, or with no drafter)."""
        return None if self._spec_stats is None else self._spec_stats.to_dict()

    def _float_model(self, loaded: LoadedModel, options: EngineOptions, compute):
        """The shared float32 Transformer, op by op in PyTorch: the path for `--weights fp32`
        and a GPU device (with or without a hybrid split). Sets the weights and LM head in
        use."""
        if self.hybrid is None:
            restore_dense(loaded.model)
        model = loaded.model.to(compute)
        self.weights = self.lm_head = "fp32"
        if (self.hybrid is not None and compute.type != "cpu"
                and not self.hybrid.plan.lm_head_on_gpu):
            model.head = HostLMHead(model.head)
        return model

    def _split_ffn(self, loaded: LoadedModel, options: EngineOptions,
                   blocks: QuantModel | None) -> HybridModel | None:
        """Split FFN layers by the GPU-tier plan (None: no split): rows from the file's
        `blocks` when the engine runs on them, else from the float32 model's FFNs."""
        profile, path = None, options.profile
        if path == "auto":  # the one `ember profile` wrote for this model, if any
            found = default_profile_path(self.loaded.source.fingerprint)
            path = found if found.is_file() else None
            if path is None and options.ffn_mode == "sparse":
                raise ConfigError(f"--ffn-mode sparse needs a profile and there is none at "
                                  f"{found}; run `ember profile` first")
        if path is not None:
            profile = load_profile(path, self.loaded.config, self.loaded.source.fingerprint)
        self.profile_path = path
        self.profile_quality = None if profile is None else _profile_quality(profile)
        if options.gpu_budget is None and options.split == "auto" and profile is None:
            return None
        if use_input_thresholds(profile, blocks, options):
            # GLU models: the profile thresholds matmul inputs rather than predicting neurons
            self.input_sparsity = apply_input_sparsity(blocks, profile.meta["input_thresholds"],
                                                       profile.meta.get("input_layout", "q8_0"))
            return None
        if options.gpu_budget is None and options.split != "auto":
            raise ConfigError(f"--split {options.split} needs --gpu-budget (the GPU tier's size)")
        kv_bytes = self.kv_plan.device_blocks * self.kv_plan.block_bytes
        if options.gpu_budget is None:  # a profile alone: sparse on the host, no GPU tier
            budget, split = UNLIMITED, "cpu-only"
        else:
            budget, split = options.gpu_budget, options.split
        predictors = None if profile is None else profile_predictors(profile, self.loaded.config)
        sparse = predictors is not None and options.ffn_mode != "dense"
        how = dict(
            tier=TierChoice.resolve(options.tier_dtype, self.device),
            split=split, cold_dtype=resolve_cold_dtype(options.cold_dtype, options.weights),
            preferred=None if profile is None else profile.placement,
            neuron_order=None if profile is None else profile.neuron_order(),
            predictor_bytes=0 if predictors is None else predictors.nbytes,
            choose=None if profile is None else profile_chooser(profile, predictors, sparse,
                                                                     self.loaded.config))
        if blocks is not None:
            # Layers no predictor gates compute every cold neuron: with nothing hot they run
            # on the file's blocks, with no bundles derived.
            gates = predictors.predict if sparse else [None] * len(blocks.layers)
            # Attention and its KV run on the blocks in host RAM: the tier holds FFN rows.
            hybrid = split_ffns(loaded.config, blocks.ffn_rows(), budget, self.device,
                                kv_bytes, ungated=[g is None for g in gates],
                                attention_movable=False, **how)
        else:
            hybrid = build_hybrid(loaded.model, budget, self.device, kv_bytes, **how)
        if sparse:
            attach_predictors(hybrid, predictors, profile.bias)
        return hybrid

    def input_sparsity_report(self) -> dict | None:
        """Sparsity the profile's input thresholds realized per layer and matmul since the
        engine started (or the last reset), and the bytes of the body they skip."""
        if self.input_sparsity is None:
            return None
        dense, read = self.input_sparsity.bytes_per_token()
        return {"profile": str(self.profile_path), **self.input_sparsity.realized(),
                "body_bytes_dense": dense, "body_bytes_read": read,
                "layout_bytes": self.input_sparsity.layout_bytes()}

    def hybrid_report(self) -> dict | None:
        """The GPU-tier plan and measured per-layer FFN work (None for a dense engine), and
        with a profile, its path and the quality its end-to-end check measured."""
        if self.hybrid is None:
            return None
        report = self.hybrid.report()
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
                            in_ram=weights_in_ram(options))
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
        return self.tokenizer.encode(text, add_bos=True, parse_special=parse_special)

    def resolve_chat_format(self, choice: str) -> ChatFormat:
        """What a --chat-format choice means for this model (ConfigError if it cannot be)."""
        return resolve_chat_format(choice, has_template=bool(self.loaded.source.chat_template),
                                   has_token=lambda t: self.tokenizer.id_of(t) is not None,
                                   turn_ends=self._turn_end_texts())

    def _turn_end_texts(self) -> tuple[str, ...]:
        """The spelling of each end-of-turn token (EOS excepted: "</s>" or "<eos>" written
        out is more often text than a turn's end)."""
        ids = [i for i in self.stop_ids if i != self.tokenizer.eos_id]
        return tuple(t for i in ids if (t := self.tokenizer.token_text(i)))

    def encode_chat(self, messages: list[ChatMessage],
                    chat_format: str | None = None) -> "ChatPrompt":
        """The conversation in this engine's chat format (or in `chat_format`, a
        --chat-format choice), as token ids that carry the format (so `stream()` ends the
        reply at its stop strings)."""
        fmt = self.chat_format if chat_format is None else self.resolve_chat_format(chat_format)
        text = render_chat(
            messages, fmt, template=self.loaded.source.chat_template,
            bos_text=self._token_text(self.tokenizer.bos_id),
            eos_text=self._token_text(self.tokenizer.eos_id),
            bos_added=self.tokenizer.add_bos and self.tokenizer.bos_id is not None,
        )
        return ChatPrompt(self.encode(text, parse_special=True), fmt)

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.tokenizer.token_text(token_id)

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
        """
        timings = Timings(prompt_tokens=len(prompt_ids))
        fmt = prompt_ids.format if isinstance(prompt_ids, ChatPrompt) else ChatFormat("none")
        decoder = StreamDecoder(self.tokenizer)
        stops = StopStrings([*stop, *fmt.stop_strings], strip_leading=fmt.strip_leading_space)
        generated: list[int] = []
        text, finish = "", None
        start = time.perf_counter()
        stop_ids = set() if ignore_eos else self.stop_ids
        tokens = decode_loop(self.runner, session, self._step(session, Sampler(sampling)),
                             prompt_ids, max_tokens, stop_ids, timings, cancel)
        for token, reason in tokens:
            if reason is not None:
                finish = reason
                break
            now = time.perf_counter()
            if not generated:
                timings.ttft_s = now - start
            timings.decode_s = now - start - timings.ttft_s
            generated.append(token)
            delta = stops.push("" if token in self.hidden_ids else decoder.push(token))
            text += delta
            yield TokenEvent(token, delta)
            if stops.stopped:
                finish = "stop"
                break
        if finish != "stop":
            tail = stops.push(decoder.flush()) + stops.flush()
            if tail:
                text += tail
                yield TokenEvent(None, tail)
        timings.generated_tokens = len(generated)
        yield DoneEvent(finish, text, generated, list(prompt_ids), timings)

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


class ChatPrompt(list):
    """Prompt token ids from `encode_chat`, with the chat format that wrote them."""

    def __init__(self, ids, format: ChatFormat):
        super().__init__(ids)
        self.format = format


def use_input_thresholds(profile, blocks, options) -> bool:
    """A profile with input thresholds runs them on the file-blocks runtime when no GPU tier
    is asked for (the split's cold side takes predictors) and the FFNs are not forced dense."""
    return (profile is not None and blocks is not None and "input_thresholds" in profile.meta
            and options.gpu_budget is None and options.ffn_mode != "dense")


def _profile_quality(profile) -> dict:
    """What `ember profile`'s end-to-end check measured against the dense model (held-out
    perplexity ratio, top-1 and greedy agreement), with the budget it was held to."""
    meta = profile.meta
    return {"quality_budget": meta.get("quality_budget"), "recall": meta.get("recall_used"),
            "check": (meta.get("report") or {}).get("quality")}
