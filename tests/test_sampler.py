"""Sampler properties: greedy, filters, penalty, reproducibility, distribution, validation."""

from __future__ import annotations

import pytest
import torch

from ember.models.errors import ConfigError
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
                                 dict(repeat_last_n=-2)])
def test_invalid_parameters_are_config_errors(bad):
    with pytest.raises(ConfigError):
        SamplingParams(**bad)
