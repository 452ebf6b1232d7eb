"""The statistics a study reports over replicates and across trials: mean ± std over seeds, differences to the
baseline paired by seed with a t confidence interval, and rank correlations with a bootstrap confidence interval."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 2000


@dataclass(frozen=True)
class Summary:
    mean: float
    std: float  # sample standard deviation (n - 1); NaN for one value
    n: int

    def __str__(self) -> str:
        if self.n == 0:
            return "-"
        return f"{self.mean:.4f}" + (f" ± {self.std:.4f}" if self.n > 1 else "") + f" (n={self.n})"


def summarize(values: list[float]) -> Summary:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return Summary(math.nan, math.nan, 0)
    std = float(np.std(finite, ddof=1)) if len(finite) > 1 else math.nan
    return Summary(float(np.mean(finite)), std, len(finite))


@dataclass(frozen=True)
class PairedDifference:
    """A configuration's metric minus the baseline's, seed by seed: mean, std, n and a t confidence interval of the
    mean. `beyond_noise`: the interval excludes 0, so the difference is larger than the seed-to-seed noise."""

    mean: float
    std: float
    n: int
    low: float
    high: float

    @property
    def beyond_noise(self) -> bool:
        return self.n > 1 and (self.low > 0 or self.high < 0)

    def __str__(self) -> str:
        if self.n == 0:
            return "-"
        if self.n == 1:
            return f"{self.mean:+.4f} (n=1)"
        return (f"{self.mean:+.4f} [{self.low:+.4f}, {self.high:+.4f}] (n={self.n})"
                + (" *" if self.beyond_noise else ""))


def paired_difference(values: dict[int, float], baseline: dict[int, float]) -> PairedDifference:
    """`values` and `baseline` map seed -> metric; the seeds both have a finite value for are paired."""
    seeds = sorted(s for s in values if s in baseline and math.isfinite(values[s]) and math.isfinite(baseline[s]))
    differences = np.array([values[s] - baseline[s] for s in seeds], dtype=np.float64)
    n = len(differences)
    if n == 0:
        return PairedDifference(math.nan, math.nan, 0, math.nan, math.nan)
    mean = float(differences.mean())
    if n == 1:
        return PairedDifference(mean, math.nan, 1, math.nan, math.nan)
    std = float(differences.std(ddof=1))
    from scipy import stats  # here: a second of import that `lapstudy status` without replicates never needs

    half = float(stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1)) * std / math.sqrt(n)
    return PairedDifference(mean, std, n, mean - half, mean + half)


@dataclass(frozen=True)
class RankCorrelation:
    """Spearman's rho between two quantities across trials, with a percentile bootstrap confidence interval."""

    rho: float
    low: float
    high: float
    n: int

    def __str__(self) -> str:
        if self.n < 3:
            return f"n={self.n}: too few"
        return f"rho {self.rho:+.2f} [{self.low:+.2f}, {self.high:+.2f}] (n={self.n})"


def rank_correlation(x: list[float], y: list[float], seed: int = 0) -> RankCorrelation:
    pairs = [(a, b) for a, b in zip(x, y) if math.isfinite(a) and math.isfinite(b)]
    n = len(pairs)
    if n < 3:
        return RankCorrelation(math.nan, math.nan, math.nan, n)
    a, b = (np.array(column, dtype=np.float64) for column in zip(*pairs))
    if np.ptp(a) == 0 or np.ptp(b) == 0:  # a quantity that did not vary: no ranking to correlate
        return RankCorrelation(math.nan, math.nan, math.nan, n)
    from scipy import stats

    rho = float(stats.spearmanr(a, b).statistic)
    # The percentile bootstrap written out rather than scipy.stats.bootstrap: with a few trials, or tied values (a
    # grid's k, replicates), some resamples hold one value of a quantity, whose rho is undefined; scipy's interval is
    # then NaN, while the interval over the resamples that do rank is the one to report.
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, n, size=(BOOTSTRAP_RESAMPLES, n))
    ranked = [(a[i], b[i]) for i in draws if np.ptp(a[i]) > 0 and np.ptp(b[i]) > 0]
    rhos = [stats.spearmanr(u, v).statistic for u, v in ranked]
    low, high = np.percentile(rhos, [50 * (1 - CONFIDENCE), 50 * (1 + CONFIDENCE)])
    return RankCorrelation(rho, float(low), float(high), n)
