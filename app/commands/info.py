"""`ember info`: what a model is and what it needs, without loading its weights."""

from __future__ import annotations

from .common import model_path, print_json


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def run(args) -> int:
    from ember.models.loader import open_model
    from ember.models.summary import summarize

    source = open_model(model_path(args))
    context = _context(source, args)
    s = summarize(source, context.tokens, args.kv_type)
    s["engine_context"] = {"tokens": context.tokens, "limit": context.limit,
                           "why": context.describe()}
    s["chat_format"] = _chat_formats(source)
    s["memory"]["weights_in"] = _weights_in(source)
    plan = _gpu_plan(source.config, args, context.tokens, source)
    if plan is not None:
        from ember.offload.hybrid.tier_dtypes import format_table

        s["tier_formats"] = format_table(source.weights)
        rows, dtype = _host_rows(source, plan)
        s["gpu_plan"] = {**plan.to_dict(), "host_ffn_bytes": rows, "host_ffn_dtype": dtype,
                         "tier_conversion_error": _tier_errors(source.config, source, plan),
                         "attention_conversion_error": _attention_errors(source, plan)}
    if args.json:
        print_json(s)
        return 0
    print(f"{s['name']}  ({s['architecture']}, {s['format']}, {s['parameters'] / 1e6:.0f}M parameters)")
    print(f"  path            {s['path']}")
    print(f"  layers          {s['layers']} x hidden {s['hidden_size']}, FFN {s['ffn_size']} "
          f"({s['activation']})")
    print(f"  attention       {s['heads']} heads, {s['kv_heads']} KV heads, head dim {s['head_dim']}"
          + (f", window {s['sliding_window']}, global layers {s['global_layers']}"
             if s["sliding_window"] else ""))
    print(f"  rope            base {s['rope']['base']:g}, {s['rope']['layout']}"
          + (f", {s['rope']['scaling']}" if s["rope"]["scaling"] else ""))
    extras = _family_features(s)
    if extras:
        print(f"  also            {extras}")
    print(f"  vocabulary      {s['vocab_size']:,}" + ("  (tied LM head)" if s["tied_embeddings"] else ""))
    print(f"  context         {s['context_length']:,} tokens trained; an engine gets "
          f"{context.tokens:,}: {context.describe()}")
    t = s["tokenizer"]
    print(f"  tokenizer       {t['kind']}; BOS {t['bos'] or 'none'}; a reply ends at "
          + ", ".join(t["stop_tokens"]))
    chat = s["chat_format"]
    also = ", ".join(f for f in chat["available"] if f != chat["auto"])
    print(f"  chat format     {chat['auto']} ({chat['why']}); --chat-format also takes {also}")
    print("  quant types     " + ", ".join(f"{k} x{v}" for k, v in sorted(s["quant_types"].items())))
    print("  stored bytes    " + ", ".join(f"{k} {_mib(v)}" for k, v in s["stored_bytes"].items()))
    m = s["memory"]
    # An upper bound: the paged KV cache only takes the blocks a conversation fills.
    where = ("read into RAM on huge pages; --mmap on maps them" if m["weights_in"] == "ram"
             else "memory-mapped; --mmap off reads them into RAM")
    print(f"  memory (max)    {_mib(m['total_bytes'])} = the file's weights "
          f"{_mib(m['weights_bytes'])} ({where}) + KV cache ({m['kv_type']}) "
          f"{_mib(m['kv_cache_bytes'])} at {m['kv_cache_ctx']} tokens")
    print(f"                  ({_mib(m['total_fp32_bytes'])} with the float32 model: "
          "--weights fp32 or a GPU device)")
    if plan is not None:
        print("\n".join("  " + line for line in plan.describe(_host_rows(source, plan))))
        err = s["gpu_plan"]["tier_conversion_error"]
        if plan.sizes.model is not None:
            print("    every tensor on the tier in the file's own blocks: nothing converted")
            return 0
        print(f"    conversion error against the file's rows (64 rows of the first, middle and "
              f"last layers, relative): gate/up {err['gate_up']:.2%}, down {err['down']:.2%}")
        att = s["gpu_plan"]["attention_conversion_error"]
        if att is not None and plan.attention_type() != "file":
            print(f"    attention and the LM head as {plan.attention_type()} (the same rows): "
                  f"q/k/v {att['qkv']:.2%}, output {att['o']:.2%}")
        print("  tier formats    bits a weight / error against the file, per type in the file "
              "(64 rows of its first tensor):")
        for kind, row in s["tier_formats"].items():
            print(f"    {kind:<6} " + ", ".join(
                f"{fmt} {f['bits']:.2f}/{f['error']:.2%}" for fmt, f in row["formats"].items()))
    return 0


