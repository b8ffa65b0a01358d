"""Latency histograms: HDR (``hdrhistogram``) at microsecond resolution, in seconds at the API.

Why HDR: a tail percentile (p99.9) from a 20-second run needs every sample,
not a reservoir, and the bench and the simulator must merge histograms of
several runs or replicas exactly. An HDR histogram keeps 3 significant
digits from 1 µs to 60 s in a few tens of KB, records in O(1) and merges by
adding counts.

Values outside the range are clamped to it (and counted in ``clamped``) so
that one absurd sample never loses a run.
"""

from __future__ import annotations

from dataclasses import dataclass

from hdrh.histogram import HdrHistogram

LOWEST_US = 1
HIGHEST_US = 60_000_000  # 60 s
SIGNIFICANT_DIGITS = 3

# The fractions at which ``cdf_points`` samples the distribution: even steps, then the tail.
_CDF_FRACTIONS = tuple(sorted({round(0.01 * i, 4) for i in range(1, 100)}
                              | {0.001, 0.005, 0.995, 0.999, 0.9995, 0.9999, 1.0}))


@dataclass(frozen=True)
class Summary:
    """The figures the bench reports from one histogram, in seconds (0.0 when empty)."""

    count: int
    mean_s: float
    p50_s: float
    p90_s: float
    p99_s: float
    p999_s: float
    max_s: float


class LatencyHistogram:
    """Record latencies in seconds; read percentiles, mean, count and CDF points in seconds."""

    def __init__(self) -> None:
        self._h = HdrHistogram(LOWEST_US, HIGHEST_US, SIGNIFICANT_DIGITS)
        self.clamped = 0  # samples below 1 µs or above 60 s, recorded at the nearest bound

    def record(self, seconds: float, count: int = 1) -> None:
        us = seconds * 1_000_000
        if not LOWEST_US <= us <= HIGHEST_US:  # also NaN and infinities: NaN counts as the worst
            self.clamped += count
            us = LOWEST_US if us < LOWEST_US else HIGHEST_US
        self._h.record_value(round(us), count)

    def merge(self, other: LatencyHistogram) -> None:
        """Add ``other``'s samples to this one (exactly as if they had been recorded here)."""
        self._h.add(other._h)
        self.clamped += other.clamped

    @property
    def count(self) -> int:
        return int(self._h.get_total_count())

    def percentile(self, p: float) -> float:
        """The value at percentile ``p`` (0..100) in seconds, to 3 significant digits; 0.0 when empty."""
        if not 0 <= p <= 100:
            raise ValueError(f"percentile must be in [0, 100], got {p}")
        return self._h.get_value_at_percentile(p) / 1e6 if self.count else 0.0

    def mean(self) -> float:
        return self._h.get_mean_value() / 1e6 if self.count else 0.0

    def max(self) -> float:
        return self._h.get_max_value() / 1e6 if self.count else 0.0

    def summary(self) -> Summary:
        return Summary(self.count, self.mean(), self.percentile(50), self.percentile(90), self.percentile(99),
                       self.percentile(99.9), self.max())

    def cdf_points(self) -> tuple[tuple[float, float], ...]:
        """``(latency_s, cumulative fraction)`` pairs for a CDF plot: ~100 even steps plus the tail to p99.99
        and the maximum. Both coordinates are non-decreasing. Empty when nothing was recorded."""
        if not self.count:
            return ()
        return tuple((self._h.get_value_at_percentile(f * 100) / 1e6, f) for f in _CDF_FRACTIONS)
