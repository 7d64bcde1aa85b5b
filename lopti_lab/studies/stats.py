"""95% confidence intervals over seeds, paired t-tests, Holm's correction and power: Student's t (central and
noncentral) without scipy (a report asks for a few quantiles at most).

ci95([0.61, 0.64, 0.58])     # half-width of the 95% interval of the mean: t(0.975, 2) x sd / sqrt(3)
paired_t([0.01, 0.03, -0.02, 0.04])        # mean, 95% interval, t, two-sided p, seeds above / level / below
holm([0.01, 0.04, 0.03])                   # [0.03, 0.06, 0.06]: Holm-adjusted p-values, in the given order
detectable_effect(sd=0.046, n=10, alpha=0.05 / 3)   # smallest true mean difference found 80% of the time

The confirmatory study's primary analysis (docs/hard_lab.md, "Confirmatory study: pre-registration") is
``studies.primary.primary_table``, built from these.
"""

from __future__ import annotations

import math
from functools import cache

import pandas as pd

__all__ = ["ci95", "detectable_effect", "holm", "nct_sf", "paired_t", "t_cdf", "t_power", "t_quantile", "t_sf"]


def t_cdf(x: float, df: int) -> float:
    """Student's t distribution function with ``df`` degrees of freedom, by Simpson's rule on its density from 0 to
    |x| (the density is smooth and bounded, so 4,000 panels give about 1e-10)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(t: float) -> float:
        return math.exp(log_norm - (df + 1) / 2 * math.log1p(t * t / df))

    a, panels = abs(x), 4000
    h = a / panels
    area = density(0.0) + density(a)
    area += sum((4 if i % 2 else 2) * density(i * h) for i in range(1, panels))
    half = area * h / 3
    return 0.5 + math.copysign(half, x)


@cache  # a report asks for the same few (0.975, n - 1) quantiles once per table cell
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on `t_cdf`, to 1e-9)."""
    if not 0.5 <= p < 1:
        raise ValueError(f"p must be in [0.5, 1), got {p}")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2
    while hi - lo > 1e-9:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def ci95(values) -> float:
    """Half-width of the 95% confidence interval of the mean of ``values`` (independent seeds): t(0.975, n - 1) x
    sample sd / sqrt(n); NaN for fewer than two values."""
    values = pd.Series(values, dtype=float).dropna()
    n = len(values)
    if n < 2:
        return math.nan
    return t_quantile(0.975, n - 1) * float(values.std(ddof=1)) / math.sqrt(n)


LEVEL = 1e-12
"""A paired difference within this of 0 is a tie: "level", counted neither above nor below (as tables.py counts)."""


def t_sf(x: float, df: int) -> float:
    """P(T > x) for Student's t with ``df`` degrees of freedom, computed from the density's tail so that a small p
    keeps its digits (1 - t_cdf would lose them)."""
    if x < 0:
        return 1.0 - t_sf(-x, df)
    return 0.5 - (t_cdf(x, df) - 0.5)


def paired_t(diffs, confidence: float = 0.95) -> dict[str, float]:
    """The paired t-test of per-seed differences ``diffs`` (method - GRPO at each seed) against 0.

    Keys: n, mean, sd (ddof 1), half (the ``confidence`` interval's half-width, t(1 - (1 - c) / 2, n - 1) x sd /
    sqrt(n)), low, high, t (mean / (sd / sqrt(n))), p (two-sided), above / level / below (seeds with a difference
    > 0, = 0, < 0; LEVEL). Worked example: diffs [1, 2, 3]: mean 2, sd 1, t = 2 sqrt(3) = 3.4641 on 2 degrees of
    freedom, whose CDF is 1/2 + t / (2 sqrt(2 + t^2)), so p = 1 - 2 sqrt(3) / sqrt(14) = 0.07418."""
    values = pd.Series(diffs, dtype=float).dropna()
    n = len(values)
    if n < 2:
        raise ValueError(f"a paired t-test needs at least 2 differences, got {n}")
    mean, sd = float(values.mean()), float(values.std(ddof=1))
    se = sd / math.sqrt(n)
    half = t_quantile(1 - (1 - confidence) / 2, n - 1) * se
    t = mean / se if se > 0 else math.copysign(math.inf, mean) if mean else math.nan
    p = 2 * t_sf(abs(t), n - 1) if math.isfinite(t) else (0.0 if not math.isnan(t) else 1.0)
    return {
        "n": n, "mean": mean, "sd": sd, "half": half, "low": mean - half, "high": mean + half, "t": t, "p": min(p, 1.0),
        "above": int((values > LEVEL).sum()), "level": int((values.abs() <= LEVEL).sum()),
        "below": int((values < -LEVEL).sum()),
    }  # fmt: skip


