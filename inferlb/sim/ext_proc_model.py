"""inferlb with ext_proc: N replicas, each the real ``Router`` (its pick chain, CostModel and Outstanding).

Each request goes to one replica at random (Envoy's ext_proc cluster spreads
streams over them). A replica sees exactly what a live one sees, on the
simulated clock:

* its own requests in flight (begun by ``Router.decide``, ended by
  ``Router.release`` when the response headers pass), and nothing of the
  other replicas';
* per response, ``Router.learn`` with the worker's ORCA in-flight figure and
  its compute seconds, as the live servicer calls it with what the response
  headers say;
* the EDS view: weights and quantised telemetry from the control-plane model,
  refreshed every scrape interval (lagging the truth);
* its index among the replicas (``Router.set_partition``), as the control
  plane's ``ext_proc_replicas`` list gives it; the simulated replicas stay
  connected and all carry traffic (requests are spread over every one), so
  the list (the replicas whose decision count grows) never changes and its
  staleness is moot.

When the policy ranks nothing, Envoy's fallback (weighted least_request on the
same weights) routes the request, as ``failure_mode_allow`` does live. When the
chain answers itself (its ``shed`` plugin's 429 for a sheddable request), the
request is ``SHED``: counted, and it never reaches a worker. Each request's
class (``priorities``, set by the runner from the trace) is in its RequestView,
as ext_proc reads it from ``x-gateway-inference-objective``.

With ``fair_queue_depth`` (ext_proc's setting of that name; 0: off) each
replica admits as ext_proc's fair gate does: while it has fewer than
``depth x endpoints / replicas`` (at least 1) requests in flight, a request
is routed at once; otherwise it waits in the replica's queue, best class
first and in arrival order within one, and is routed when a completion
frees room. Not modelled: tenants' weighted shares, and the gate's
maximum wait (held requests here wait as long as it takes).
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections.abc import Mapping, Sequence
from typing import Any

from ext_proc.pick.costing import ORCA_INFLIGHT_KEY
from ext_proc.model import Decision, EndpointView, Reply, RequestView
from ext_proc.pick.registry import PluginRegistry
from ext_proc.pick.router import Router
from inferlb_runtime.pick_chain import DEFAULT_PICK_POLICY, PRESETS
from inferlb_runtime.request_class import Priority

from .balancers import WeightedLeastRequest
from .engine import HELD, SHED, Tick
from .fleet import SimFleet


def seeded_params(name: str, seed: int, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``params`` with ``seed`` when the policy takes a seed and none is given (determinism per scenario seed)."""
    chosen = dict(params or {})
    preset = PRESETS.get(name)
    if preset is not None and "seed" in {f.name for f in dataclasses.fields(preset.params)} \
            and chosen.get("seed") is None:
        chosen["seed"] = seed
    return chosen


class Replica:
    """One ext_proc process: its router, on the simulated clock."""

    def __init__(self, policy_name: str, seed: int, clock, params: Mapping[str, Any] | None = None) -> None:  # type: ignore[no-untyped-def]
        self.router = Router(PluginRegistry(clock=clock), policy_name, seeded_params(policy_name, seed, params),
                             clock=clock)
        self.picks = 0
        self.fallbacks = 0
        self.shed = 0  # requests its chain answered itself (429)
        self.waiting: list[tuple[int, int, int]] = []  # held: a heap of (class, request = arrival order, tokens)
        self.held = 0  # requests that waited in its fair queue


