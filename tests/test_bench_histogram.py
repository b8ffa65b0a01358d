"""The bench's HDR latency histogram: percentiles of known distributions, merging, clamping, CDF points."""

from __future__ import annotations

import random

import pytest

from inferlb.bench.report.histogram import HIGHEST_US, LatencyHistogram

PRECISION = 1e-3  # 3 significant digits


def uniform_ms(lo: int, hi: int) -> LatencyHistogram:
    h = LatencyHistogram()
    for ms in range(lo, hi + 1):
        h.record(ms / 1000)
    return h


def test_percentiles_of_a_uniform_distribution() -> None:
    h = uniform_ms(1, 10_000)  # 1 ms .. 10 s, one sample each
    assert h.count == 10_000
    for p, expected_s in ((50, 5.0), (90, 9.0), (99, 9.9), (99.9, 9.99)):
        assert h.percentile(p) == pytest.approx(expected_s, rel=2 * PRECISION)
    assert h.mean() == pytest.approx(5.0005, rel=PRECISION)
    assert h.max() == pytest.approx(10.0, rel=PRECISION)
    s = h.summary()
    assert (s.count, s.p50_s, s.p99_s) == (10_000, h.percentile(50), h.percentile(99))
    assert s.p50_s <= s.p90_s <= s.p99_s <= s.p999_s <= s.max_s


def test_microsecond_resolution_at_the_bottom() -> None:
    h = LatencyHistogram()
    for us in (5, 10, 250):
        h.record(us / 1e6)
    assert h.percentile(0) == pytest.approx(5e-6)
    assert h.percentile(50) == pytest.approx(10e-6)
    assert h.max() == pytest.approx(250e-6, rel=PRECISION)


def test_a_skewed_distribution_keeps_its_tail() -> None:
    h = LatencyHistogram()
    h.record(0.002, count=9_990)
    h.record(1.5, count=10)  # 0.1% of requests are 750x slower
    assert h.percentile(99) == pytest.approx(0.002, rel=PRECISION)
    assert h.percentile(99.95) == pytest.approx(1.5, rel=PRECISION)
    assert h.mean() == pytest.approx((0.002 * 9_990 + 1.5 * 10) / 10_000, rel=PRECISION)


def test_merge_equals_recording_everything_in_one() -> None:
    rng = random.Random(1)
    values = [rng.lognormvariate(-4, 1.2) for _ in range(20_000)]
    a, b, together = LatencyHistogram(), LatencyHistogram(), LatencyHistogram()
    for i, v in enumerate(values):
        (a if i % 3 else b).record(v)
        together.record(v)
    a.merge(b)
    assert a.count == together.count == len(values)
    assert a.summary() == together.summary()
    assert a.cdf_points() == together.cdf_points()


def test_values_out_of_range_are_clamped_and_counted() -> None:
    h = LatencyHistogram()
    h.record(0.010)
    h.record(0.0)  # below 1 µs
    h.record(-0.5)  # a clock that went backwards
    h.record(3600.0)  # an hour: beyond 60 s
    h.record(float("inf"))
    h.record(float("nan"))
    assert h.count == 6 and h.clamped == 5
    assert h.percentile(0) == pytest.approx(1e-6)
    assert h.max() == pytest.approx(HIGHEST_US / 1e6, rel=PRECISION)
    other = LatencyHistogram()
    other.record(100.0)
    h.merge(other)
    assert h.clamped == 6


def test_empty_histogram_reads_zero() -> None:
    h = LatencyHistogram()
    assert h.count == 0 and h.percentile(99) == 0.0 and h.mean() == 0.0 and h.cdf_points() == ()


def test_percentile_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="percentile"):
        uniform_ms(1, 10).percentile(101)


def test_cdf_points_are_monotone_and_reach_one() -> None:
    h = uniform_ms(1, 1000)
    points = h.cdf_points()
    xs, ys = [x for x, _ in points], [y for _, y in points]
    assert xs == sorted(xs) and ys == sorted(ys)
    assert ys[-1] == 1.0 and xs[-1] == pytest.approx(1.0, rel=PRECISION)
    assert dict((y, x) for x, y in points)[0.5] == pytest.approx(0.5, rel=2 * PRECISION)
    assert 50 <= len(points) <= 200  # bounded: it goes into every RunResult's JSON
