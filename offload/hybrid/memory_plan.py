"""What goes on the GPU tier under `--gpu-budget`, and how many FFN neurons are hot.

Two kinds of plan. Given sizes of every tensor in the file's own bytes
(`ComponentBytes.of_file_blocks`), the whole-model plan (issue 30, layer_plan.py): per layer
"gpu", "split" or "cpu" and the LM head, chosen by the ILP on the forecast's time per token
(`MemoryPlan.layer_modes`, `MemoryPlan.forecast`). Otherwise the plan of FFN rows below,
attention moving whole or not at all.

The tier is charged, in this order, for what every token reads in full (so a byte of budget
buys the same on each): a working-space allowance for one prefill chunk's activations, then
attention (weights, norms) together with its KV pool, the predictors, the LM head, and
finally hot FFN neurons with whatever is left. Attention, its KV pool and the LM head move
whole: if they do not fit they stay in host RAM and the budget goes to FFN neurons. The plan
never charges more than the budget; a budget below the working space is an error that
names the minimum.

On the file-blocks runtime attention moves in the tier's 16-bit type (`attention_dtype`,
tier_dtypes.attention_dtype), charged the exact bytes of its tensors
(`kernels.tier_attention.attention_bytes`) and its KV pool at that type's width; the LM head
and the predictors stay on the host there (`extras_movable` False). With `host_reads`
(`--tier-attention auto`) attention moves only when that leaves the host fewer bytes to read
per token than the same room as hot FFN rows would (offload/hybrid/host_reads.py).

Hot FFN neurons are charged the exact bytes of their tier format per layer
(`kernels.hot_ffn.hot_ffn_bytes`: int4 codes and scales, int8 codes and row scales, 16- or
32-bit values, padding to int4's 32-neuron groups included), so the plan's charge is what
the tier's tensors take. When attention runs on the file's blocks in host RAM (the engine's
default runtime) and no attention type is given, attention, its KV pool and the LM head
are not the tier's to hold.

Split policies: "auto" (hot neurons fill the rest), "cpu-only" (no hot neurons), "gpu-only"
(every FFN neuron hot: an error if they do not all fit).
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.kernels.hot_ffn import granule
from ember.models.config import ModelConfig
from ember.models.support.errors import ConfigError
from ember.models.support.sizes import format_size
from ember.placement.layout import Placement

from ..kv.plan import DEFAULT_PREFILL_CHUNK
from ..options.choices import SPLITS
# What the tier's parts take: defined beside, named here too (callers import them from here)
from .component_bytes import (ComponentBytes, cold_neuron_bytes, host_ffn_bytes,  # noqa: F401
                              neuron_bytes, workspace_bytes)


@dataclass(frozen=True)
class MemoryPlan:
    budget: int
    split: str
    workspace: int
    attention_on_gpu: bool  # with the KV pool and norms
    predictors_on_gpu: bool
    lm_head_on_gpu: bool
    placement: Placement  # hot neurons per layer
    sizes: ComponentBytes
    # A whole-model plan (sizes.model given): per layer "gpu", "split" or "cpu"; () for a
    # plan of FFN rows alone (attention all on one side: attention_on_gpu)
    layer_modes: tuple[str, ...] = ()
    forecast: dict | None = None  # the whole-model plan's predicted time and its card

    @property
    def ffn_bytes(self) -> int:
        return sum(self.sizes.hot_bytes(i, self.placement.hot_count(i))
                   for i in range(self.placement.n_layers))

    @property
    def hot_parameters(self) -> int:
        """FFN weights the tier holds (gate, up, down of every hot neuron)."""
        per = (3 if self.sizes.gated else 2) * self.sizes.hidden
        return per * sum(self.placement.hot_count(i) for i in range(self.placement.n_layers))

    def format_counts(self) -> dict[str, dict[str, int]]:
        """Per matrix kind (gate_up, down): tier format -> layers that hold it."""
        out: dict[str, dict[str, int]] = {"gate_up": {}, "down": {}}
        for gu, down in self.sizes.formats:
            for kind, fmt in (("gate_up", gu), ("down", down)):
                out[kind][fmt] = out[kind].get(fmt, 0) + 1
        return out

    def tier_layers(self) -> list[int]:
        """Layers whose attention and KV sit on the tier."""
        if self.layer_modes:
            return [i for i, m in enumerate(self.layer_modes) if m != "cpu"]
        return list(range(self.placement.n_layers)) if self.attention_on_gpu else []

    def host_weight_bytes(self) -> int:
        """Weight bytes the host reads per token, every cold neuron counted (whole-model
        plans; None otherwise)."""
        from .decode_costs import host_weight_bytes

        hot = [self.placement.hot_count(i) for i in range(self.placement.n_layers)]
        return host_weight_bytes(self.sizes.model, self.layer_modes, hot, self.lm_head_on_gpu)

    def charges(self) -> dict[str, int]:
        s = self.sizes
        if self.layer_modes:
            layers = [s.model.layers[i] for i in self.tier_layers()]
            return {"workspace": self.workspace,
                    "attention": sum(l.attention for l in layers),
                    "kv_pool": sum(l.kv for l in layers), "predictors": 0,
                    "lm_head": s.lm_head if self.lm_head_on_gpu else 0,
                    "ffn_hot": self.ffn_bytes}
        return {
            "workspace": self.workspace,
            "attention": s.attention if self.attention_on_gpu else 0,
            "kv_pool": s.kv_pool if self.attention_on_gpu else 0,
            "predictors": s.predictors if self.predictors_on_gpu else 0,
            "lm_head": s.lm_head if self.lm_head_on_gpu else 0,
            "ffn_hot": self.ffn_bytes,
        }

    @property
    def gpu_bytes(self) -> int:
        return sum(self.charges().values())

    def to_dict(self) -> dict:
        return {
            "budget_bytes": self.budget, "split": self.split, "gpu_bytes": self.gpu_bytes,
            "charges": self.charges(),
            "hot_ffn_parameters": self.hot_parameters, "tier_formats": self.format_counts(),
            "on_gpu_tier": {"attention_and_kv": self.attention_on_gpu,
                            "predictors": self.predictors_on_gpu, "lm_head": self.lm_head_on_gpu},
            # What attention and its KV pool take on the tier (charged when they are there)
            "tier_attention": {"dtype": self.attention_type(),
                               "attention_bytes": self.sizes.attention,
                               "kv_pool_bytes": self.sizes.kv_pool},
            **self.placement.summary(),
            **({"layer_modes": list(self.layer_modes),
                "host_weight_bytes_per_token": self.host_weight_bytes(),
                "forecast": self.forecast} if self.layer_modes else {}),
        }

    def attention_type(self) -> str | None:
        """file/bf16/fp16/fp32: the type attention and K/V take on the tier; None where they
        cannot move (the host's file blocks run them)."""
        from .tier_dtypes import dtype_name

        if self.sizes.model is not None:
            return "file"
        if not self.sizes.attention_movable:
            return None
        return self.sizes.attention_format or dtype_name(self.sizes.attention_dtype)

    def _where(self, name: str, n: int) -> str:
        """Where a component of `charges()` sits, for `describe`."""
        kind = self.attention_type() if name in ("attention", "kv_pool") else None
        if n:
            return "GPU tier" + (f" ({kind})" if kind else "")
        if kind:  # attention could move but stayed: say what it would have taken, and why
            s = self.sizes
            size = s.attention if name == "attention" else s.kv_pool
            fits = s.attention + s.kv_pool <= self.budget - self.workspace
            why = "hot FFN rows spare the host more reads" if fits else "no room"
            return f"host ({format_size(size)} as {kind} on the tier: {why})"
        present = name != "predictors" or self.sizes.predictors > 0
        return "host" if present else "none"

    def describe(self, host_ffn: tuple[int, str] | None = None) -> list[str]:
        """Human-readable lines for `ember info --gpu-budget` and `generate --verbose`;
        `host_ffn`: (bytes, kind: "file" or the bundles' type) of the host side, when known,
        for one more line."""
        lines = [f"GPU tier budget {format_size(self.budget)} ({self.split}): "
                 f"{format_size(self.gpu_bytes)} planned"]
        for name, n in self.charges().items():
            where = "" if self.layer_modes else "  " + self._where(name, n)
            lines.append(f"  {name:<11} {format_size(n) if n else '-':>10}{where}")
        if self.layer_modes:
            from .layer_plan import layer_lines

            lines += layer_lines(self)
        fractions = [self.placement.hot_fraction(i) for i in range(self.placement.n_layers)]
        per_layer = (f"{fractions[0]:.0%} in every layer" if len(set(fractions)) <= 1 else
                     "per layer " + " ".join(f"{f:.0%}" for f in fractions))
        lines.append(f"  hot FFN neurons: {self.placement.total_hot_fraction():.1%} overall, "
                     + per_layer)
        if self.sizes.formats:
            kinds = ", ".join(f"{kind} " + " ".join(f"{fmt} x{n}" for fmt, n in c.items())
                              for kind, c in self.format_counts().items())
            lines.append(f"  hot rows held as {kinds} (layers); "
                         f"{self.hot_parameters / 1e9:.2f}B FFN parameters on the tier")
        if host_ffn is not None and not host_ffn[0] and self.layer_modes:
            host_ffn = None  # a whole-model plan splits no layer: no cold rows to tell of
        if host_ffn is not None and host_ffn[1] == "file":
            lines.append(f"  cold FFN rows in host RAM: {format_size(host_ffn[0])} in the "
                         "file's blocks (cold gate/up rows copied, down as input-major "
                         "tiles), the mapped file's pages of those tensors let go")
        elif host_ffn is not None:
            lines.append(f"  cold FFN rows in host RAM: {format_size(host_ffn[0])} of "
                         f"{host_ffn[1]} bundles, derived from the file (down made "
                         "neuron-major), beside its mapped weights")
        return lines


def plan_memory(cfg: ModelConfig, budget: int, sizes: ComponentBytes, split: str = "auto",
                preferred: Placement | None = None, neuron_order=None,
                choose=None, speeds=None, activity=None) -> MemoryPlan:
    """Plan the GPU tier for `budget` bytes.

    Args:
        preferred: hot neurons a profile asks for (used as is when it fits the FFN share,
            else cut down hottest-first); None, or one with nothing hot (a profile made
            without a budget), spreads the FFN share evenly over layers.
        neuron_order: per layer, neurons hottest first (from a profile) for cutting down.
        choose: (room in bytes, per-layer bytes of a hot neuron) -> Placement (a solver
            over a profile's statistics); takes precedence over `preferred` under split "auto".
        speeds: for a whole-model plan (sizes made by `ComponentBytes.of_file_blocks`),
            the card and host it is priced for (decode_costs.DecodeSpeeds; None:
            layer_plan.plan_speeds(budget)).
        activity: for a whole-model plan, per layer each neuron's firing probability, where
            a predictor lets the host skip cold neurons (None: dense).
    """
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if budget < 0:
        raise ConfigError("--gpu-budget must not be negative")
    ffn_sizes = (cfg.ffn_size,) * cfg.n_layers
    space = workspace_bytes(cfg)
    if budget < space:
        raise ConfigError(f"--gpu-budget {format_size(budget)} is below the minimum "
                          f"{format_size(space)} (working space for a "
                          f"{DEFAULT_PREFILL_CHUNK}-token prefill chunk and a decoded "
                          "token's CUDA graph); raise it")
    left = budget - space
    if sizes.model is not None:
        return _plan_layers(cfg, budget, space, sizes, split, neuron_order, speeds, activity)
    attention = sizes.attention_movable and sizes.attention + sizes.kv_pool <= left
    if attention and sizes.host_reads is not None:
        attention = _moving_attention_pays(ffn_sizes, sizes, left, split, preferred,
                                           neuron_order)
    if attention:
        left -= sizes.attention + sizes.kv_pool
    predictors = attention and sizes.extras_movable and 0 < sizes.predictors <= left
    if predictors:
        left -= sizes.predictors
    all_ffn = _charge(sizes, ffn_sizes)
    # The head only when FFN neurons cannot use the room better: after the FFN is all hot,
    # or when it is the bigger per-token read (it is read in full every token, like hot rows).
    lm_head = attention and sizes.extras_movable and sizes.lm_head <= left and (
        split != "gpu-only" or sizes.lm_head + all_ffn <= left)
    if lm_head:
        left -= sizes.lm_head
    if choose is not None and split == "auto":
        # The solver prices neurons at the marginal bytes; the slack covers the rest.
        room = max(0, left - sum(map(sizes.slack, range(cfg.n_layers))))
        placement = _within(choose(room, list(sizes.neuron)), sizes, left, neuron_order)
    else:
        placement = _hot_neurons(ffn_sizes, sizes, left, split, preferred, neuron_order)
    plan = MemoryPlan(budget, split, space, attention, predictors, lm_head, placement, sizes)
    if split == "gpu-only" and placement.total_hot_fraction() < 1.0:
        need = space + all_ffn
        raise ConfigError(f"--split gpu-only needs every FFN neuron on the GPU tier: at least "
                          f"{format_size(need)}, but --gpu-budget is {format_size(budget)}")
    if plan.gpu_bytes > budget:  # a bug, not user input: the rules above must prevent it
        raise RuntimeError(f"memory plan over budget: {plan.gpu_bytes} > {budget}")
    return plan


def _plan_layers(cfg: ModelConfig, budget: int, space: int, sizes: ComponentBytes, split: str,
                 order, speeds, activity) -> MemoryPlan:
    """The whole-model plan: the ILP's modes and hot counts (hottest first by `order`)."""
    from .layer_plan import forecast_entry, plan_speeds, solve_modes

    speeds = speeds or plan_speeds(budget)
    solved = solve_modes(sizes.model, budget - space, speeds, split, activity)
    placement = Placement.from_counts((cfg.ffn_size,) * cfg.n_layers,
                                      [o.hot for o in solved.choice], order)
    plan = MemoryPlan(budget, split, space, any(m != "cpu" for m in solved.modes), False,
                      solved.head_on_gpu,
                      placement, sizes, solved.modes,
                      forecast_entry(sizes.model, speeds, solved))
    if plan.gpu_bytes > budget:  # a bug, not user input
        raise RuntimeError(f"memory plan over budget: {plan.gpu_bytes} > {budget}")
    return plan


def _hot_neurons(ffn_sizes, sizes: ComponentBytes, room: int, split: str,
                 preferred: Placement | None, order) -> Placement:
    if split == "cpu-only":
        return Placement.uniform(ffn_sizes, 0.0)
    if split == "gpu-only":
        fits = sum(sizes.hot_bytes(i, n) for i, n in enumerate(ffn_sizes)) <= room
        return Placement.uniform(ffn_sizes, 1.0 if fits else 0.0)
    # A profile made without a GPU budget places nothing hot (an input-threshold profile
    # always): that is no preference, and the budget is spread as below, hottest first.
    if preferred is not None and preferred.total_hot_fraction() > 0:
        if preferred.ffn_sizes != ffn_sizes:
            raise ConfigError(f"the placement is for FFN sizes {preferred.ffn_sizes[:3]}..., "
                              f"this model has {ffn_sizes[:3]}...")
        return _within(preferred, sizes, room, order)
    # No statistics: every layer gets the same share, so each one's cold side is as small
    # as the others' (the per-token latency is the sum of layer latencies), in whole int4
    # groups where a layer has them (padding would be bytes for nothing).
    per_round = sum(sizes.neuron)
    n = min(min(ffn_sizes), room // per_round) if per_round else 0
    step = max([granule(f) for f in sizes.formats] or [1])
    if n < min(ffn_sizes):
        n -= n % step
    while n > 0 and _charge(sizes, [n] * len(ffn_sizes)) > room:
        n = max(0, n - step)
    return Placement.from_counts(ffn_sizes, [n] * len(ffn_sizes), order)


def _moving_attention_pays(ffn_sizes, sizes: ComponentBytes, room: int, split: str,
                           preferred: Placement | None, order) -> bool:
    """Whether attention and its KV on the tier leave the host fewer bytes to read per token
    than `room` given to hot FFN rows alone (sizes.host_reads; see host_reads.py)."""
    reads = sizes.host_reads

    def host(ffn_room: int, attention: int) -> int:
        hot = _hot_neurons(ffn_sizes, sizes, ffn_room, split, preferred, order)
        return attention + sum((n - hot.hot_count(i)) * reads.neuron[i]
                               for i, n in enumerate(ffn_sizes))

    moved = host(room - sizes.attention - sizes.kv_pool, 0)
    return moved < host(room, reads.attention)


def _charge(sizes: ComponentBytes, counts) -> int:
    return sum(sizes.hot_bytes(i, n) for i, n in enumerate(counts))


def _within(placement: Placement, sizes: ComponentBytes, room: int, order) -> Placement:
    """`placement` as is when its exact charge fits `room`, else every layer's hot count
    cut by one factor (hottest kept first) until it does."""
    counts = [placement.hot_count(i) for i in range(placement.n_layers)]
    want = _charge(sizes, counts)
    if want <= room:
        return placement
    scale = room / want
    while True:
        cut = [int(c * scale) for c in counts]
        if _charge(sizes, cut) <= room:
            return Placement.from_counts(placement.ffn_sizes, cut, order)
        scale *= 0.98
