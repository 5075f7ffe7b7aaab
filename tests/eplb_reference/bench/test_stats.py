"""The bench's statistics: paired bootstrap intervals, percentiles over medians."""

import pytest
import torch

from eplb_reference.bench.stats import over_median, rearrangement_lengths


def test_paired_ratio_interval_brackets_the_true_ratio():
    from eplb_reference.bench.stats import paired_ratio_interval

    generator = torch.Generator().manual_seed(3)
    off = (3 + torch.rand(400, generator=generator)).tolist()  # a drifting machine: 3-4 ms steps
    exact = [1.1 * ms for ms in off]
    assert paired_ratio_interval(exact, off) == pytest.approx((1.1, 1.1))
    noisy = [1.04 * ms + float(torch.randn((), generator=generator)) * 0.3 for ms in off]
    low, high = paired_ratio_interval(noisy, off)
    assert low < 1.04 < high and high - low < 0.1
    short_low, short_high = paired_ratio_interval(noisy[:40], off[:40])
    assert short_high - short_low > high - low  # fewer steps, less certainty
    with pytest.raises(ValueError, match="paired series"):
        paired_ratio_interval(noisy[:39], off[:40])


def test_over_median_is_none_without_steps_on_either_side():
    steady, busy = [2.0, 2.0, 4.0, 3.0], [3.0, 5.0, 9.0]
    assert over_median(busy, steady) == 2.0  # median 5 over median 2.5
    assert over_median(busy, steady, 99) == 3.6  # the slowest busy step, 9, over 2.5
    assert over_median([], steady) is None and over_median(busy, []) is None


def test_a_rearrangement_is_as_long_as_its_run_of_busy_steps_and_an_unfinished_one_does_not_count():
    flags = [False, True, True, True, False, False, True, False, True, True]
    assert rearrangement_lengths(flags) == [3, 1]
    assert rearrangement_lengths([False, False]) == []
