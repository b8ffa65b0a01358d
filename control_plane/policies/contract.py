"""The weight-policy contract: what a policy sees and what it must answer.

A weight policy turns the smoothed telemetry of the fleet into one integer
weight (1..1000) per endpoint. The weights become EDS
``load_balancing_weight``: the share of traffic Envoy's weighted
least_request (the fallback when ext_proc does not pick) sends each worker.
Users write their own policies, so the interface is small: a ``name`` and
``compute(FleetView) -> {endpoint id: weight}``. ``EndpointView`` is one
endpoint, ``FleetView`` the whole fleet this round; both are frozen values,
so a policy is unit-testable with no servers.

The rest of the control plane's policy kit: the built-ins
(``policies/builtins.py``), the registry that loads and describes policies and
holds the operator's allowlist (``policies/registry.py``), and the guard that
contains a failing policy (``policies/guard.py``, owned by the ``Controller``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol

from ..model import DEFAULT_WEIGHT, Endpoint, Health, Telemetry
from ..telemetry.parse import is_stale


@dataclass(frozen=True)
class EndpointView:
    """What a policy may know about one endpoint this round.

    ``weight`` is the current computed weight (the policy's own last output,
    not a pin): policies that keep a weight return it unchanged. ``stale``
    means ``telemetry`` is older than the control plane's freshness limit (or
    absent) and must not be read as current.
    """

    id: str
    health: Health = Health.UNKNOWN
    draining: bool = False
    weight: int = DEFAULT_WEIGHT
    telemetry: Telemetry | None = None
    stale: bool = True

    @property
    def fresh_telemetry(self) -> Telemetry | None:
        return None if self.stale else self.telemetry


@dataclass(frozen=True)
class FleetView:
    """Every endpoint at ``now`` (``time.monotonic()``), in the control plane's order."""

    endpoints: tuple[EndpointView, ...]
    now: float


def fleet_view(endpoints: Iterable[Endpoint], now: float, max_age_s: float) -> FleetView:
    """The policy's input built from the control plane's state."""
    return FleetView(
        endpoints=tuple(
            EndpointView(
                id=e.id,
                health=e.health,
                draining=e.draining,
                weight=e.computed_weight,
                telemetry=e.telemetry,
                stale=is_stale(e.telemetry, now, max_age_s),
            )
            for e in endpoints
        ),
        now=now,
    )


class WeightPolicy(Protocol):
    """A weight policy: called every control round (about every 0.5 s) from one task.

    ``compute`` must return an integer in 1..1000 for every endpoint id in the
    view (drained and unhealthy ones included: the control plane excludes
    those elsewhere, so keep their current weight). Weights are relative;
    aim for a mean near 100 so pins (absolute numbers) stay meaningful. A
    policy may keep memory between rounds on its instance, never in module
    state.
    """

    name: str

    def compute(self, view: FleetView) -> Mapping[str, int]: ...
