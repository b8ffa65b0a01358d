"""A canary at a fixed traffic share: one named worker gets ``share`` (say 5%) of the weight, the others
split the rest as the default ``capacity`` policy would.

**When to use it.** Rolling out a new model version, runtime or machine type
on one worker and watching its errors and latency before trusting it with
more: a fixed, small share limits the damage of a bad build however fast or
slow it looks, which the capacity policy (that sends more traffic to faster
workers) would not. Remove it (``PUT /v1/policy`` back to ``capacity``) when
the canary is promoted.

**How.** Every round the capacity policy computes the weights of all
endpoints; then the canary's weight is set so that its share of the
routable weight is ``share``::

    canary = share / (1 - share) * sum(weights of the other routable endpoints)

Routable: not draining and not unhealthy (those get no traffic from Envoy
either, so they do not count). When that weight would fall outside 1..1000,
the others are scaled (keeping their ratios) so it fits. When the canary is
unknown, drained, unhealthy, or the only routable endpoint, the capacity
weights are used unchanged.

**What the share means.** Weights are what Envoy's weighted balancing (the
fallback when ext_proc does not pick) and ext_proc's power-of-d sampling go
by, so the canary's traffic share follows ``share`` closely there; ext_proc's
``least_completion_time`` also reads weights as relative capacity, so under
load the canary gets roughly, not exactly, ``share``. A pinned weight
(``PUT /v1/endpoints/{id}/pin``) overrides any policy, this one included.

**Use it.** Allow its module (``--allow-policy-module examples.policies``, or
``INFERLB_CP_ALLOWED_POLICY_MODULES=examples.policies``: nothing is allowed by default), then
``python -m control_plane --weight-policy examples.policies.canary_weights:CanaryWeightPolicy`` with
``INFERLB_CP_WEIGHT_PARAMS='{"endpoint": "10.0.0.7:8000", "share": 0.05}'``, or::

    curl -X PUT -H "Authorization: Bearer $TOKEN" localhost:8080/v1/policy \\
      -d '{"weight": {"name": "examples.policies.canary_weights:CanaryWeightPolicy",
                      "params": {"endpoint": "10.0.0.7:8000", "share": 0.05}}}'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from control_plane.model import MAX_WEIGHT, MIN_WEIGHT, Health
from control_plane.policies.contract import EndpointView, FleetView
from control_plane.policies.builtins import CapacityWeightPolicy, clamp_weight

from .canary import CanaryShare as CanaryParams  # the same two parameters, checked the same way


def routable(e: EndpointView) -> bool:
    return not e.draining and e.health is not Health.UNHEALTHY


class CanaryWeightPolicy:
    """One canary worker at a fixed share of the traffic; the others weighted by the capacity policy."""

    name: ClassVar[str] = "canary"
    kind: ClassVar[str] = "weight"  # for the inferlb.policies entry-point group
    Params: ClassVar[type] = CanaryParams

    def __init__(self, params: CanaryParams) -> None:
        self.params = params
        self.base = CapacityWeightPolicy()

    def compute(self, view: FleetView) -> Mapping[str, int]:
        weights = dict(self.base.compute(view))
        return with_canary_share(view, weights, self.params.endpoint, self.params.share)


def with_canary_share(view: FleetView, weights: dict[str, int], canary: str, share: float) -> dict[str, int]:
    """``weights`` with ``canary``'s set to ``share`` of the routable total (others rescaled if need be)."""
    by_id = {e.id: e for e in view.endpoints}
    if canary not in by_id or not routable(by_id[canary]):
        return weights
    others = [e.id for e in view.endpoints if e.id != canary and routable(e)]
    total = sum(weights[i] for i in others)
    if total <= 0:
        return weights
    ratio = share / (1.0 - share)
    target = ratio * total
    if target > MAX_WEIGHT or target < MIN_WEIGHT:  # rescale the others so the canary's weight fits 1..1000
        scale = (MAX_WEIGHT if target > MAX_WEIGHT else MIN_WEIGHT) / target
        for i in others:
            weights[i] = clamp_weight(weights[i] * scale)
        target = ratio * sum(weights[i] for i in others)
    weights[canary] = clamp_weight(target)
    return weights
