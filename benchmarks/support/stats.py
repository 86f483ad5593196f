"""Small statistics for the benchmarks: percentiles, least-squares slopes with confidence intervals.

No scipy: the Student t quantile comes from a table (df ≤ 30) and a Cornish-Fisher expansion above it, which is
within 0.2 % of the exact value there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

# Two-sided 95 % critical values t_{0.975, df} for df = 1..30.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
_Z975 = 1.959964


def t_critical_95(df: float) -> float:
    """Two-sided 95 % Student t critical value for ``df`` degrees of freedom (df ≥ 1; fractional df rounds down)."""
    if df < 1:
        raise ValueError(f"df={df}: a confidence interval needs at least 1 degree of freedom (≥ 3 points)")
    k = int(math.floor(df))
    if k <= 30:
        return _T975[k - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sample")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def summary(values: Sequence[float]) -> dict[str, float]:
    """p50, p90, mean, min, max and the count of a sample."""
    return {
        "p50": median(values),
        "p90": percentile(values, 90),
        "mean": sum(values) / len(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


@dataclasses.dataclass(frozen=True)
class Slope:
    """Least-squares line y = intercept + slope * x, with a two-sided 95 % interval on the slope."""

    slope: float  # units of y per unit of x
    intercept: float  # y at x = 0
    stderr: float  # standard error of the slope
    df: float  # degrees of freedom of the interval (points - 2, or Welch-Satterthwaite for a difference)
    ci_low: float  # slope - t * stderr
    ci_high: float  # slope + t * stderr
    n: int  # number of points fitted (0 for a difference of two fits)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def fit_slope(xs: Sequence[float], ys: Sequence[float]) -> Slope:
    """Ordinary least squares of ``ys`` on ``xs`` (each repeat is its own point). Needs ≥ 3 points, ≥ 2 distinct x."""
    n = len(xs)
    if n != len(ys):
        raise ValueError(f"xs has {n} points, ys has {len(ys)}")
    if n < 3:
        raise ValueError(f"a slope with a confidence interval needs at least 3 points, got {n}")
    mx = sum(xs) / n
    my = sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("all x values are equal: the slope is undefined")
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    intercept = my - slope * mx
    ssr = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    df = n - 2
    stderr = math.sqrt(ssr / df / sxx)
    t = t_critical_95(df)
    return Slope(slope, intercept, stderr, df, slope - t * stderr, slope + t * stderr, n)


def slope_difference(a: Slope, b: Slope) -> Slope:
    """a.slope - b.slope with a Welch-Satterthwaite interval (the two fits are independent samples)."""
    diff = a.slope - b.slope
    va, vb = a.stderr**2, b.stderr**2
    stderr = math.sqrt(va + vb)
    if stderr == 0:
        df = float(min(a.df, b.df))
    else:
        df = (va + vb) ** 2 / ((va**2 / a.df if a.df else 0) + (vb**2 / b.df if b.df else 0) or 1.0)
    df = max(1.0, df)
    t = t_critical_95(df)
    return Slope(diff, a.intercept - b.intercept, stderr, df, diff - t * stderr, diff + t * stderr, 0)


def flatness(values: Sequence[float], reference: float) -> float:
    """Largest relative deviation of ``values`` from ``reference`` (0.2 = ±20 %)."""
    if reference <= 0:
        raise ValueError(f"reference {reference} must be positive")
    return max(abs(v - reference) / reference for v in values)


def paired_ratio_ci(
    num: Sequence[float], den: Sequence[float], resamples: int = 2000, seed: int = 0, q: float = 50
) -> tuple[float, float, float]:
    """median(num) / median(den) (or another percentile ``q``) with a 95 % percentile-bootstrap interval, resampling
    the *pairs* (num[i], den[i]): samples taken side by side (the same round of an interleaved run) share the
    machine's load of that moment, so a pair is the unit that keeps it. Returns (ratio, low, high); the seed makes
    the interval reproducible. Needs ≥ 2 pairs."""
    import random

    if len(num) != len(den) or len(num) < 2:
        raise ValueError(f"paired_ratio_ci needs two samples of equal length ≥ 2 (got {len(num)} and {len(den)})")
    rng = random.Random(seed)
    n = len(num)
    point = percentile(num, q) / percentile(den, q)
    ratios = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        ratios.append(percentile([num[i] for i in idx], q) / percentile([den[i] for i in idx], q))
    return point, percentile(ratios, 2.5), percentile(ratios, 97.5)