def holm(pvalues) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: the i-th smallest p (i = 1..m) times m - i + 1, made
    non-decreasing in that order and capped at 1. A hypothesis is rejected at family-wise level alpha when its
    adjusted p <= alpha. Example: [0.01, 0.04, 0.03] -> sorted 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04
    -> 0.06 (non-decreasing) -> [0.03, 0.06, 0.06]."""
    p = [float(v) for v in pvalues]
    m, adjusted, running = len(p), [math.nan] * len(p), 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda k: p[k])):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return adjusted


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def nct_sf(x: float, df: int, ncp: float, panels: int = 4000) -> float:
    """P(T' > x) for the noncentral t, T' = (Z + ncp) / S with S = sqrt(chi2(df) / df): the mean over S's density
    of P(Z > x S - ncp), by Simpson's rule over S in [0, 1 + 12 / sqrt(df) + 4] (beyond, S's density is below 1e-30
    relative to its mode). Matches R's power.t.test(n = 20, delta = 1) (two samples: df 38, ncp sqrt(10), upper
    tail beyond t(0.975, 38)): 0.8689528 (tests/test_confirm_stats.py)."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    log_norm = math.log(2) + (df / 2) * math.log(df / 2) - math.lgamma(df / 2)

    def integrand(s: float) -> float:
        if s <= 0:
            return 0.0 if df > 1 else math.exp(log_norm) * _normal_cdf(ncp - x * s)  # df 1: the density is 2/sqrt(2pi)
        density = math.exp(log_norm + (df - 1) * math.log(s) - df * s * s / 2)
        return density * _normal_cdf(ncp - x * s)

    top = 1 + 12 / math.sqrt(df) + 4
    h = top / panels
    area = integrand(0.0) + integrand(top)
    area += sum((4 if i % 2 else 2) * integrand(i * h) for i in range(1, panels))
    return area * h / 3


def t_power(effect: float, sd: float, n: int, alpha: float = 0.05) -> float:
    """Power of the two-sided paired t-test at level ``alpha`` with ``n`` seeds when the true mean difference is
    ``effect`` and the differences' SD is ``sd``: P(|T'| > t(1 - alpha / 2, n - 1)) with ncp = effect / (sd /
    sqrt(n)), both tails."""
    ncp, crit = effect / (sd / math.sqrt(n)), t_quantile(1 - alpha / 2, n - 1)
    return nct_sf(crit, n - 1, ncp) + nct_sf(crit, n - 1, -ncp)


def detectable_effect(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true mean difference that the two-sided paired t-test at level ``alpha`` with ``n`` seeds finds
    with probability ``power`` when the differences' SD is ``sd`` (bisection on ``t_power``, to 1e-6 of sd). Near
    (t(1 - alpha / 2, n - 1) + t(power, n - 1)) x sd / sqrt(n), the usual approximation, and a little above it."""
    if sd <= 0 or n < 2:
        raise ValueError(f"sd must be > 0 and n >= 2, got sd={sd}, n={n}")
    lo, hi = 0.0, sd
    while t_power(hi, sd, n, alpha) < power:
        hi *= 2
    while hi - lo > 1e-6 * sd:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_power(mid, sd, n, alpha) < power else (lo, mid)
    return (lo + hi) / 2