class ExtProcBalancer:
    """Envoy + ext_proc replicas + the control plane's weights (configuration ``inferlb_ext_proc``)."""

    name = "inferlb_ext_proc"

    def __init__(self, fleet: SimFleet, rng: random.Random, ids: Sequence[str], replicas: int, clock,  # type: ignore[no-untyped-def]
                 policy: str = DEFAULT_PICK_POLICY, params: Mapping[str, Any] | None = None,
                 inputs_per_request: int = 1, fair_queue_depth: int = 0) -> None:
        if fair_queue_depth < 0:
            raise ValueError(f"fair_queue_depth must be >= 0 (0: off), got {fair_queue_depth}")
        self._rng = random.Random(rng.random())
        self.replicas = [Replica(policy, rng.randrange(1 << 30), clock, params) for _ in range(replicas)]
        for index, replica in enumerate(self.replicas):  # the control plane's replica list, as EDS carries it
            replica.router.set_partition(index, len(self.replicas))
        self.fallback = WeightedLeastRequest(fleet, rng)
        self._ids = tuple(ids)
        self._index = {e: i for i, e in enumerate(self._ids)}
        self._endpoints: tuple[EndpointView, ...] = tuple(
            EndpointView(id=e, address=e.rpartition(":")[0], port=int(e.rpartition(":")[2])) for e in self._ids)
        self._views: dict[tuple[int, int, int], RequestView] = {}
        self.priorities: Sequence[int] | None = None  # per request of the trace; None: all standard
        self._inputs = inputs_per_request
        self._who: dict[int, tuple[Replica, int, float]] = {}  # request -> (replica, tokens, predicted_s)
        self.fair_queue_depth = fair_queue_depth
        # ext_proc's _capacity: requests a replica may have in flight before new ones queue
        self._room = max(1, fair_queue_depth * len(self._ids) // len(self.replicas))
        self.name = "inferlb_ext_proc" if policy == DEFAULT_PICK_POLICY else f"inferlb_pick:{policy}"

    def set_eds(self, weights: Sequence[int], telemetry: Sequence[Mapping[str, float]]) -> None:
        """A new EDS view (weights + rich telemetry) reaches every replica and Envoy's fallback."""
        self._endpoints = tuple(
            EndpointView(id=e.id, address=e.address, port=e.port, weight=int(w), telemetry=t)
            for e, w, t in zip(self._endpoints, weights, telemetry))
        self.fallback.set_weights(weights)

    def pick(self, request: int, tokens: int, now: float) -> int:
        replica = self.replicas[int(self._rng.random() * len(self.replicas))] if len(self.replicas) > 1 \
            else self.replicas[0]
        priority = self.priorities[request] if self.priorities is not None else Priority.STANDARD
        if self.fair_queue_depth and (replica.waiting or len(replica.router.outstanding) >= self._room):
            heapq.heappush(replica.waiting, (int(priority), request, tokens))
            replica.held += 1
            return HELD
        return self._route(replica, request, tokens, priority, now)

    def released(self, now: float) -> list[tuple[int, int]]:
        """Each replica's held requests, best first, while it has room (the engine calls this after a
        completion)."""
        out: list[tuple[int, int]] = []
        for replica in self.replicas:
            while replica.waiting and len(replica.router.outstanding) < self._room:
                priority, request, tokens = heapq.heappop(replica.waiting)
                out.append((request, self._route(replica, request, tokens, priority, now)))
        return out

    def _route(self, replica: Replica, request: int, tokens: int, priority: int, now: float) -> int:
        view = self._views.get((tokens, self._inputs, priority))
        if view is None:
            view = self._views[(tokens, self._inputs, priority)] = RequestView(
                tokens=tokens * self._inputs, estimated=False, model=None, inputs=self._inputs,
                priority=Priority(priority))
        decision = replica.router.decide(request, view, self._endpoints)
        if type(decision) is Reply:
            replica.shed += 1
            return SHED
        if type(decision) is not Decision:  # none ranked
            replica.fallbacks += 1
            return self.fallback.pick(request, tokens, now)
        replica.picks += 1
        self._who[request] = (replica, view.tokens, decision.predicted_s)
        return self._index[decision.primary]

    def completed(self, request: int, worker: int, now: float, service_s: float, inflight: int) -> None:
        who = self._who.pop(request, None)
        if who is None:
            return  # routed by the fallback: ext_proc picked nothing, so it does not watch the response
        replica, tokens, predicted_s = who
        replica.router.learn(self._ids[worker], tokens, service_s, predicted_s, {ORCA_INFLIGHT_KEY: float(inflight)})
        replica.router.release(request)

    def ticks(self) -> Sequence[tuple[float, Tick]]:
        return ()
