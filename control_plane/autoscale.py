"""The autoscaling signal: how many workers the fleet should have, from its load (pure).

Ray Serve's rule: every replica should have about ``target_ongoing_requests``
requests ongoing (in flight on it plus queued for it), so

    desired = ceil(total ongoing requests / target_ongoing_requests)

then, when the fleet's p99 latency is above ``target_p99_latency_s`` (if
set), at least ``ceil(replicas * p99 / target)`` (latency grows with load, so
the ratio says roughly how much more capacity the target needs), that ratio
capped at ``max_upscale_ratio``; bounded by ``min_replicas`` and
``max_replicas``. The ongoing requests are the time-weighted mean over
``look_back_s`` (Ray Serve's ``look_back_period_s``), not one instant: at a low
load a Poisson clump of three requests at one scrape would otherwise ask for a
second worker, which the window below then keeps for its whole length (the
elastic-pool bench flapped 1 -> 2 -> 1 on exactly that). Scale-up is otherwise
immediate; scale-down is smoothed: the
signal is the highest raw recommendation of the last
``downscale_window_s`` (the HorizontalPodAutoscaler's stabilisation window),
so a lull of a few seconds does not tear down workers the next burst needs.

Each pool (``Endpoint.pool``: the group of workers that scale together, one
Deployment each on Kubernetes) gets its own signal from its own endpoints, with
its own settings (the global ones, or a pool's overrides), so a busy pool grows
while an idle one shrinks. The control plane exports the result as
``inferlb_autoscale_desired_replicas{pool=...}``: what an HPA consumes through the
external metrics API (docs/kubernetes.md), and what ``inferlb up --autoscale``
reconciles its local workers to (``inferlb/pool_scaler.py``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable, Mapping

from inferlb_runtime.model_routing import DEFAULT_POOL

from .model import Endpoint
from .telemetry.parse import is_stale

DESIRED_REPLICAS_METRIC = "inferlb_autoscale_desired_replicas"
ONGOING_REQUESTS_METRIC = "inferlb_fleet_ongoing_requests"
RAW_DESIRED_REPLICAS_METRIC = "inferlb_autoscale_raw_desired_replicas"
ROUTABLE_REPLICAS_METRIC = "inferlb_fleet_routable_replicas"


@dataclass(frozen=True)
class AutoscaleSettings:
    target_ongoing_requests: float = 2.0
    min_replicas: int = 1
    max_replicas: int = 10
    target_p99_latency_s: float | None = None
    max_upscale_ratio: float = 2.0
    downscale_window_s: float = 300.0
    look_back_s: float = 10.0  # ongoing requests averaged over this (0: the latest figure alone)

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
        if self.look_back_s < 0:
            raise ValueError(f"look_back_s must be >= 0, got {self.look_back_s}")


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
    """The recent raw recommendations ``(at, replicas)``, oldest first, and the signal they give; and the
    recent ongoing-request figures ``(at, ongoing)`` the look-back mean is taken over."""

    history: tuple[tuple[float, int], ...] = ()
    ongoing: tuple[tuple[float, float], ...] = ()

    @property
    def desired_replicas(self) -> int | None:
        return max((r for _, r in self.history), default=None)


def look_back(samples: tuple[tuple[float, float], ...], value: float, now: float,
              look_back_s: float) -> tuple[tuple[tuple[float, float], ...], float]:
    """The samples with ``(now, value)`` added and those before the window dropped (but the last one
    before it, which bounds the first interval), and their time-weighted mean over the window. A figure
    stands for the time since the figure before it (the change happened somewhere in between), so the
    newest figure counts at once, and reading /metrics twice in a row does not count one figure twice."""
    start = now - look_back_s
    added = (*samples, (now, value))
    first = max((i for i, (at, _) in enumerate(added) if at <= start), default=0)
    kept = added[first:]
    total = span = 0.0
    for (before, _), (at, v) in zip(kept, kept[1:]):
        weight = at - max(before, start)
        if weight > 0:
            total, span = total + v * weight, span + weight
    return kept, (total / span if span > 0 else value)


def step(state: AutoscaleState, raw: int, now: float, settings: AutoscaleSettings) -> AutoscaleState:
    """Add one recommendation; forget those older than the window (the newest always stays)."""
    kept = tuple((at, r) for at, r in state.history if now - at <= settings.downscale_window_s and r > raw)
    return dataclasses.replace(state, history=(*kept, (now, raw)))


@dataclass(frozen=True)
class AutoscaleSignal:
    """What ``/metrics`` exports: the load the signal came from and the signal."""

    load: FleetLoad
    raw_desired_replicas: int
    desired_replicas: int


def by_pool(endpoints: Iterable[Endpoint], pools: Iterable[str] = ()) -> dict[str, list[Endpoint]]:
    """Endpoints grouped by pool; every pool in ``pools`` (the configured ones) is present, if empty."""
    grouped: dict[str, list[Endpoint]] = {pool: [] for pool in pools}
    for e in endpoints:
        grouped.setdefault(e.pool, []).append(e)
    return grouped


class Autoscaler:
    """Holds each pool's smoothing state between rounds; ``observe`` once per scrape round (no I/O).

    The signals cover the default pool, the configured pools and every pool that has an endpoint;
    a pool that lost its last endpoint and is not configured is forgotten (its series vanish).
    """

    def __init__(self, settings: AutoscaleSettings, pools: Mapping[str, AutoscaleSettings] | None = None) -> None:
        self.settings = settings
        self.pools = dict(pools or {})
        self.states: dict[str, AutoscaleState] = {}
        self.signals: dict[str, AutoscaleSignal] = {}

    def settings_for(self, pool: str) -> AutoscaleSettings:
        return self.pools.get(pool, self.settings)

    def observe(self, endpoints: Iterable[Endpoint], now: float, stale_after_s: float) -> dict[str, AutoscaleSignal]:
        signals, states = {}, {}
        for pool, members in sorted(by_pool(endpoints, (DEFAULT_POOL, *self.pools)).items()):
            settings = self.settings_for(pool)
            state = self.states.get(pool, AutoscaleState())
            load = fleet_load(members, now, stale_after_s)
            samples, mean = look_back(state.ongoing, load.ongoing_requests, now, settings.look_back_s)
            load = dataclasses.replace(load, ongoing_requests=mean)
            raw = raw_desired_replicas(load, settings)
            states[pool] = step(dataclasses.replace(state, ongoing=samples), raw, now, settings)
            desired = states[pool].desired_replicas
            signals[pool] = AutoscaleSignal(load, raw, raw if desired is None else desired)
        self.states, self.signals = states, signals
        return signals
