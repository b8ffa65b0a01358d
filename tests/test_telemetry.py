"""Scrape text -> Sample -> window figures -> smoothed Telemetry, on real Prometheus exposition text."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from control_plane.model import Telemetry
from control_plane.telemetry.parse import (
    WindowFigures,
    histogram_quantile,
    is_stale,
    parse_sample,
    smooth,
    window,
)

# The worker's latency buckets, restated: the control plane reads them off the wire, never imports workers.
LATENCY_BUCKETS = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048, 4.096, 8.192)


class FakeWorkerMetrics:
    """A stand-in for a worker's /metrics: the worker's metric names, values the test controls."""

    def __init__(self, start_time: float = 1_700_000_000.0) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("inferlb_worker_requests", "Requests by status.", ["code"], registry=r)
        self.duration = Histogram(
            "inferlb_worker_request_duration_seconds", "Request time.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            "inferlb_worker_queue_wait_seconds", "Queue wait.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.compute = Histogram(
            "inferlb_worker_batch_compute_seconds", "Batch time.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tokens = Counter("inferlb_worker_tokens", "Tokens.", registry=r)
        self.inputs = Counter("inferlb_worker_inputs", "Inputs.", registry=r)
        self.queue_depth = Gauge("inferlb_worker_queue_depth", "Queued inputs.", registry=r)
        self.inflight = Gauge("inferlb_worker_inflight_requests", "In flight.", registry=r)
        self.cpu = Gauge("inferlb_worker_cpu_utilization", "CPU 0..1.", registry=r)
        self.batch_cost = Gauge("inferlb_worker_batch_cost_seconds", "Batch fit.", ["term"], registry=r)
        Gauge("process_start_time_seconds", "Start time.", registry=r).set(start_time)

    def request(self, *, code: int = 200, seconds: float = 0.01, tokens: int = 0, queue_s: float | None = None) -> None:
        self.requests.labels(code=str(code)).inc()
        self.duration.observe(seconds)
        if tokens:
            self.tokens.inc(tokens)
            self.inputs.inc()
        if queue_s is not None:
            self.queue_wait.observe(queue_s)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def test_parse_a_fresh_worker() -> None:
    m = FakeWorkerMetrics()
    m.cpu.set(0.25)
    m.queue_depth.set(3)
    m.inflight.set(2)
    m.batch_cost.labels(term="per_token").set(0.0001)
    m.batch_cost.labels(term="fixed").set(0.002)
    s = parse_sample(m.text(), at=5.0)
    assert s.at == 5.0 and s.requests_total == 0 and s.duration.count == 0
    assert (s.cpu_utilization, s.queue_depth, s.inflight) == (0.25, 3, 2)
    assert (s.batch_cost_per_token_s, s.batch_cost_fixed_s) == (0.0001, 0.002)
    assert s.process_start_time == 1_700_000_000.0
    assert math.isinf(s.duration.buckets[-1][0]) and len(s.duration.buckets) == len(LATENCY_BUCKETS) + 1


def test_request_classes() -> None:
    m = FakeWorkerMetrics()
    for code, n in ((200, 5), (400, 2), (404, 1), (429, 3), (500, 1), (503, 2)):
        for _ in range(n):
            m.request(code=code)
    s = parse_sample(m.text(), at=0.0)
    assert (s.requests_total, s.requests_2xx, s.requests_4xx, s.requests_429, s.requests_5xx) == (14, 5, 3, 3, 3)


def test_window_deltas_rates_latency_per_token_and_error_rate() -> None:
    m = FakeWorkerMetrics()
    for _ in range(4):  # before the window: must not count
        m.request(seconds=2.0, tokens=1000)
    prev = parse_sample(m.text(), at=10.0)
    for _ in range(10):
        m.request(seconds=0.01, tokens=50, queue_s=0.002)
    m.request(code=503, seconds=0.001)
    m.request(code=429, seconds=0.001)
    m.request(code=400, seconds=0.001)
    f = window(prev, parse_sample(m.text(), at=12.0))
    assert f.interval_s == 2.0 and f.requests == 13 and not f.restarted
    assert f.rps == pytest.approx(6.5)
    assert f.tokens_per_s == pytest.approx(250.0)
    assert f.inputs_per_s == pytest.approx(5.0)
    assert f.latency_mean_s == pytest.approx((10 * 0.01 + 3 * 0.001) / 13)
    assert f.latency_per_token_s == pytest.approx((10 * 0.01 + 3 * 0.001) / 500)
    assert f.queue_wait_mean_s == pytest.approx(0.002)
    assert f.error_rate == pytest.approx(2 / 13)  # 503 and 429 are the worker's; 400 is the client's


def test_percentiles_interpolate_within_the_window_buckets() -> None:
    m = FakeWorkerMetrics()
    for _ in range(50):
        m.request(seconds=3.0)  # an earlier, slow window
    prev = parse_sample(m.text(), at=0.0)
    for _ in range(100):
        m.request(seconds=0.01)  # all in (0.008, 0.016]
    f = window(prev, parse_sample(m.text(), at=1.0))
    assert f.latency_p50_s == pytest.approx(0.008 + 0.008 * 0.5)
    assert f.latency_p99_s == pytest.approx(0.008 + 0.008 * 0.99)


def test_histogram_quantile_like_prometheus() -> None:
    buckets = [(0.1, 10.0), (0.2, 30.0), (math.inf, 40.0)]
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)  # rank 10: top of the first bucket
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.15)  # rank 20: half-way through the second
    assert histogram_quantile(0.125, buckets) == pytest.approx(0.05)  # the first bucket starts at 0
    assert histogram_quantile(0.99, buckets) == 0.2  # in +Inf: the highest finite bound
    assert histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None


def test_idle_window_has_no_latency() -> None:
    m = FakeWorkerMetrics()
    m.request(tokens=10)
    prev = parse_sample(m.text(), at=0.0)
    f = window(prev, parse_sample(m.text(), at=0.5))
    assert (f.rps, f.tokens_per_s) == (0.0, 0.0)
    assert f.latency_mean_s is f.latency_p50_s is f.latency_p99_s is f.latency_per_token_s is None
    assert f.queue_wait_mean_s is None and f.error_rate is None


def test_counter_reset_counts_from_zero() -> None:
    old = FakeWorkerMetrics()
    for _ in range(100):
        old.request(tokens=10)
    prev = parse_sample(old.text(), at=0.0)
    new = FakeWorkerMetrics(start_time=1_700_000_100.0)  # the worker restarted
    for _ in range(3):
        new.request(seconds=0.02, tokens=10)
    f = window(prev, parse_sample(new.text(), at=2.0))
    assert f.restarted
    assert f.requests == 3 and f.rps == pytest.approx(1.5) and f.tokens_per_s == pytest.approx(15.0)
    assert f.latency_mean_s == pytest.approx(0.02)


def test_counter_going_down_is_a_reset_without_a_start_time() -> None:
    old, new = FakeWorkerMetrics(), FakeWorkerMetrics()  # same start time: only the counters tell
    for _ in range(5):
        old.request(tokens=10)
    new.request(tokens=10)
    f = window(parse_sample(old.text(), at=0.0), parse_sample(new.text(), at=1.0))
    assert f.restarted and f.requests == 1 and f.tokens_per_s == 10


def test_restart_detected_by_start_time_even_if_counters_grew() -> None:
    old = FakeWorkerMetrics()
    old.request(tokens=10)
    new = FakeWorkerMetrics(start_time=1_700_000_100.0)
    for _ in range(5):
        new.request(tokens=10)
    f = window(parse_sample(old.text(), at=0.0), parse_sample(new.text(), at=1.0))
    assert f.restarted and f.requests == 5


def test_out_of_order_samples_are_refused() -> None:
    s = parse_sample(FakeWorkerMetrics().text(), at=1.0)
    with pytest.raises(ValueError, match="out of order"):
        window(s, s)


def _figures(**overrides: object) -> WindowFigures:
    """An idle window's figures with some fields set."""
    m = FakeWorkerMetrics()
    idle = window(parse_sample(m.text(), at=0.0), parse_sample(m.text(), at=1.0))
    return replace(idle, **overrides)  # type: ignore[arg-type]


