"""The statistics the study's status, export and report print: replicate summaries, differences against the baseline
paired by seed, and rank correlations across trials, each against its textbook definition written out here."""

import math
import random
import warnings

import pytest

from study.stats import paired_difference, rank_correlation, summarize


def test_summary_is_the_mean_and_sample_std_of_the_finite_values():
    s = summarize([1.0, 2.0, 4.0, math.nan])
    mean = 7 / 3
    assert s.n == 3 and s.mean == pytest.approx(mean)
    assert s.std == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in (1, 2, 4)) / 2))
    assert math.isnan(summarize([5.0]).std) and summarize([]).n == 0


def test_paired_difference_pairs_by_seed_and_gives_the_t_interval():
    values = {0: 0.80, 1: 0.77, 2: 0.90, 7: 0.5}  # seed 7 has no baseline: left out
    baseline = {0: 0.70, 1: 0.68, 2: 0.81, 3: 0.6}
    d = paired_difference(values, baseline)
    diffs = [0.10, 0.09, 0.09]
    mean = sum(diffs) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in diffs) / 2)
    t_975_df2 = 4.302652729911275  # Student's t, 97.5th percentile, 2 degrees of freedom (tables)
    assert (d.n, d.mean, d.std) == (3, pytest.approx(mean), pytest.approx(std))
    assert (d.low, d.high) == (pytest.approx(mean - t_975_df2 * std / math.sqrt(3)),
                               pytest.approx(mean + t_975_df2 * std / math.sqrt(3)))
    assert d.beyond_noise  # every seed gained: the interval excludes 0
    assert not paired_difference({0: 0.1, 1: 0.2, 2: 0.3}, {0: 0.2, 1: 0.1, 2: 0.35}).beyond_noise


def spearman_by_definition(x, y):
    """Pearson's correlation of the ranks (no ties in these tests)."""
    rank = lambda v: {value: i for i, value in enumerate(sorted(v))}  # noqa: E731
    rx, ry = rank(x), rank(y)
    a, b = [rx[v] for v in x], [ry[v] for v in y]
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((p - ma) * (q - mb) for p, q in zip(a, b))
    return cov / math.sqrt(sum((p - ma) ** 2 for p in a) * sum((q - mb) ** 2 for q in b))


def test_rank_correlation_is_spearmans_rho_with_an_interval_around_it():
    rng = random.Random(0)
    x = [rng.random() for _ in range(30)]
    y = [v + 0.3 * rng.random() for v in x]
    r = rank_correlation(x, y)
    assert r.n == 30 and r.rho == pytest.approx(spearman_by_definition(x, y))
    assert r.low <= r.rho <= r.high and r.low > 0  # a strong monotone relation: the interval excludes 0
    assert rank_correlation(x, [-v for v in y]).rho == pytest.approx(-r.rho)


def test_rank_correlation_of_a_quantity_that_did_not_vary_is_undefined_and_quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the report runs at the end of every study: no warnings on its output
        constant = rank_correlation([0.1, 0.2, 0.3, 0.4], [0.5, 0.5, 0.5, 0.5])
        few = rank_correlation([0.1, 0.3, 0.2, 0.4], [0.2, 0.1, 0.4, 0.3])  # resamples repeat values
    assert constant.n == 4 and math.isnan(constant.rho) and math.isnan(constant.low)
    assert math.isfinite(few.rho) and few.low <= few.rho <= few.high
    assert math.isnan(rank_correlation([1.0, 2.0], [1.0, 2.0]).rho)  # n < 3
