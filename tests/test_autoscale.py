"""The autoscaling signal's math (pure) and its export on the control plane's /metrics."""

from __future__ import annotations

import math

import pytest

from pydantic import ValidationError

from control_plane.autoscale import (
    DESIRED_REPLICAS_METRIC,
    ONGOING_REQUESTS_METRIC,
    RAW_DESIRED_REPLICAS_METRIC,
    ROUTABLE_REPLICAS_METRIC,
    Autoscaler,
    AutoscaleSettings,
    AutoscaleState,
    FleetLoad,
    fleet_load,
    look_back,
    raw_desired_replicas,
    step,
)
from control_plane.config import load_config
from control_plane.metrics import ControlPlaneMetrics
from control_plane.model import Endpoint, FleetState, Health, Telemetry

from .stack import prometheus_samples, sample


def _endpoint(port: int, inflight: float, queue: float, p99: float = 0.05, *, at: float = 100.0,
              health: Health = Health.HEALTHY, draining: bool = False, pool: str = "default") -> Endpoint:
    return Endpoint("10.0.0.1", port, health=health, draining=draining, pool=pool,
                    telemetry=Telemetry(observed_at=at, inflight=inflight, queue_depth=queue, latency_p99_s=p99))


@pytest.mark.parametrize(("ongoing", "target", "expected"), [
    (0.0, 2.0, 1),  # min_replicas
    (2.0, 2.0, 1),
    (2.1, 2.0, 2),  # ceil
    (7.0, 2.0, 4),
    (8.0, 2.0, 4),  # exactly on target: no extra replica from float noise
    (100.0, 2.0, 10),  # max_replicas
    (3.0, 0.5, 6),
])
def test_desired_replicas_is_ceil_of_ongoing_over_target(ongoing: float, target: float, expected: int) -> None:
    settings = AutoscaleSettings(target_ongoing_requests=target, min_replicas=1, max_replicas=10)
    assert raw_desired_replicas(FleetLoad(ongoing, replicas=3), settings) == expected


def test_latency_above_target_scales_up_in_proportion_capped() -> None:
    settings = AutoscaleSettings(target_ongoing_requests=4.0, target_p99_latency_s=0.1, max_replicas=50)
    # the load alone asks for 2; p99 at 1.5x target with 4 replicas asks for ceil(4 * 1.5) = 6
    assert raw_desired_replicas(FleetLoad(8.0, replicas=4, p99_latency_s=0.15), settings) == 6
    # a p99 10x the target is capped at max_upscale_ratio (2): 8, not 40
    assert raw_desired_replicas(FleetLoad(8.0, replicas=4, p99_latency_s=1.0), settings) == 8
    # under target, or no telemetry: the load decides
    assert raw_desired_replicas(FleetLoad(8.0, replicas=4, p99_latency_s=0.05), settings) == 2
    assert raw_desired_replicas(FleetLoad(8.0, replicas=4, p99_latency_s=None), settings) == 2
    # no latency target: latency is ignored
    assert raw_desired_replicas(FleetLoad(8.0, replicas=4, p99_latency_s=1.0),
                                AutoscaleSettings(target_ongoing_requests=4.0)) == 2


def test_fleet_load_counts_fresh_telemetry_and_routable_replicas() -> None:
    endpoints = [
        _endpoint(1, inflight=2, queue=1, p99=0.2),
        _endpoint(2, inflight=1, queue=0, p99=0.4, draining=True),  # its work counts, it is no replica
        _endpoint(3, inflight=5, queue=5, p99=9.0, at=0.0),  # stale: ignored
        Endpoint("10.0.0.1", 4),  # never scraped: a replica, no load
    ]
    load = fleet_load(endpoints, now=101.0, stale_after_s=2.0)
    assert load == FleetLoad(ongoing_requests=4.0, replicas=3, p99_latency_s=0.2)


