"""The control plane's slow loop on simulated telemetry, running the real telemetry and WeightPolicy code.

Every ``scrape_interval_s`` each worker's counters become a
``control_plane.telemetry.parse.Sample`` (what ``parse_sample`` would read from its
/metrics), and the real ``window`` and ``smooth`` turn consecutive samples
into ``Telemetry``; the real weight policy (``make_weight_policy``) computes
weights from the real ``FleetView``. The result reaches the data plane
``push_delay_s`` later (the control plane's debounce), as EDS does: integer
weights for Envoy, and for ext_proc the weights plus the telemetry
quantised to 3 significant digits (the rich EDS metadata).

Simplifications: every scrape succeeds at once and at the same instant for
all workers; the latency histogram has one bucket (the built-in policies
read its mean per token, not its quantiles, so p50/p99 telemetry stays 0).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from control_plane.model import DEFAULT_WEIGHT, Health, Telemetry
from control_plane.policies.contract import EndpointView, FleetView, WeightPolicy
from control_plane.policies.registry import make_weight_policy
from control_plane.telemetry.parse import HistogramSample, Sample, smooth, window

from .fleet import SimFleet

SCRAPE_ALPHA = 0.3  # control_plane.telemetry.scraper.ScraperConfig.alpha
STALE_AFTER_INTERVALS = 4  # control_plane.config: stale_after_intervals
PUSH_DELAY_S = 0.1  # control_plane.config: debounce_s
_TELEMETRY_FIELDS = tuple(f.name for f in dataclasses.fields(Telemetry) if f.name != "observed_at")

OnWeights = Callable[[Sequence[int], Sequence[Mapping[str, float]]], None]


def quantised(t: Telemetry) -> Mapping[str, float]:
    """The telemetry as ext_proc receives it in EDS metadata (3 significant digits)."""
    return MappingProxyType({name: float(f"{getattr(t, name):.3g}") for name in _TELEMETRY_FIELDS})


def sample_of(fleet: SimFleet, index: int, now: float) -> Sample:
    """What a scrape of worker ``index`` at ``now`` would parse from its /metrics."""
    w = fleet.workers[index]
    per_token, fixed = fleet.cost_coefficients(w)
    return Sample(
        at=now, requests_total=float(w.completed), requests_2xx=float(w.completed), requests_4xx=0.0,
        requests_429=0.0, requests_5xx=0.0,
        duration=HistogramSample(((math.inf, float(w.completed)),), w.duration_sum, float(w.completed)),
        queue_wait_sum=w.queue_wait_sum, queue_wait_count=float(w.queue_wait_count),
        tokens_total=float(w.tokens_total), inputs_total=float(w.inputs_total),
        queue_depth=float(len(w.queue) * fleet.inputs_per_request), inflight=float(w.inflight),
        cpu_utilization=w.cpu_utilization, batch_cost_per_token_s=per_token, batch_cost_fixed_s=fixed,
        slots=float(w.slots),
    )


class ControlPlaneModel:
    """Scrape, smooth, compute weights, hand them to the data plane (``on_weights``) after the push delay."""

    def __init__(self, fleet: SimFleet, scrape_interval_s: float, on_weights: OnWeights,
                 schedule: Callable[[float, Callable[[float], None]], None],
                 policy: WeightPolicy | None = None, push_delay_s: float = PUSH_DELAY_S) -> None:
        self.fleet = fleet
        self.interval_s = scrape_interval_s
        self.policy = policy if policy is not None else make_weight_policy("capacity")
        self.push_delay_s = push_delay_s
        self._on_weights = on_weights
        self._schedule = schedule
        n = len(fleet)
        self.ids = tuple(f"127.0.0.1:{8101 + i}" for i in range(n))
        self._samples: list[Sample | None] = [None] * n
        self.telemetry: list[Telemetry | None] = [None] * n
        self.weights: list[int] = [DEFAULT_WEIGHT] * n
        self.rounds = 0

    def scrape(self, now: float) -> float:
        """One round; returns the time of the next."""
        fleet = self.fleet
        stale_after = self.interval_s * STALE_AFTER_INTERVALS
        views = []
        for i in range(len(fleet)):
            sample = sample_of(fleet, i, now)
            prev = self._samples[i]
            self._samples[i] = sample
            if prev is not None and sample.at > prev.at:
                self.telemetry[i] = smooth(self.telemetry[i], window(prev, sample), now, SCRAPE_ALPHA)
            t = self.telemetry[i]
            views.append(EndpointView(id=self.ids[i], health=Health.HEALTHY, weight=self.weights[i], telemetry=t,
                                      stale=t is None or now - t.observed_at > stale_after))
        computed = self.policy.compute(FleetView(endpoints=tuple(views), now=now))
        self.weights = [int(computed.get(e, w)) for e, w in zip(self.ids, self.weights)]
        weights = tuple(self.weights)
        telemetry = tuple(quantised(t) if t is not None else MappingProxyType({}) for t in self.telemetry)
        self.rounds += 1
        self._schedule(now + self.push_delay_s, lambda at: self._on_weights(weights, telemetry))
        return now + self.interval_s
