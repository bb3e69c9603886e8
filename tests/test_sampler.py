"""Sampler properties: greedy, filters, penalty, reproducibility, distribution, validation."""

from __future__ import annotations

import pytest
import torch

from ember.models.support.errors import ConfigError
from ember.offload.decode.sampler import Sampler, apply_repeat_penalty, filter_candidates
from ember.offload.options.sampling import GREEDY, SamplingParams

LOGITS = torch.tensor([1.0, 3.0, 2.0, 0.5, -1.0, 2.9])


def test_temperature_zero_is_argmax():
    assert Sampler(GREEDY)(LOGITS) == 1


def test_top_k_one_is_argmax_at_any_temperature():
    s = Sampler(SamplingParams(temperature=5.0, top_k=1, seed=1))
    assert all(s(LOGITS) == 1 for _ in range(20))


def test_same_seed_same_draws_and_different_seed_differs():
    p = dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    a = [Sampler(SamplingParams(seed=7, **p))(LOGITS) for _ in range(1)]
    s1, s2, s3 = (Sampler(SamplingParams(seed=s, **p)) for s in (7, 7, 8))
    d1 = [s1(LOGITS) for _ in range(50)]
    assert d1 == [s2(LOGITS) for _ in range(50)]
    assert d1 != [s3(LOGITS) for _ in range(50)]
    assert a[0] == d1[0]


def test_draws_follow_softmax_at_temperature_one():
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0))
    n = 6000
    counts = torch.bincount(torch.tensor([s(LOGITS) for _ in range(n)]), minlength=len(LOGITS))
    expected = torch.softmax(LOGITS, -1) * n
    # Within 5 standard deviations of a binomial count.
    assert ((counts - expected).abs() <= 5 * (expected * (1 - expected / n)).sqrt() + 1).all()


def test_top_p_keeps_smallest_prefix_reaching_mass():
    ids, probs = filter_candidates(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), 0, 0.75, 0.0)
    assert ids.tolist() == [0, 1]
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375]))


def test_min_p_drops_tokens_below_fraction_of_top():
    ids, _ = filter_candidates(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), 0, 1.0, 0.25)
    assert ids.tolist() == [0, 1, 2]


def test_filters_always_keep_one_candidate():
    ids, probs = filter_candidates(LOGITS, 0, 1e-9, 0.99)
    assert ids.tolist() == [1] and probs.tolist() == [1.0]


def test_repeat_penalty_lowers_seen_tokens_both_signs():
    out = apply_repeat_penalty(LOGITS, [1, 4], 2.0)
    assert out[1] == 1.5 and out[4] == -2.0 and out[0] == LOGITS[0]
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=2.0))(LOGITS, [1]) == 5


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0),
                                 dict(top_p=1.5), dict(min_p=1.0), dict(repeat_penalty=0),
                                 dict(repeat_last_n=-2), dict(presence_penalty=2.5),
                                 dict(frequency_penalty=-3), dict(logit_bias=((1, 101),)),
                                 dict(logit_bias=((-1, 1),)), dict(logprobs=21)])
def test_invalid_parameters_are_config_errors(bad):
    with pytest.raises(ConfigError):
        SamplingParams(**bad)


def test_penalties_count_generated_tokens_only():
    """OpenAI's: logit - count * frequency - presence, over what was generated (not the
    prompt: `prompt_len` marks where that starts)."""
    s = Sampler(SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25),
                prompt_len=2)
    out = s.process(LOGITS, [1, 1, 2, 2, 2, 5])  # the prompt's two 1s do not count
    want = LOGITS.clone()
    want[2] -= 3 * 0.5 + 0.25
    want[5] -= 0.5 + 0.25
    torch.testing.assert_close(out, want)
    assert s(LOGITS, [1, 1, 5, 5]) == 1  # 5 (2.9 - 1.25) fell below 2 and 3


def test_logit_bias_adds_and_leaves_the_callers_logits_alone():
    before = LOGITS.clone()
    s = Sampler(SamplingParams(temperature=0, logit_bias=((4, 10.0), (1, -100.0))))
    assert s(LOGITS) == 4
    assert torch.equal(LOGITS, before)


def test_logprobs_are_the_processed_distribution_before_the_filters():
    """Recorded under the token's position: the log-softmax after the bias, in float64,
    whatever temperature and top-k do to the draw."""
    params = SamplingParams(temperature=0.7, top_k=2, seed=3, logprobs=3,
                            logit_bias=((0, 1.5),))
    s = Sampler(params)
    token = s(LOGITS, [9, 9])
    biased = LOGITS.double().clone()
    biased[0] += 1.5
    reference = torch.log_softmax(biased, -1)
    entry = s.logprobs[2]
    assert entry.logprob == pytest.approx(float(reference[token]), abs=1e-6)
    top = reference.topk(3)
    assert [i for i, _ in entry.top] == top.indices.tolist()
    assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-6)