def test_scale_up_is_immediate_and_scale_down_waits_for_the_window() -> None:
    settings = AutoscaleSettings(downscale_window_s=60.0)
    state = AutoscaleState()
    for now, raw, expected in [(0, 2, 2), (10, 5, 5), (20, 3, 5), (69, 1, 5), (71, 1, 3), (81, 1, 1), (90, 4, 4)]:
        state = step(state, raw, float(now), settings)
        assert state.desired_replicas == expected, (now, raw)
    assert len(state.history) <= 2  # dominated entries are dropped: the history stays small


def test_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="target_ongoing_requests"):
        AutoscaleSettings(target_ongoing_requests=0)
    with pytest.raises(ValueError, match="min_replicas"):
        AutoscaleSettings(min_replicas=5, max_replicas=2)
    with pytest.raises(ValueError, match="target_p99_latency_s"):
        AutoscaleSettings(target_p99_latency_s=-1)


def test_metrics_export_the_signal_per_pool() -> None:
    endpoints = (_endpoint(1, inflight=3, queue=2), _endpoint(2, inflight=1, queue=1),
                 _endpoint(3, inflight=9, queue=0, pool="batch"))
    autoscaler = Autoscaler(AutoscaleSettings(target_ongoing_requests=2.0))
    metrics = ControlPlaneMetrics(lambda: FleetState(endpoints=endpoints))
    metrics.register_autoscale(lambda: autoscaler.signals)
    samples = prometheus_samples(metrics.exposition().decode())
    assert sample(samples, DESIRED_REPLICAS_METRIC, pool="default") is None  # nothing observed yet: no made-up value
    autoscaler.observe(endpoints, now=100.5, stale_after_s=2.0)
    samples = prometheus_samples(metrics.exposition().decode())
    assert sample(samples, ONGOING_REQUESTS_METRIC, pool="default") == 7.0
    assert sample(samples, DESIRED_REPLICAS_METRIC, pool="default") == math.ceil(7.0 / 2.0)
    assert sample(samples, ROUTABLE_REPLICAS_METRIC, pool="default") == 2.0
    assert sample(samples, ONGOING_REQUESTS_METRIC, pool="batch") == 9.0
    assert sample(samples, DESIRED_REPLICAS_METRIC, pool="batch") == 5.0
    assert sample(samples, RAW_DESIRED_REPLICAS_METRIC, pool="batch") == 5.0
    assert sample(samples, ROUTABLE_REPLICAS_METRIC, pool="batch") == 1.0


def test_each_pool_scales_on_its_own_load_settings_and_window() -> None:
    """A busy pool grows while an idle one shrinks; a pool's overrides bound only that pool."""
    autoscaler = Autoscaler(AutoscaleSettings(target_ongoing_requests=1.0, downscale_window_s=60.0),
                            {"batch": AutoscaleSettings(target_ongoing_requests=1.0, min_replicas=2, max_replicas=3,
                                                        downscale_window_s=0.0)})
    busy = [_endpoint(1, inflight=6, queue=0), _endpoint(2, inflight=0, queue=0, pool="batch")]
    signals = autoscaler.observe(busy, now=100.0, stale_after_s=2.0)
    assert {p: s.desired_replicas for p, s in signals.items()} == {"default": 6, "batch": 2}  # batch: its min
    flipped = [_endpoint(1, inflight=0, queue=0, at=110.0), _endpoint(2, inflight=50, queue=0, at=110.0, pool="batch")]
    signals = autoscaler.observe(flipped, now=110.0, stale_after_s=2.0)
    # default's window keeps 6 for a minute; batch goes up at once, to its own max
    assert {p: (s.raw_desired_replicas, s.desired_replicas) for p, s in signals.items()} == \
        {"default": (1, 6), "batch": (3, 3)}
    quiet = [_endpoint(1, inflight=0, queue=0, at=120.0), _endpoint(2, inflight=0, queue=0, at=120.0, pool="batch")]
    assert autoscaler.observe(quiet, now=120.0, stale_after_s=2.0)["batch"].desired_replicas == 2  # no window