def test_smooth_first_window_is_taken_as_is() -> None:
    f = _figures(rps=10.0, tokens_per_s=500.0, latency_mean_s=0.02, latency_p99_s=0.05, cpu_utilization=0.4,
                 error_rate=0.1, batch_cost_per_token_s=1e-4)
    t = smooth(None, f, at=7.0, alpha=0.3)
    assert t.observed_at == 7.0
    assert (t.rps, t.tokens_per_s, t.latency_mean_s, t.latency_p99_s, t.cpu_utilization, t.error_rate) == (
        10.0, 500.0, 0.02, 0.05, 0.4, 0.1,
    )
    assert t.batch_cost_per_token_s == 1e-4


def test_smooth_is_an_ewma() -> None:
    prev = Telemetry(observed_at=1.0, rps=10.0, latency_mean_s=0.02, cpu_utilization=0.5, error_rate=0.0)
    f = _figures(rps=20.0, latency_mean_s=0.04, cpu_utilization=1.0, error_rate=0.5)
    t = smooth(prev, f, at=2.0, alpha=0.25)
    assert t.rps == pytest.approx(12.5)
    assert t.latency_mean_s == pytest.approx(0.025)
    assert t.cpu_utilization == pytest.approx(0.625)
    assert t.error_rate == pytest.approx(0.125)