def _weights_in(source) -> str:
    """Where a CPU engine with the default options keeps the file's bytes: "ram" or "mmap"."""
    import torch

    from ember.offload.runtime.engine import EngineOptions
    from ember.offload.runtime.resources import reads_weights_into_ram

    return "ram" if reads_weights_into_ram(source, EngineOptions(), torch.device("cpu")) else "mmap"


def _family_features(s: dict) -> str:
    """The switches that set a family apart (Qwen's biases or q/k norms, Gemma's caps)."""
    parts = ["q/k/v biases"] * s["qkv_bias"] + ["q/k norms"] * s["qk_norm"]
    if s["attn_softcap"]:
        parts.append(f"attention scores capped at {s['attn_softcap']:g}")
    if s["final_logit_softcap"]:
        parts.append(f"logits capped at {s['final_logit_softcap']:g}")
    return ", ".join(parts)


def _chat_formats(source) -> dict:
    """The chat format `--chat-format auto` picks for this file, why, and every format
    the file can be given."""
    from ember.models.chat_format import CHAT_FORMATS, resolve_chat_format
    from ember.models.support.errors import ConfigError

    has_template = bool(source.chat_template)
    has_token = lambda t: source.tokenizer.id_of(t) is not None  # noqa: E731

    def works(name: str) -> bool:
        try:
            resolve_chat_format(name, has_template=has_template, has_token=has_token)
            return True
        except ConfigError:
            return False

    why = ("the file's chat template" if has_template else
           "no chat template in the file: a base model")
    return {"auto": resolve_chat_format("auto", has_template=has_template,
                                        has_token=has_token).name,
            "why": why, "available": [f for f in CHAT_FORMATS if f != "auto" and works(f)]}


def _host_rows(source, plan) -> tuple[int, str]:
    """(bytes, kind) of the host side an engine with default options holds beside the file,
    assuming the C++ kernels are built (asking would build them, and `info` must stay quick):
    on a GLU model each split layer's cold gate/up rows in the file's blocks and its down as
    tiles ("file"); else int8 bundles of the cold neurons."""
    from ember.models.support.errors import ModelFormatError
    from ember.offload.hybrid.memory_plan import host_ffn_bytes

    cfg, placement = source.config, plan.placement
    bundles = host_ffn_bytes(cfg, placement, "int8"), "int8"
    if not cfg.gated:
        return bundles
    total = 0
    try:
        for i in range(cfg.n_layers):
            size, hot = placement.ffn_sizes[i], placement.hot_count(i)
            if 0 < hot < size:  # a split layer (one with nothing hot runs on the file itself)
                nbytes = {n: source.weights.get(f"blk.{i}.ffn_{n}.weight").nbytes
                          for n in ("gate", "up", "down")}
                total += (nbytes["gate"] + nbytes["up"]) * (size - hot) // size + nbytes["down"]
    except ModelFormatError:  # a fused gate/up (Phi-3): count bundles, the larger
        return bundles
    return total, "file"


def _context(source, args):
    """The context an engine with these flags gets (resources.context_size)."""
    from ember.offload.options.engine_options import EngineOptions
    from ember.offload.runtime.device import resolve_device
    from ember.offload.runtime.resources import context_size

    options = EngineOptions(n_ctx=args.ctx_size, kv_type=args.kv_type)
    return context_size(source, options, resolve_device(getattr(args, "device", "auto")))


