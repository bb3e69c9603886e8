"""Test doubles for the chat app: `FakeEngine`, a stand-in that streams scripted replies
with small delays, and `PreloadedBackend`, the real backend around an engine a test loaded.

`FakeEngine` is deterministic and fast, with the knobs the tests need: per-token delay, a gate that holds
loading until the test opens it, an error to raise instead of replying, and a record of every
conversation it was asked to answer. `load()` reports scripted progress steps. `stats()` plays a
paged KV cache in miniature: each session holds 16-token blocks on each of `KV_LAYERS` layers,
and when the device pool is full the least recently used other session moves to the host pool
(a swap out; answering it again swaps it in), or is dropped once the host pool is full too.
It also returns a scripted hybrid report (`sample_hybrid_report()` is one shaped like the real
engine's) and speculation figures, for the status bar and the placement screen.
"""

from __future__ import annotations

import math
import threading
import time

from ember.app.tui.engine_port import EngineBackend
from ember.models.support.errors import EmberError
from ember.offload.decode.events import DoneEvent, Timings, TokenEvent

KV_BLOCK_TOKENS = 16
KV_LAYERS = 18  # as in the default model
KV_BLOCK_BYTES = 16 * 1024
# (fraction, stage) reported by load(): all but the last before waiting on the load gate.
LOAD_STEPS = ((0.0, "reading the model file"), (0.35, "building 18 layers"),
              (0.5, "layer 6 of 18"), (1.0, "ready"))


class FakeEngine:
    def __init__(self, replies: list[str] | None = None, token_delay: float = 0.005,
                 load_gate: threading.Event | None = None, n_ctx: int = 4096,
                 name: str = "fake model", kv_device_blocks: int = 1803,
                 kv_host_blocks: int = 1803, hybrid: dict | None = None,
                 speculate: str = "off", speculation: dict | None = None,
                 chat_format: str | None = None):
        self.name = self.model = name
        self.closed = False
        self.replies = list(replies or ["Hello! How can I help?"])
        self.token_delay = token_delay
        self.load_gate = load_gate  # load() waits until it is set (None: loads at once)
        self.fail_next: EmberError | None = None  # raised by the next stream_reply
        self.requests: list[list] = []  # the messages of each stream_reply call
        self.sessions: list[str] = []  # the session (conversation) of each call
        self.last_settings = None  # the ChatSettings of the latest call
        self.loaded = threading.Event()
        self.load_steps = LOAD_STEPS
        self.hybrid = hybrid  # what stats() reports as the hybrid report (None: dense)
        self.speculate = speculate
        self.speculation = speculation  # SpecStats.to_dict()-shaped, or None
        self.chat_format = chat_format  # reported by stats() when set ("transcript", ...)
        self._n_ctx = n_ctx
        self.kv_capacity = {"device": kv_device_blocks, "host": kv_host_blocks}
        self._kv: dict[str, tuple[str, int]] = {}  # session -> (tier, blocks), least recent first
        self._kv_counts = dict(swaps_out=0, swaps_in=0, dropped=0)

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    def load(self, progress=None) -> None:
        report = progress or (lambda fraction, stage: None)
        for fraction, stage in self.load_steps[:-1]:
            report(fraction, stage)
        if self.load_gate is not None:
            self.load_gate.wait(timeout=30)
        report(*self.load_steps[-1])
        self.loaded.set()

    def for_model(self, model: str) -> "FakeEngine":
        """Another fake engine, named `model`, with the same scripted replies and knobs."""
        return FakeEngine(self.replies, self.token_delay, self.load_gate, self._n_ctx,
                          name=model, speculate=self.speculate, chat_format=self.chat_format)

    def close(self) -> None:
        self.closed = True

    def stream_reply(self, messages, settings, cancel, session="default"):
        self.requests.append(list(messages))
        self.sessions.append(session)
        self.last_settings = settings
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        reply = self.replies[(len(self.requests) - 1) % len(self.replies)]
        # "Tokens" are whitespace-separated words with their leading space, capped like a model.
        tokens = [w if i == 0 else " " + w for i, w in enumerate(reply.split(" "))]
        tokens = tokens[:settings.max_tokens]
        prompt_tokens = sum(len(m.content.split()) + 4 for m in messages)
        start = time.perf_counter()
        timings = Timings(prompt_tokens=prompt_tokens)
        text, finish = "", "eos" if len(tokens) < settings.max_tokens else "length"
        for i, token in enumerate(tokens):
            # Wait on the event, not time.sleep, so a cancel wakes us at once.
            if cancel.wait(self.token_delay):
                finish = "cancelled"
                break
            if i == 0:
                timings.ttft_s = time.perf_counter() - start
            text += token
            timings.generated_tokens += 1
            yield TokenEvent(i, token)
        timings.decode_s = time.perf_counter() - start - timings.ttft_s
        self._kv_use(session, prompt_tokens + timings.generated_tokens)
        yield DoneEvent(finish, text, list(range(timings.generated_tokens)), [], timings)

    def stats(self) -> dict:
        """Shaped like `EngineBackend.stats()`: the KV pools as `Engine.kv_usage()` reports them."""
        used = {tier: self._used(tier) for tier in ("device", "host")}
        counts = self._kv_counts
        chat = {"chat_format": self.chat_format} if self.chat_format else {}
        return {**chat, "lm_head": "q8_0", "hybrid": self.hybrid, "speculate": self.speculate,
                "speculation": self.speculation, "kv": {
            "block_size": KV_BLOCK_TOKENS, "block_bytes": KV_BLOCK_BYTES,
            "device_blocks_used": used["device"],
            "device_blocks_free": self.kv_capacity["device"] - used["device"],
            "host_blocks_used": used["host"],
            "host_blocks_free": self.kv_capacity["host"] - used["host"],
            "sequences": {tier: sum(t == tier for t, _ in self._kv.values())
                          for tier in ("device", "host", "dropped")},
            **counts, "bytes_out": 0, "bytes_in": 0, "swap_s": 0.0, "plan": {}}}

    def _kv_use(self, session: str, tokens: int) -> None:
        """`session` now holds `tokens` on the device; older sessions make room for it."""
        tier, _ = self._kv.pop(session, ("device", 0))
        if tier == "host":
            self._kv_counts["swaps_in"] += 1
        self._kv[session] = ("device", math.ceil(tokens / KV_BLOCK_TOKENS) * KV_LAYERS)
        for other, (tier, blocks) in list(self._kv.items()):
            if self._used("device") <= self.kv_capacity["device"]:
                break
            if tier != "device" or other == session:
                continue
            if self._used("host") + blocks <= self.kv_capacity["host"]:
                self._kv[other] = ("host", blocks)
                self._kv_counts["swaps_out"] += 1
            else:
                self._kv[other] = ("dropped", 0)
                self._kv_counts["dropped"] += 1

    def _used(self, tier: str) -> int:
        return sum(b for t, b in self._kv.values() if t == tier)