def test_smooth_takes_the_queue_and_inflight_gauges_as_reported() -> None:
    """ext_proc counts other routers' work from these: an EWMA would lag the worker by seconds."""
    prev = Telemetry(observed_at=1.0, rps=10.0, queue_depth=8.0, inflight=9.0)
    t = smooth(prev, _figures(rps=20.0, queue_depth=0.0, inflight=1.0), at=2.0, alpha=0.25)
    assert (t.queue_depth, t.inflight) == (0.0, 1.0)
    assert t.rps == pytest.approx(12.5)


def test_slots_travel_from_the_gauge_to_telemetry_as_reported() -> None:
    """``inferlb_worker_slots`` (jobs run at once) is a fact about the worker: taken as is, never averaged;
    a worker without the gauge (older, or another build) has one slot, and so has one reporting less."""
    m = FakeWorkerMetrics()
    before = parse_sample(m.text(), at=1.0)
    assert before.slots == 1.0
    slots = Gauge("inferlb_worker_slots", "Jobs at once.", registry=m.registry)
    slots.set(4)
    m.request(tokens=10)
    after = parse_sample(m.text(), at=2.0)
    assert after.slots == 4.0
    t = smooth(Telemetry(observed_at=1.0, slots=1.0), window(before, after), at=2.0, alpha=0.25)
    assert t.slots == 4.0
    slots.set(0)
    assert parse_sample(m.text(), at=3.0).slots == 1.0


def test_idle_window_keeps_latency_but_updates_rates() -> None:
    prev = Telemetry(observed_at=1.0, rps=10.0, tokens_per_s=400.0, latency_mean_s=0.02, latency_p50_s=0.015,
                     latency_p99_s=0.08, latency_per_token_s=0.001, queue_wait_mean_s=0.003, error_rate=0.2,
                     cpu_utilization=0.6)
    m = FakeWorkerMetrics()
    idle = window(parse_sample(m.text(), at=1.0), parse_sample(m.text(), at=1.5))
    t = smooth(prev, idle, at=1.5, alpha=0.5)
    assert (t.latency_mean_s, t.latency_p50_s, t.latency_p99_s) == (0.02, 0.015, 0.08)
    assert (t.latency_per_token_s, t.queue_wait_mean_s, t.error_rate) == (0.001, 0.003, 0.2)
    assert t.rps == pytest.approx(5.0) and t.tokens_per_s == pytest.approx(200.0)
    assert t.cpu_utilization == pytest.approx(0.3)
    assert t.observed_at == 1.5


def test_never_measured_latency_is_not_averaged_with_zero() -> None:
    cold = Telemetry(observed_at=1.0)  # e.g. the first windows were idle: latency never measured
    t = smooth(cold, _figures(latency_mean_s=0.04, latency_per_token_s=0.002), at=2.0, alpha=0.3)
    assert t.latency_mean_s == 0.04 and t.latency_per_token_s == 0.002


def test_smooth_rejects_bad_alpha() -> None:
    with pytest.raises(ValueError, match="alpha"):
        smooth(None, _figures(), at=1.0, alpha=0.0)