def test_configured_and_default_pools_have_a_signal_without_endpoints_and_gone_pools_are_forgotten() -> None:
    autoscaler = Autoscaler(AutoscaleSettings(), {"batch": AutoscaleSettings(min_replicas=2, max_replicas=4)})
    assert set(autoscaler.observe([_endpoint(1, 0, 0, pool="gpu")], now=100.0, stale_after_s=2.0)) == \
        {"default", "batch", "gpu"}
    signals = autoscaler.observe([], now=101.0, stale_after_s=2.0)
    assert {p: s.desired_replicas for p, s in signals.items()} == {"default": 1, "batch": 2}


def test_pool_overrides_from_the_config_merge_over_the_global_settings() -> None:
    config = load_config(None, {"autoscale": {"max_replicas": 8, "target_ongoing_requests": 3.0,
                                              "pools": {"batch": {"min_replicas": 2, "max_replicas": 4}}}})
    assert config.autoscale.pool_settings() == {
        "batch": AutoscaleSettings(target_ongoing_requests=3.0, min_replicas=2, max_replicas=4)}
    with pytest.raises(ValidationError, match="must be a Kubernetes name"):
        load_config(None, {"autoscale": {"pools": {"Batch_1": {}}}})
    with pytest.raises(ValidationError, match="autoscale pool 'batch': need 0 <= min_replicas <= max_replicas"):
        load_config(None, {"autoscale": {"max_replicas": 3, "pools": {"batch": {"min_replicas": 5}}}})


def test_ongoing_requests_are_a_time_weighted_mean_over_the_look_back() -> None:
    # a figure stands for the time since the one before: 0 for 9 s, then 10 for 1 s -> 1.0 over 10 s
    samples: tuple[tuple[float, float], ...] = ()
    for at in range(0, 10):
        samples, _ = look_back(samples, 0.0, float(at), 10.0)
    samples, mean = look_back(samples, 10.0, 10.0, 10.0)
    assert mean == pytest.approx(1.0)
    samples, mean = look_back(samples, 10.0, 10.0, 10.0)  # read twice at once: counted once
    assert mean == pytest.approx(1.0)
    samples, mean = look_back(samples, 10.0, 25.0, 10.0)  # older figures leave the window
    assert mean == pytest.approx(10.0) and len(samples) <= 3
    assert look_back((), 4.0, 1.0, 10.0)[1] == 4.0  # the first figure alone
    assert look_back(samples, 7.0, 26.0, 0.0)[1] == 7.0  # no look-back: the latest figure


def test_a_momentary_clump_at_low_load_does_not_ask_for_another_worker() -> None:
    """The elastic-pool bench flapped 1 -> 2 -> 1 when one scrape saw three requests at 10% load."""
    autoscaler = Autoscaler(AutoscaleSettings(target_ongoing_requests=2.0, look_back_s=10.0))
    for now in range(100, 130):
        inflight = 3 if now == 120 else 0  # one clump among 30 quiet scrapes
        signal = autoscaler.observe([_endpoint(1, inflight=inflight, queue=0, at=float(now))], now=float(now),
                                    stale_after_s=2.0)["default"]
        assert signal.desired_replicas == 1, now
    # a real surge (a queue for several seconds) still scales up within a few scrapes
    for now in range(130, 134):
        signal = autoscaler.observe([_endpoint(1, inflight=1, queue=8, at=float(now))], now=float(now),
                                    stale_after_s=2.0)["default"]
    assert signal.desired_replicas >= 2
    instant = Autoscaler(AutoscaleSettings(target_ongoing_requests=2.0, look_back_s=0.0))
    clump = instant.observe([_endpoint(1, inflight=3, queue=0, at=120.0)], now=120.0, stale_after_s=2.0)
    assert clump["default"].desired_replicas == 2  # what happened without the look-back