class PreloadedBackend(EngineBackend):
    """`EngineBackend` around an `Engine` the test built (loading a model takes seconds, and
    one engine serves several tests): `load()` only reports that it is ready."""

    def __init__(self, engine, name: str):
        super().__init__()
        self.name, self._engine = name, engine

    def load(self, progress=None) -> None:
        if progress is not None:
            progress(1.0, "ready")


def sample_hybrid_report(n_layers: int = KV_LAYERS, ffn_size: int = 2048,
                         measured: bool = True) -> dict:
    """A hybrid report shaped like `Engine.hybrid_report()`, for the default model's shape on
    a 150 MiB GPU tier: more hot neurons in the early layers, and (if `measured`) the fraction
    of neurons computed per decode token, as a sparse (predictor-gated) run reports it."""
    neuron = 3 * 640 * 4  # gate/up/down rows of one neuron, fp32
    hot = [round(ffn_size * (0.6 - 0.4 * i / max(1, n_layers - 1))) for i in range(n_layers)]
    fractions = [round(h / ffn_size, 4) for h in hot]
    computed = [round(f + (1 - f) * 0.25, 4) for f in fractions] if measured else [None] * n_layers
    charges = {"workspace": 5_767_168, "attention": 18_876_416, "kv_pool": 9_437_184,
               "predictors": 0, "lm_head": 0, "ffn_hot": sum(hot) * neuron}
    return {
        "budget_bytes": 150 * 2**20, "split": "auto", "gpu_bytes": sum(charges.values()),
        "charges": charges,
        "on_gpu_tier": {"attention_and_kv": True, "predictors": False, "lm_head": False},
        "hot_fraction": round(sum(hot) / (ffn_size * n_layers), 4),
        "hot_fraction_per_layer": fractions,
        "gpu_tier_device": "cuda:0",
        "gpu_ffn_bytes": sum(hot) * neuron,
        "gpu_ffn_bytes_per_layer": [h * neuron for h in hot],
        "host_ffn_bytes": sum(ffn_size - h for h in hot) * neuron,
        "host_ffn_dtype": "fp32",
        "down_neuron_major_bytes": n_layers * ffn_size * neuron // 3,
        "computed_fraction_per_layer": computed,
        "sparsity": round(1 - sum(computed) / n_layers, 4) if measured else None,
    }