def test_staleness() -> None:
    t = Telemetry(observed_at=10.0)
    assert is_stale(None, now=10.0, max_age_s=2.0)
    assert not is_stale(t, now=11.9, max_age_s=2.0)
    assert is_stale(t, now=12.1, max_age_s=2.0)


def test_a_non_worker_target_is_reported_clearly() -> None:
    other = CollectorRegistry()
    Counter("http_requests", "Some other service.", registry=other).inc()
    Gauge("inferlb_worker_cpu_utilization", "Only one of ours.", registry=other).set(0.5)
    with pytest.raises(ValueError, match="not an inferlb worker") as err:
        parse_sample(generate_latest(other).decode(), at=0.0)
    assert "inferlb_worker_requests" in str(err.value) and "inferlb_worker_cpu_utilization" not in str(err.value)
    with pytest.raises(ValueError, match="not a Prometheus text exposition"):
        parse_sample("<html><body>502 Bad Gateway</body></html>", at=0.0)
    with pytest.raises(ValueError, match="missing"):
        parse_sample("", at=0.0)


def test_a_histogram_of_the_wrong_type_is_refused() -> None:
    text = FakeWorkerMetrics().text().replace(
        "# TYPE inferlb_worker_queue_wait_seconds histogram", "# TYPE inferlb_worker_queue_wait_seconds summary"
    )
    with pytest.raises(ValueError, match="inferlb_worker_queue_wait_seconds"):
        parse_sample(text, at=0.0)


# --- NaN and Inf are refused per sample ------------------------------------------------------------------


def _with_value(text: str, line_start: str, value: str) -> str:
    """``text`` with the value of its first line starting ``line_start`` replaced."""
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(line_start))
    lines[i] = lines[i].rsplit(" ", 1)[0] + " " + value
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("line_start", [
    'inferlb_worker_requests_total{code="200"}',  # counter
    "inferlb_worker_cpu_utilization",  # gauge
    'inferlb_worker_batch_cost_seconds{term="fixed"}',  # labelled gauge
    'inferlb_worker_request_duration_seconds_bucket{le="0.016"}',  # histogram bucket
    'inferlb_worker_request_duration_seconds_bucket{le="+Inf"}',  # the +Inf bucket's count
    "inferlb_worker_request_duration_seconds_sum",
    "inferlb_worker_queue_wait_seconds_count",
    "process_start_time_seconds",
])
@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
def test_non_finite_values_are_refused_in_every_metric_type(line_start: str, value: str) -> None:
    m = FakeWorkerMetrics()
    m.request(tokens=10, queue_s=0.001)
    m.batch_cost.labels(term="fixed").set(0.002)
    clean = parse_sample(m.text(), at=1.0)
    assert clean.refused == 0  # le="+Inf" is a bound (a label), not a value
    bad = parse_sample(_with_value(m.text(), line_start, value), at=2.0)
    assert bad.refused == 1
    for field, got in vars(bad).items():  # skipped, never carried into the sample
        if isinstance(got, float):
            assert math.isfinite(got), field


def test_a_summary_with_a_nan_quantile_is_refused() -> None:
    """A foreign exporter's summary in a family read here: its quantile lines are values too."""
    text = FakeWorkerMetrics().text()
    gauge = "# TYPE inferlb_worker_queue_depth gauge\ninferlb_worker_queue_depth 0.0\n"
    assert gauge in text
    summary = text.replace(gauge, '# TYPE inferlb_worker_queue_depth summary\ninferlb_worker_queue_depth{quantile="0.5"} '
                                  "NaN\ninferlb_worker_queue_depth_sum 1.0\ninferlb_worker_queue_depth_count 1.0\n")
    assert parse_sample(summary, at=1.0).refused == 1


def test_smooth_ignores_figures_that_are_not_finite() -> None:
    """An overflowed window (a counter near 1e308 over half a second is inf) must not enter the EWMA."""
    prev = smooth(None, _figures(rps=10.0, latency_mean_s=0.1), at=1.0, alpha=0.5)
    for bad in (math.inf, math.nan):
        t = smooth(prev, _figures(rps=bad, latency_mean_s=bad, queue_depth=bad), at=2.0, alpha=0.5)
        assert t.rps == prev.rps and t.latency_mean_s == prev.latency_mean_s and t.queue_depth == prev.queue_depth
        assert all(math.isfinite(v) for v in vars(t).values())
