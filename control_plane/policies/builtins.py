"""The built-in weight policies, their parameters and the helpers they share.

* ``capacity`` (the default, ``CapacityWeightPolicy``): share proportional to
  what a worker really sustains (tokens/s per unit of CPU it uses), cut for
  queueing, slow tokens and errors, damped so weights do not oscillate.
* ``equal`` (``EqualWeightPolicy``): every endpoint 100, the baseline.

Each is a class with a ``name``, a frozen ``Params`` dataclass and
``__init__(params)``, exactly what a user policy may be: the registry
(``policies/registry.py``) builds built-ins and user policies the same way, so
one validator (``inferlb_runtime.plugins.parse_params``) checks every
policy's parameters. ``clamp_weight`` and ``damp`` are public because user
policies (``examples/policies/canary_weights.py``) want the same rounding.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import ClassVar, Mapping

from ..model import DEFAULT_WEIGHT, MAX_WEIGHT, MIN_WEIGHT, Health, Telemetry
from .contract import EndpointView, FleetView

DEFAULT_WEIGHT_POLICY = "capacity"


def clamp_weight(weight: float) -> int:
    """Round half up into 1..1000; NaN (a policy bug) becomes the neutral default."""
    if math.isnan(weight):
        return DEFAULT_WEIGHT
    if math.isinf(weight):
        return MAX_WEIGHT if weight > 0 else MIN_WEIGHT
    return max(MIN_WEIGHT, min(MAX_WEIGHT, math.floor(weight + 0.5)))


# -- equal --------------------------------------------------------------------


@dataclass(frozen=True)
class EqualParams:
    """No parameters."""


class EqualWeightPolicy:
    """Every endpoint gets 100: Envoy's plain least_request, the baseline to beat."""

    name: ClassVar[str] = "equal"
    Params: ClassVar[type] = EqualParams

    def __init__(self, params: EqualParams | None = None) -> None:
        self.params = params or EqualParams()

    def compute(self, view: FleetView) -> Mapping[str, int]:
        return {e.id: DEFAULT_WEIGHT for e in view.endpoints}


# -- capacity -----------------------------------------------------------------


@dataclass(frozen=True)
class CapacityParams:
    """Knobs of ``CapacityWeightPolicy``; the defaults suit 0.5 s rounds."""

    # Below this CPU share, tokens/CPU is mostly fixed overhead and noise: capacity is not measured.
    cpu_floor: float = 0.05
    # Fewer requests/s than this: idle, no fresh figures, the weight is kept.
    min_rps: float = 0.5
    # Windows with more errors than this do not update the remembered capacity (failing work is not capacity).
    capacity_max_error_rate: float = 0.1
    # score *= min(1, reference / latency_per_token) ** latency_exponent
    latency_exponent: float = 1.0
    # score *= min(1, (reference + slack) / (queue_wait + slack)) ** queue_exponent
    queue_exponent: float = 0.5
    queue_slack_s: float = 0.005
    # score *= (1 - error_rate) ** error_exponent: 10% errors -> x0.53, 50% -> x0.016
    error_exponent: float = 6.0
    # mean weight of the scored endpoints
    mean_weight: float = float(DEFAULT_WEIGHT)
    # damping: a weight moves at most x max_step or / max_step per round
    max_step: float = 1.5
    # relative changes smaller than this are not worth an xDS push
    min_change: float = 0.05

    def __post_init__(self) -> None:
        checks = {
            "cpu_floor": 0.0 < self.cpu_floor <= 1.0,
            "min_rps": self.min_rps >= 0.0,
            "capacity_max_error_rate": 0.0 <= self.capacity_max_error_rate <= 1.0,
            "latency_exponent": 0.0 <= self.latency_exponent <= 10.0,
            "queue_exponent": 0.0 <= self.queue_exponent <= 10.0,
            "queue_slack_s": self.queue_slack_s > 0.0,
            "error_exponent": 1.0 <= self.error_exponent <= 100.0,
            "mean_weight": MIN_WEIGHT <= self.mean_weight <= MAX_WEIGHT,
            "max_step": 1.0 < self.max_step <= 10.0,
            "min_change": 0.0 <= self.min_change < 1.0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"out of range: {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}")


def damp(current: int, target: float, max_step: float, min_change: float = 0.0) -> int:
    """Move ``current`` toward ``target`` by at most a factor ``max_step``, in whole steps, within 1..1000.

    A change under ``min_change`` (relative) is dropped; a wanted change of a
    whole unit or more always moves at least one unit, so low weights still
    recover.
    """
    current = clamp_weight(current)
    target = max(float(MIN_WEIGHT), min(float(MAX_WEIGHT), target))
    if abs(target - current) < max(min_change * current, 0.5):
        return current
    bounded = min(max(target, current / max_step), current * max_step)
    new = clamp_weight(bounded)
    if new == current:
        new = current + (1 if target > current else -1)
    return clamp_weight(new)


