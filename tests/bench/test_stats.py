"""The benchmark statistics: percentiles, least-squares slopes and their 95 % intervals."""

from __future__ import annotations

import random

import pytest

from benchmarks.support import stats


def test_percentiles_match_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert stats.median(xs) == 3.0
    assert stats.percentile(xs, 90) == pytest.approx(4.6)
    assert stats.percentile(xs, 0) == 1.0
    assert stats.percentile(xs, 100) == 5.0
    s = stats.summary(xs)
    assert (s["p50"], s["min"], s["max"], s["n"]) == (3.0, 1.0, 5.0, 5)


def test_exact_line_has_zero_width_interval():
    xs = [2, 8, 13, 20, 26]
    fit = stats.fit_slope(xs, [10 + 2.5 * x for x in xs])
    assert fit.slope == pytest.approx(2.5)
    assert fit.intercept == pytest.approx(10)
    assert fit.stderr == pytest.approx(0, abs=1e-12)
    assert fit.ci_low == pytest.approx(2.5) and fit.ci_high == pytest.approx(2.5)
    assert (fit.n, fit.df) == (5, 3)


def test_interval_covers_known_slope_about_95_percent_of_the_time():
    rng = random.Random(7)
    xs = [n for n in (2, 8, 13, 20, 26) for _ in range(5)]
    trials, covered = 400, 0
    for _ in range(trials):
        ys = [40 + 0.3 * x + rng.gauss(0, 2.0) for x in xs]
        fit = stats.fit_slope(xs, ys)
        covered += fit.ci_low <= 0.3 <= fit.ci_high
    assert 0.91 <= covered / trials <= 0.99


def test_stderr_matches_the_textbook_formula():
    xs = [1.0, 2.0, 3.0, 4.0]
    ys = [1.0, 3.0, 2.0, 5.0]
    fit = stats.fit_slope(xs, ys)
    # slope = Sxy/Sxx = 5.5/5 = 1.1; residuals give SSR = 2.7, so se = sqrt(2.7 / 2 / 5)
    assert fit.slope == pytest.approx(1.1)
    assert fit.stderr == pytest.approx((2.7 / 2 / 5) ** 0.5)
    assert fit.ci_high - fit.slope == pytest.approx(4.303 * fit.stderr)


def test_difference_of_slopes_combines_errors():
    rng = random.Random(3)
    xs = [n for n in (2, 13, 26) for _ in range(6)]
    images = stats.fit_slope(xs, [20 + 1.5 * x + rng.gauss(0, 0.5) for x in xs])
    control = stats.fit_slope(xs, [20 + 1.2 * x + rng.gauss(0, 0.5) for x in xs])
    diff = stats.slope_difference(images, control)
    assert diff.slope == pytest.approx(images.slope - control.slope)
    assert diff.stderr == pytest.approx((images.stderr**2 + control.stderr**2) ** 0.5)
    assert diff.ci_low < 0.3 < diff.ci_high
    assert min(images.df, control.df) <= diff.df <= images.df + control.df


def test_t_critical_values():
    assert stats.t_critical_95(1) == 12.706
    assert stats.t_critical_95(30) == 2.042
    assert stats.t_critical_95(60) == pytest.approx(2.000, abs=0.003)
    assert stats.t_critical_95(1000) == pytest.approx(1.962, abs=0.002)
    with pytest.raises(ValueError, match="degree of freedom"):
        stats.t_critical_95(0)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="at least 3 points"):
        stats.fit_slope([1, 2], [1, 2])
    with pytest.raises(ValueError, match="all x values are equal"):
        stats.fit_slope([2, 2, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="xs has"):
        stats.fit_slope([1, 2, 3], [1, 2])


def test_flatness():
    assert stats.flatness([1.0, 1.1, 0.9], 1.0) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        stats.flatness([1.0], 0.0)


def test_paired_ratio_ci_brackets_the_ratio_and_is_reproducible():
    rng = random.Random(3)
    den = [20 + rng.gauss(0, 1) for _ in range(15)]
    num = [1.1 * d for d in den]  # every pair exactly 1.1: the interval collapses onto it
    ratio, lo, hi = stats.paired_ratio_ci(num, den)
    assert ratio == pytest.approx(1.1) and lo == pytest.approx(1.1) and hi == pytest.approx(1.1)
    noisy = [d * 1.1 + rng.gauss(0, 2) for d in den]
    r1 = stats.paired_ratio_ci(noisy, den, seed=5)
    assert r1 == stats.paired_ratio_ci(noisy, den, seed=5)
    assert r1[1] <= r1[0] <= r1[2] and r1[2] - r1[1] > 0
    with pytest.raises(ValueError):
        stats.paired_ratio_ci([1.0], [1.0])
