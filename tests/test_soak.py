"""A short soak: many turns over several conversations that swap; memory stays flat.
(`python -m bench.soak` runs the long version.)"""

from bench.soak import soak, swapping_engine
from ember.models.loader import load_model


def test_turns_across_swapping_conversations_keep_rss_flat(tiny_gemma_gguf):
    engine = swapping_engine(load_model(tiny_gemma_gguf), n_ctx=96)
    report = soak(engine, turns=60, conversations=5, max_tokens=4, warmup=10)
    assert report["swaps_out"] > 0
    assert report["rss_growth_mib"] < 32, report
