"""Fold a provider's snapshot into the fleet's endpoints (pure).

A source owns the endpoints whose ``source`` it is, and only those: an
address that is also static or registered by the API stays as it is (the
operator's own listing wins). For the endpoints it owns:

* new address     -> a new endpoint (health UNKNOWN: scraping and Envoy's checks decide);
* gone            -> removed at once. Envoy's cluster has ``ignore_health_on_host_removal``
  and lets requests already on the host's connections finish; Kubernetes has
  already drained it through ``terminating`` before the address went away;
* NOT_READY       -> health UNHEALTHY (not routable), held there against scrapes
  (the controller ignores scrape results for it) until discovery says ready;
* READY again     -> health UNKNOWN (the next scrape decides);
* DRAINING        -> ``draining`` (no new traffic; in-flight finishes).

Operator overrides (pin, drain) are keyed by endpoint id and survive the
endpoint leaving and coming back: the memory keeps them for removed ids and
``seed`` loads the ones stored in the database at startup.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

from ..model import Endpoint, Health
from ..store.base import Override
from .model import DiscoveredEndpoint, DiscoverySource, Readiness


@dataclass(frozen=True)
class SourceMemory:
    """What reconciling one source needs to remember between snapshots."""

    not_ready: frozenset[str] = frozenset()
    # id -> the operator's own drain flag, for endpoints that discovery marked draining
    drained_by_discovery: Mapping[str, bool] = field(default_factory=dict)
    # id -> the operator's overrides of an endpoint that is not in the fleet now
    overrides: Mapping[str, Override] = field(default_factory=dict)

    def seed(self, overrides: Mapping[str, Override]) -> SourceMemory:
        return dataclasses.replace(self, overrides={**overrides, **self.overrides})


@dataclass(frozen=True)
class Reconciled:
    endpoints: tuple[Endpoint, ...]
    memory: SourceMemory
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()  # readiness changes of endpoints that stayed
    conflicts: tuple[str, ...] = ()  # discovered ids owned by another source


def _operator_drain(e: Endpoint, memory: SourceMemory) -> bool:
    return memory.drained_by_discovery.get(e.id, e.draining)


def _apply(e: Endpoint, d: DiscoveredEndpoint, memory: SourceMemory,
           not_ready: set[str], drained: dict[str, bool]) -> Endpoint:
    operator_drain = _operator_drain(e, memory)
    if d.readiness is Readiness.DRAINING:
        drained[e.id] = operator_drain
        draining = True
    else:
        draining = operator_drain
    if d.readiness is Readiness.NOT_READY:
        not_ready.add(e.id)
        health = Health.UNHEALTHY
    elif e.id in memory.not_ready:
        health = Health.UNKNOWN  # ready again: the next scrape decides
    else:
        health = e.health
    if (health, draining) == (e.health, e.draining):
        return e
    return dataclasses.replace(e, health=health, draining=draining)


def reconcile(endpoints: tuple[Endpoint, ...], source: DiscoverySource,
              discovered: tuple[DiscoveredEndpoint, ...], memory: SourceMemory) -> Reconciled:
    """``endpoints`` with ``source``'s part replaced by ``discovered`` (see the module docstring)."""
    wanted = {d.id: d for d in discovered}
    others = {e.id for e in endpoints if e.source != source}
    overrides = dict(memory.overrides)
    not_ready: set[str] = set()
    drained: dict[str, bool] = {}
    kept: list[Endpoint] = []
    removed, changed = [], []
    for e in endpoints:
        if e.source != source:
            kept.append(e)
            continue
        d = wanted.get(e.id)
        if d is None:
            removed.append(e.id)
            override = Override(e.pinned_weight, _operator_drain(e, memory))
            if override != Override():
                overrides[e.id] = override
            continue
        new = _apply(e, d, memory, not_ready, drained)
        if new != e:
            changed.append(e.id)
        kept.append(new)
    present = {e.id for e in kept}
    added = []
    for d in discovered:
        if d.id in present:
            continue
        override = overrides.pop(d.id, Override())
        fresh = Endpoint(address=d.address, port=d.port, source=source,
                         pinned_weight=override.pinned_weight, draining=override.draining)
        kept.append(_apply(fresh, d, SourceMemory(), not_ready, drained))
        added.append(d.id)
    conflicts = tuple(sorted(d_id for d_id in wanted if d_id in others))
    return Reconciled(
        endpoints=tuple(kept),
        memory=SourceMemory(not_ready=frozenset(not_ready), drained_by_discovery=drained, overrides=overrides),
        added=tuple(added), removed=tuple(removed), changed=tuple(changed), conflicts=conflicts,
    )