@dataclass(frozen=True)
class CapacityRound:
    """One round's output: the weights and the remembered capacity per endpoint."""

    weights: Mapping[str, int]
    capacity: Mapping[str, float]


def _reference(values: list[float]) -> float | None:
    """The fleet's typical figure: the low median, robust to one bad worker, the best of two."""
    values = [v for v in values if v > 0]
    return statistics.median_low(values) if values else None


def capacity_round(view: FleetView, params: CapacityParams, known: Mapping[str, float]) -> CapacityRound:
    """The capacity policy as a pure function of the view and the capacities remembered so far.

    For each endpoint with fresh telemetry and traffic:
        capacity = tokens_per_s / max(cpu_utilization, cpu_floor)     (measured, or last known)
        score = capacity
              * min(1, ref_lpt / latency_per_token) ** latency_exponent
              * min(1, (ref_qw + slack) / (queue_wait + slack)) ** queue_exponent
              * (1 - error_rate) ** error_exponent
    where ref_* is the low median over the endpoints that are not failing.
    Scores are scaled so the scored endpoints' mean is ``mean_weight``, then
    each weight moves toward its target by at most ``max_step`` per round.
    Penalties only ever lower a score: fast failures cannot look fast.

    Endpoints without fresh telemetry, idle, unhealthy or draining keep their
    current weight; missing data is never read as infinite capacity.
    """
    remembered = dict(known)
    live_ids = {e.id for e in view.endpoints}
    for gone in set(remembered) - live_ids:
        del remembered[gone]

    scored: list[tuple[EndpointView, Telemetry]] = []
    for e in view.endpoints:
        t = e.fresh_telemetry
        if t is None or e.draining or e.health is Health.UNHEALTHY or t.rps < params.min_rps:
            continue
        scored.append((e, t))
        measurable = t.cpu_utilization >= params.cpu_floor and t.error_rate <= params.capacity_max_error_rate
        if measurable:
            remembered[e.id] = t.tokens_per_s / max(t.cpu_utilization, params.cpu_floor)

    weights = {e.id: clamp_weight(e.weight) for e in view.endpoints}
    if not scored:
        return CapacityRound(weights, remembered)

    # Never-measured endpoints get the fleet's typical capacity: neutral, not infinite, not zero.
    measured = [remembered[e.id] for e, _ in scored if e.id in remembered]
    neutral = statistics.median(measured) if measured else 1.0
    reference_pool = [t for _, t in scored if t.error_rate <= params.capacity_max_error_rate]
    ref_lpt = _reference([t.latency_per_token_s for t in reference_pool])
    ref_qw = _reference([t.queue_wait_mean_s for t in reference_pool]) or 0.0

    scores: dict[str, float] = {}
    for e, t in scored:
        score = remembered.get(e.id, neutral)
        if ref_lpt is not None and t.latency_per_token_s > 0:
            score *= min(1.0, ref_lpt / t.latency_per_token_s) ** params.latency_exponent
        slack = params.queue_slack_s
        score *= min(1.0, (ref_qw + slack) / (t.queue_wait_mean_s + slack)) ** params.queue_exponent
        score *= max(0.0, 1.0 - t.error_rate) ** params.error_exponent
        scores[e.id] = max(0.0, score)

    total = sum(scores.values())
    if total <= 0:  # nobody did useful work: no basis to move anyone
        return CapacityRound(weights, remembered)
    scale = params.mean_weight * len(scores) / total
    for endpoint_id, score in scores.items():
        weights[endpoint_id] = damp(weights[endpoint_id], score * scale, params.max_step, params.min_change)
    return CapacityRound(weights, remembered)


class CapacityWeightPolicy:
    """The default policy (see ``capacity_round``); remembers each worker's last measured capacity.

    Capacity (tokens/s per CPU used) is comparable across fast and slow
    machines and does not depend on how much traffic a worker happens to get,
    so weights do not feed on themselves; the latency, queue and error factors
    catch what CPU accounting misses (contention, overload, failures).
    """

    name: ClassVar[str] = "capacity"
    Params: ClassVar[type] = CapacityParams

    def __init__(self, params: CapacityParams | None = None) -> None:
        self.params = params or CapacityParams()
        self._capacity: Mapping[str, float] = {}

    def compute(self, view: FleetView) -> Mapping[str, int]:
        result = capacity_round(view, self.params, self._capacity)
        self._capacity = result.capacity
        return result.weights


# -- all of them ----------------------------------------------------------------


def builtin_weight_policies() -> dict[str, type]:
    """Built-in policies by name; each class has ``name``, ``Params`` and ``__init__(params)``."""
    return {cls.name: cls for cls in (CapacityWeightPolicy, EqualWeightPolicy)}