def _gpu_plan(cfg, args, n_ctx: int, source=None):
    """The GPU-tier plan `--gpu-budget` would give, or None: as the engine on the file's
    blocks makes it on a GPU (hot rows in their tier formats; attention and its KV pool in
    the tier's 16-bit type when the budget holds them, `--tier-attention`), whatever device
    this machine has: the budget describes a GPU."""
    if args.gpu_budget is None:
        return None
    from ember.offload.hybrid.file_plan import plans_whole_model

    if plans_whole_model(getattr(args, "tier_attention", "auto"),
                         getattr(args, "tier_dtype", "auto")):
        return _layer_plan(cfg, args, n_ctx, source)
    from ember.offload.runtime.device import resolve_device
    from ember.offload.kv.plan import plan_kv
    from ember.offload.hybrid.memory_plan import ComponentBytes, plan_memory
    from ember.models.support.sizes import parse_size
    from ember.offload.hybrid.host_reads import HostReads
    from ember.offload.body.file_layers import FileLayers
    from ember.offload.body.tier_layers import tier_attention_bytes, tier_head_bytes
    from ember.offload.hybrid.tier_dtypes import TierChoice, attention_format, attention_kv_dtype

    budget = parse_size(args.gpu_budget, "--gpu-budget")
    device = resolve_device(getattr(args, "device", "auto"))
    tier = TierChoice.resolve(getattr(args, "tier_dtype", "auto"), device)
    choice = getattr(args, "tier_attention", "auto")
    fmt = attention_format(choice, device)
    attention = None if fmt is None else attention_kv_dtype(fmt)
    # The KV pool at attention's type on the tier, else the host runtime's float16.
    kv = plan_kv(cfg, n_ctx, value_bytes=2 if attention is None else attention.itemsize)
    # auto: attention moves where it spares the host more reads than hot rows would
    reads = HostReads.of_file(cfg, source.weights, n_ctx) if choice == "auto" else None
    moved = {}
    if fmt is not None:  # attention and the LM head in their tier format, to the byte
        file = FileLayers.read(source)
        moved = dict(attention_format=fmt, attention=tier_attention_bytes(file, fmt, tier.half),
                     lm_head=tier_head_bytes(file, fmt, tier.half))
    sizes = ComponentBytes.estimate(cfg, kv.device_blocks * kv.block_bytes,
                                    formats=layer_formats(cfg, source, tier), half=tier.half,
                                    attention_movable=attention is not None,
                                    attention_dtype=attention, host_reads=reads, **moved)
    return plan_memory(cfg, budget, sizes, args.split)


def _layer_plan(cfg, args, n_ctx: int, source):
    """The whole-model plan, as the engine makes it (file_plan.plan_file), priced for
    `--gpu NAME`, this machine's CUDA device, or the first card of the table with the
    budget's memory."""
    from ember.models.support.sizes import parse_size
    from ember.offload.hybrid.file_plan import plan_file
    from ember.offload.kv.plan import plan_kv
    from ember.offload.runtime.device import resolve_device

    budget = parse_size(args.gpu_budget, "--gpu-budget")
    device = resolve_device(getattr(args, "device", "auto"))
    kv = plan_kv(cfg, n_ctx, value_bytes=2)  # float16 K and V
    return plan_file(cfg, source.weights, budget, n_ctx, kv.device_blocks * kv.block_bytes,
                     args.split, getattr(args, "gpu", None), device,
                     kv_layers=kv.layer_bytes())


def _attention_errors(source, plan) -> dict[str, float] | None:
    """Sampled conversion error of attention in the plan's type (None: it cannot move;
    0 in the file's own blocks)."""
    from ember.offload.hybrid.tier_dtypes import sampled_attention_error

    if plan.attention_type() == "file":
        return {"qkv": 0.0, "o": 0.0}
    if plan.attention_type() is None:
        return None
    return sampled_attention_error(source.weights, source.config.n_layers,
                                   plan.attention_type())


def _tier_errors(cfg, source, plan) -> dict[str, float]:
    from ember.offload.hybrid.tier_dtypes import sampled_errors

    if plan.sizes.model is not None:  # the file's own blocks: nothing converted
        return {"gate_up": 0.0, "down": 0.0}
    return sampled_errors(source.weights, cfg.n_layers, cfg.gated, list(plan.sizes.formats),
                          plan.sizes.half)


def layer_formats(cfg, source, tier) -> list[tuple[str, str]]:
    """Per layer (gate_up's, down's) tier format from the file's tensor types."""
    w = source.weights
    out = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        gate_up = ([p + "ffn_gate.weight"] if cfg.gated else []) + [p + "ffn_up.weight"]
        out.append(tier.formats([w.get(n).qtype_name for n in gate_up],
                                w.get(p + "ffn_down.weight").qtype_name))
    return out
