"""`ember profile` for GLU models on the file-blocks runtime: input thresholds instead of
predictors (a predictor cannot tell which GLU neurons matter before computing them; a
threshold on each matmul's input needs no prediction).

calibration text -> input statistics, allocation and search (offload/profile/input_calibration.py)
-> artifact (thresholds, planned and measured sparsity) -> end-to-end check: the artifact
loaded by an engine as `--profile` loads it, against the dense engine on the held-out text
(perplexity, top-1 agreement, greedy match) and the sparsity realized while it decodes.
Between the two, decode is timed per slot (input_payoff.py): the artifact lists the slots
whose thresholds make decoding faster on this machine, the ones an engine applies by default.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ember.placement.layout import Placement

from .input_allocation import PROBES, probed_layers
from .input_calibration import calibrate_inputs, realized_means
from .input_payoff import measure_payoff
from .profile_options import segment_length
from ..runtime.profile_file import Profile
from ..body.quant_model import QuantModel, applies


def input_thresholds_apply(loaded, options) -> bool:
    """Whether `ember profile` calibrates input thresholds for this model: SwiGLU/GeGLU
    activations (ReLU-family ones give exact zeros, which predictors exploit as before), the
    file-blocks kernels built, and no GPU tier asked for."""
    cfg = loaded.config
    return (cfg.gated and cfg.activation in ("gelu_glu", "silu_glu") and options.gpu_budget is None
            and applies())


def run_input_profile(loaded, out: str | Path, options, text, stage, say, report) -> None:
    """Fill `report` (profiler.ProfileReport) and write the artifact to `out`."""
    cfg = loaded.config
    model = QuantModel(loaded.source)
    length = segment_length(cfg, options)
    cal, runtime = calibrate_inputs(model, text.train, loaded.tokenizer.bos_id,
                                    options.quality_budget, length,
                                    log=lambda msg: say("input thresholds", msg), stage=stage)
    alloc = cal.allocation
    # a timing prompt from the calibration text: the held-out text only ever checks
    prompt = ([loaded.tokenizer.bos_id] if loaded.tokenizer.bos_id is not None else []) \
        + text.train[:32]
    payoff = stage("payoff", lambda: measure_payoff(
        model, runtime, alloc.thresholds, prompt, cal.stats, log=lambda msg: say("payoff", msg)))
    report.glu = {"method": "input thresholds", "allocation": "global greedy on the KL added "
                  "over each layer's floor (threshold 0), measured at "
                  + "/".join(f"{p:.0%}" for p in PROBES) + " on the probed layers (the "
                  "layers between interpolated in depth)",
                  "probed_layers": probed_layers(cfg.n_layers),
                  "planned_mean_sparsity": round(alloc.mean_sparsity(), 4),
                  "search_tokens": cal.search_tokens,
                  "ppl_ratio": round(cal.ppl_ratio, 4), "agreement": round(cal.agreement, 4),
                  "levels_per_layer": alloc.levels, "tried": cal.tried,
                  "layout_bytes": runtime.layout_bytes(), "payoff": payoff}
    meta = {"input_thresholds": alloc.thresholds, "input_levels": alloc.levels,
            "input_layout": runtime.layout, "input_pays": payoff["pays"],
            "activation_thresholds": [0.0] * cfg.n_layers,
            "quality_budget": options.quality_budget, "gpu_budget": None, "report": {}}
    profile = Profile(loaded.source.fingerprint, cfg.name, cfg.n_layers, cfg.hidden_size,
                      cfg.ffn_size, _down_keep_rates(cal, cfg),
                      Placement.uniform((cfg.ffn_size,) * cfg.n_layers, 0.0), {}, meta)
    scratch = Path(out).with_name(Path(out).name + ".checking")
    try:
        profile.save(scratch)
        report.quality = stage("check", lambda: check_inputs(loaded, scratch, text.held_out,
                                                             options, say))
        profile.meta["report"] = {"quality": report.quality, "glu": report.glu}
        report.path = str(profile.save(out))
    finally:
        scratch.unlink(missing_ok=True)


def _down_keep_rates(cal, cfg) -> list[torch.Tensor]:
    """Per layer, how often each FFN neuron's h passes the down threshold over the sampled
    calibration rows: the profile's `frequency` (1 where down runs dense)."""
    out = []
    for i in range(cfg.n_layers):
        thr = cal.allocation.thresholds[i].get("down")
        sample = cal.stats[(i, "down")].sample
        out.append(torch.ones(cfg.ffn_size) if thr is None
                   else (sample > thr).float().mean(0).clamp(0, 1))
    return out


def check_inputs(loaded, artifact: Path, held_out: list[int], options, say) -> dict:
    """The artifact as `--profile` loads it, against the dense engine on held-out text."""
    from ember.predictors.passes import score

    from ..runtime.engine import Engine, EngineOptions
    from ..options.sampling import GREEDY

    bos = loaded.tokenizer.bos_id
    length = segment_length(loaded.config, options)
    prompt = ([bos] if bos is not None else []) + held_out[:32]
    dense = Engine(loaded, EngineOptions(device="cpu", n_ctx=options.n_ctx))
    dense_scores = score(dense.model, held_out, length, bos)
    dense_ids = dense.generate(prompt, sampling=GREEDY, max_tokens=options.check_tokens,
                               ignore_eos=True).token_ids
    say("check", "dense reference done")
    # every calibrated threshold, including slots that do not pay here (`--ffn-mode sparse`):
    # the quality reported is the thresholds', whatever this machine's timing chose
    sparse = Engine(loaded, EngineOptions(device="cpu", n_ctx=options.n_ctx, profile=str(artifact),
                                          ffn_mode="sparse"))
    try:
        if sparse.input_sparsity is None:
            raise RuntimeError("the engine did not apply the profile's input thresholds")
        sparse.input_sparsity.reset_counters()
        sparse_scores = score(sparse.model, held_out, length, bos)
        scored = realized_means(sparse.input_sparsity)  # while scoring held-out text
        sparse.input_sparsity.reset_counters()
        sparse_ids = sparse.generate(prompt, sampling=GREEDY, max_tokens=options.check_tokens,
                                     ignore_eos=True).token_ids
        realized = sparse.input_sparsity_report()
        decoded = realized_means(sparse.input_sparsity)
    finally:
        sparse.close()
    match = next((i for i, (a, b) in enumerate(zip(dense_ids, sparse_ids)) if a != b),
                 min(len(dense_ids), len(sparse_ids)))
    ratio = sparse_scores.ppl / dense_scores.ppl
    return {
        "held_out_tokens": dense_scores.tokens,
        "dense_ppl": round(dense_scores.ppl, 4), "sparse_ppl": round(sparse_scores.ppl, 4),
        "ppl_ratio": round(ratio, 4),
        "top1_agreement": round(dense_scores.agreement(sparse_scores), 4),
        "greedy_match_tokens": match, "greedy_tokens": len(dense_ids),
        "sparsity": realized["mean_body"], "sparsity_by_bytes": decoded["mean_body_by_bytes"],
        "input_sparsity": realized,
        "held_out_sparsity": scored["mean_body"],
        "held_out_sparsity_by_bytes": scored["mean_body_by_bytes"],
        "meets_quality_budget": ratio <= 1 + options.quality_budget,
        "recall": None,
    }
