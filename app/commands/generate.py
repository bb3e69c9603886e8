"""`ember generate`: stream a continuation to stdout, stats to stderr (or one JSON object)."""

from __future__ import annotations

import sys

from ..process_clock import TimingsReport
from ember.models.support.errors import EmberError

from .common import load_engine, print_json, read_prompt


def run(args) -> int:
    from ember.models.chat_format import ChatMessage
    from ember.offload.decode.events import DoneEvent, TokenEvent
    from ember.offload.options.sampling import SamplingParams

    prompt = read_prompt(args.prompt)
    if args.system and not args.chat:
        raise EmberError("--system needs --chat (a system prompt belongs to a conversation)")
    if args.chat_format != "auto" and not args.chat:
        raise EmberError("--chat-format needs --chat")
    if args.logprobs is not None and not args.json:
        raise EmberError("--logprobs needs --json (they are reported in its object)")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed,
                              presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty, logprobs=args.logprobs,
                              grammar=_grammar(args))
    engine = load_engine(args)
    engine.check_sampling(sampling)  # a grammar that cannot compile: before any output
    if args.chat:
        messages = [ChatMessage("system", args.system)] if args.system else []
        ids = engine.encode_chat(messages + [ChatMessage("user", prompt)])
    else:
        # As llama.cpp: "<start_of_turn>" written in a prompt is that token, unless asked not.
        ids = engine.encode(prompt, parse_special=not args.no_special)
    report = TimingsReport.from_env()  # EMBER_REPORT_TIMINGS=path: `ember bench startup`
    done, logprobs = None, []
    for event in engine.stream(ids, sampling=sampling, max_tokens=args.max_tokens,
                               stop=tuple(args.stop), ignore_eos=args.ignore_eos):
        if isinstance(event, TokenEvent):
            if event.logprob is not None:
                logprobs.append({"token_id": event.token_id, "logprob": event.logprob.logprob,
                                 "top": [[i, lp] for i, lp in event.logprob.top]})
            if report and event.token_id is not None:
                report.mark("first_token")
            if not args.json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
        elif isinstance(event, DoneEvent):
            done = event
    t = done.timings
    if args.json:
        print_json({
            "text": done.text,
            "token_ids": done.token_ids,
            "prompt_token_ids": done.prompt_token_ids,
            "finish_reason": done.finish_reason,
            # with --logprobs: per generated token, its log-probability and the likeliest
            "logprobs": logprobs if args.logprobs is not None else None,
            "chat_format": engine.chat_format.name if args.chat else None,
            "ttft_s": t.ttft_s,
            "prefill_tokens_per_s": t.prefill_tokens_per_s,
            "decode_tokens_per_s": t.decode_tokens_per_s,
            "timings": t.to_dict(),
            "kv": engine.kv_usage(),
            "device": str(engine.device),
            "lm_head": engine.lm_head,
            "hybrid": engine.hybrid_report(),
            # a GLU profile's input thresholds: sparsity realized per layer and matmul (or null)
            "input_sparsity": engine.input_sparsity_report(),
            # accepted drafts per verification step and the drafter's share of time (or null)
            "speculation": engine.speculation if engine.drafter is not None else None,
        })
    else:
        sys.stdout.write("\n")
        print(f"ember: {t.prompt_tokens} prompt tokens at {t.prefill_tokens_per_s:.1f} tok/s, "
              f"{t.generated_tokens} generated at {t.decode_tokens_per_s:.1f} tok/s, "
              f"first token after {t.ttft_s * 1000:.0f} ms ({done.finish_reason})",
              file=sys.stderr)
        spec = engine.speculation if engine.drafter is not None else None
        if spec and spec["verifications"]:
            print(f"ember: speculation ({spec['drafter']}): {spec['mean_accepted_length']:.2f} "
                  f"tokens per verification, drafter {spec['drafter_time_share']:.0%} of the "
                  "time", file=sys.stderr)
        hybrid = engine.hybrid_report()
        if hybrid is not None:
            _print_hybrid(hybrid)
        inputs = engine.input_sparsity_report()
        if inputs is not None:
            print(f"ember: input thresholds skipped {inputs['mean_body']:.1%} of the body's "
                  f"matmul inputs ({inputs['body_bytes_read'] / 1e6:.1f} of "
                  f"{inputs['body_bytes_dense'] / 1e6:.1f} MB of body weights per token)",
                  file=sys.stderr)
    engine.close()
    if report:
        report.write(generated_tokens=len(done.token_ids),
                     prompt_tokens=len(done.prompt_token_ids))
    return 0


def _print_hybrid(hybrid: dict) -> None:
    from ember.offload.hybrid.setup import UNLIMITED

    budget = hybrid["budget_bytes"]
    of = "" if budget >= UNLIMITED else f" of {budget / 2**20:.1f} MiB"
    sparsity = hybrid["sparsity"]
    measured = "" if sparsity is None else f"; FFN sparsity this run {sparsity:.1%}"
    print(f"ember: {hybrid['hot_fraction']:.1%} of FFN neurons hot on the GPU tier "
          f"({hybrid['gpu_tier_device']}, {hybrid['gpu_bytes'] / 2**20:.1f} MiB{of}){measured}",
          file=sys.stderr)
    released = hybrid.get("file_bytes_released") or 0
    let_go = "" if not released else \
        f"; {released / 2**20:.1f} MiB of the mapped file's FFN pages let go"
    print(f"ember: cold FFN rows {hybrid['host_ffn_bytes'] / 2**20:.1f} MiB in host RAM "
          f"({hybrid['host_ffn_dtype']}); down made neuron-major for the split: "
          f"{hybrid['down_neuron_major_bytes'] / 2**20:.1f} MiB of both sides' rows{let_go}",
          file=sys.stderr)
    tier = [f"{kind} " + "/".join(f"{fmt} x{n}" for fmt, n in f["formats"].items())
            + f" (error {f['error_max']:.2%} at most)"
            for kind, f in hybrid["gpu_ffn_formats"].items() if f["formats"]]
    if tier:
        print("ember: hot rows on the tier as " + ", ".join(tier) + " against the file's rows",
              file=sys.stderr)
    check = (hybrid.get("profile") or {}).get("check")
    if check:
        print(f"ember: profile check on held-out text: perplexity x{check['ppl_ratio']:.3f} of "
              f"dense, top-1 agreement {check['top1_agreement']:.0%} (budget "
              f"+{hybrid['profile']['quality_budget']:.0%})", file=sys.stderr)


def _grammar(args):
    """The --json-schema or --grammar file, or the --regex, as a Grammar (None without one);
    llguidance compiles it (a GBNF file, one ending in .gbnf, through its own converter)."""
    from pathlib import Path

    from ember.offload.options.sampling import Grammar

    if args.regex is not None:
        return Grammar("regex", args.regex)
    path = args.json_schema or args.grammar
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EmberError(f"cannot read {path}: {exc}") from None
    if args.json_schema:
        return Grammar("json_schema", text)
    return Grammar("gbnf" if path.endswith(".gbnf") else "lark", text)
