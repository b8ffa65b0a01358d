"""The autoscaling signal: how many workers the fleet should have, from its load (pure).

Ray Serve's rule: every replica should have about ``target_ongoing_requests``
requests ongoing (in flight on it plus queued for it), so

    desired = ceil(total ongoing requests / target_ongoing_requests)

then, when the fleet's p99 latency is above ``target_p99_latency_s`` (if
set), at least ``ceil(replicas * p99 / target)`` (latency grows with load, so
the ratio says roughly how much more capacity the target needs), that ratio
capped at ``max_upscale_ratio``; bounded by ``min_replicas`` and
``max_replicas``. Scale-up is immediate; scale-down is smoothed: the
signal is the highest raw recommendation of the last
``downscale_window_s`` (the HorizontalPodAutoscaler's stabilisation window),
so a lull of a few seconds does not tear down workers the next burst needs.

The control plane exports the result as ``inferlb_autoscale_desired_replicas``
for an HPA to consume through the external metrics API (docs/kubernetes.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from .model import Endpoint
from .telemetry import is_stale

DESIRED_REPLICAS_METRIC = "inferlb_autoscale_desired_replicas"
ONGOING_REQUESTS_METRIC = "inferlb_fleet_ongoing_requests"


@dataclass(frozen=True)
class AutoscaleSettings:
    target_ongoing_requests: float = 2.0
    min_replicas: int = 1
    max_replicas: int = 10
    target_p99_latency_s: float | None = None
    max_upscale_ratio: float = 2.0
    downscale_window_s: float = 300.0

    def __post_init__(self) -> None:
        if self.target_ongoing_requests <= 0:
            raise ValueError(f"target_ongoing_requests must be > 0, got {self.target_ongoing_requests}")
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}")
        if self.target_p99_latency_s is not None and self.target_p99_latency_s <= 0:
            raise ValueError(f"target_p99_latency_s must be > 0, got {self.target_p99_latency_s}")
        if self.max_upscale_ratio < 1:
            raise ValueError(f"max_upscale_ratio must be >= 1, got {self.max_upscale_ratio}")
        if self.downscale_window_s < 0:
            raise ValueError(f"downscale_window_s must be >= 0, got {self.downscale_window_s}")


@dataclass(frozen=True)
class FleetLoad:
    """The fleet's load now: what the signal is computed from."""

    ongoing_requests: float  # sum over endpoints of in flight + queued
    replicas: int  # routable endpoints
    p99_latency_s: float | None = None  # the worst fresh p99 among them; None: no fresh telemetry


def fleet_load(endpoints: Iterable[Endpoint], now: float, stale_after_s: float) -> FleetLoad:
    """Ongoing requests over every endpoint with fresh telemetry; replicas and p99 over routable ones."""
    ongoing, replicas, p99 = 0.0, 0, None
    for e in endpoints:
        fresh = e.telemetry is not None and not is_stale(e.telemetry, now, stale_after_s)
        if fresh:
            t = e.telemetry
            assert t is not None
            ongoing += max(0.0, t.inflight) + max(0.0, t.queue_depth)
        if e.routable:
            replicas += 1
            if fresh and e.telemetry is not None:
                p99 = max(p99 or 0.0, e.telemetry.latency_p99_s)
    return FleetLoad(ongoing, replicas, p99)


def raw_desired_replicas(load: FleetLoad, settings: AutoscaleSettings) -> int:
    """The unsmoothed recommendation, within min..max (see the module docstring)."""
    desired = math.ceil(load.ongoing_requests / settings.target_ongoing_requests - 1e-9)
    target = settings.target_p99_latency_s
    if target is not None and load.p99_latency_s is not None and load.p99_latency_s > target and load.replicas:
        ratio = min(load.p99_latency_s / target, settings.max_upscale_ratio)
        desired = max(desired, math.ceil(load.replicas * ratio - 1e-9))
    return max(settings.min_replicas, min(settings.max_replicas, desired))


@dataclass(frozen=True)
class AutoscaleState:
    """The recent raw recommendations ``(at, replicas)``, oldest first, and the signal they give."""

    history: tuple[tuple[float, int], ...] = ()

    @property
    def desired_replicas(self) -> int | None:
        return max((r for _, r in self.history), default=None)


def step(state: AutoscaleState, raw: int, now: float, settings: AutoscaleSettings) -> AutoscaleState:
    """Add one recommendation; forget those older than the window (the newest always stays)."""
    kept = tuple((at, r) for at, r in state.history if now - at <= settings.downscale_window_s and r > raw)
    return AutoscaleState((*kept, (now, raw)))


@dataclass(frozen=True)
class AutoscaleSignal:
    """What ``/metrics`` exports: the load the signal came from and the signal."""

    load: FleetLoad
    raw_desired_replicas: int
    desired_replicas: int


class Autoscaler:
    """Holds the smoothing state between rounds; ``observe`` once per scrape round (no I/O)."""

    def __init__(self, settings: AutoscaleSettings) -> None:
        self.settings = settings
        self.state = AutoscaleState()
        self.signal: AutoscaleSignal | None = None

    def observe(self, endpoints: Iterable[Endpoint], now: float, stale_after_s: float) -> AutoscaleSignal:
        load = fleet_load(endpoints, now, stale_after_s)
        raw = raw_desired_replicas(load, self.settings)
        self.state = step(self.state, raw, now, self.settings)
        desired = self.state.desired_replicas
        self.signal = AutoscaleSignal(load, raw, raw if desired is None else desired)
        return self.signal
