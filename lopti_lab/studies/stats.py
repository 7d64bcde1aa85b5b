"""95% confidence intervals over seeds: Student's t without scipy (a report asks for a few quantiles at most).

ci95([0.61, 0.64, 0.58])     # half-width of the 95% interval of the mean: t(0.975, 2) x sd / sqrt(3)
"""

from __future__ import annotations

import math
from functools import cache

import pandas as pd

__all__ = ["ci95", "t_cdf", "t_quantile"]


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
