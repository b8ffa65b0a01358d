"""Decide where a request goes, and learn from how it went: what the live servicer and the simulator share.

The servicer (``server.py``) speaks ext_proc's gRPC and calls :meth:`Router.decide` when a request's body
is in, :meth:`Router.learn` with what the response headers said, and :meth:`Router.release` when the
stream ends however it ends. The simulator (``inferlb/sim/ext_proc_model.py``) calls the same three on
its simulated clock, so what it measures is this code, not a copy of it.

The router owns what outlives a policy switch: the cost model, the outstanding ledger, the load reports
(``pick/costing.py``) and the head filters of every chain (``routable``, then this replica's ``partition``,
run once per EDS view); the policy's own steps are a :class:`~ext_proc.pick.chain.PickChain` swapped whole by
:meth:`set_policy`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..model import Decision, EndpointView, Reply, RequestView
from .catalogue import EMPTY, ModelCatalogue
from .chain import PickChain
from .cost import CostModel
from .costing import Costing
from .outstanding import Outstanding
from .policies import Partition, routable
from .registry import PluginRegistry


class Router:
    """One per ext_proc process (or simulated replica); called on its event loop."""

    def __init__(self, registry: PluginRegistry, policy: str, params: Mapping[str, Any] | None = None, *,
                 cost: CostModel | None = None, outstanding: Outstanding | None = None,
                 clock: Callable[[], float] = time.monotonic, **costing_options: Any) -> None:
        """A bad ``policy`` or ``params`` raises ValueError here (at start-up)."""
        self.registry = registry
        self.cost = cost if cost is not None else CostModel()
        self.outstanding = outstanding if outstanding is not None else Outstanding(clock=clock)
        self.costing = Costing(self.cost, self.outstanding, clock=clock, **costing_options)
        self.partition = Partition()
        self._fleet: Sequence[EndpointView] | None = None
        self._candidates: Sequence[EndpointView] = ()  # what the head filters leave of the current view
        self._routable: Sequence[EndpointView] = ()  # the current view's routable endpoints
        self._catalogue: ModelCatalogue = EMPTY  # what the fleet serves (set by the servicer per view)
        self.chain: PickChain = registry.build(policy, params)

    @property
    def policy(self) -> str:
        return self.chain.policy

    def set_policy(self, name: str, params: Mapping[str, Any] | None = None) -> None:
        """Switch to another policy's chain; the next decision uses it. ValueError (and no switch) if it
        cannot be built."""
        self.chain = self.registry.build(name, params)
        if self._fleet is not None:
            self.chain.new_view(self._routable, self._catalogue)

    def set_catalogue(self, catalogue: ModelCatalogue) -> None:
        """The fleet's model catalogue (``FleetView.catalogue``, set with each view); without one (the
        simulator) nothing is routed by model."""
        if catalogue is not self._catalogue:
            self._catalogue = catalogue
            self._fleet = None  # the chain's plugins see it with the next decision's view

    def set_partition(self, index: int, count: int) -> None:
        """Our place among the ext_proc replicas (the control plane's list of them, in EDS)."""
        self.partition.set_partition(index, count)
        self._fleet = None  # re-derive the partition and the traffic share on the next decision

    def resolve(self, request: RequestView, fleet: Sequence[EndpointView]) -> RequestView | Reply:
        """Only the chain's resolution (the model version the request runs on), before :meth:`decide`: the
        gateway cache keys by the version, and looks up before the request waits for its turn."""
        if fleet is not self._fleet:
            self._new_view(fleet)
        return self.chain.resolve(request)

    def decide(self, key: int, request: RequestView, fleet: Sequence[EndpointView],
               resolved: bool = False, allowed: Callable[[str], bool] | None = None) -> Decision | Reply | None:
        """Run the chain (``resolved``: :meth:`resolve` already ran on ``request`` against this catalogue). A
        decision's predicted work counts as outstanding on its primary (under ``key``) until :meth:`release`.
        ``allowed``: the data plane's subset hint (by endpoint id); it replaces the partition, since the
        data plane, not this replica's share, says which endpoints this request may use.
        Plugins' exceptions are contained by their guards; a built-in's propagates (the caller counts it and
        fails open)."""
        if fleet is not self._fleet:
            self._new_view(fleet)
        pool = self._candidates if allowed is None else [e for e in self._routable if allowed(e.id)]
        outcome = self.chain.decide(request, fleet, pool, self.costing, resolved)
        if type(outcome) is Decision:
            self.outstanding.begin(key, outcome.ranked[0], request.tokens, outcome.predicted_s)
        return outcome

    def screen(self, request: RequestView, fleet: Sequence[EndpointView]) -> Reply | None:
        """The chain's admit verdict on ``request`` now, with no pick made (``PickChain.screen``); the decision
        still runs the whole chain later."""
        if fleet is not self._fleet:
            self._new_view(fleet)
        return self.chain.screen(request, self._candidates, self.costing)

    def screen_unseen(self, request: RequestView, fleet: Sequence[EndpointView]) -> Reply | None:
        """The shed's verdict on a request whose body has not come, costed at the fewest tokens it may hold
        (``PickChain.screen_unseen``): a 429 here is one the decision would give it too."""
        if fleet is not self._fleet:
            self._new_view(fleet)
        return self.chain.screen_unseen(request, self._candidates, self.costing)

    def _new_view(self, fleet: Sequence[EndpointView]) -> None:
        """The head filters run once per view (their answer is the same until EDS changes)."""
        self._fleet = fleet
        self._routable = routable(fleet)
        self._candidates = self.partition.narrow(fleet, self._routable)
        self.costing.new_view(fleet, self._candidates if self.partition.partitioned else fleet)
        self.chain.new_view(self._routable, self._catalogue)

    def learn(self, endpoint: str, tokens: int, seconds: float | None = None, predicted_s: float | None = None,
              orca: Mapping[str, float] | None = None, model: str | None = None) -> None:
        """What a response taught: the worker's load report (``orca``) and its compute ``seconds`` for
        ``tokens`` of ``model`` (the version that ran, if known; ``predicted_s``: what was predicted for it, to
        score the cost model). Call it before :meth:`release` (the report counted the request still)."""
        if orca:
            self.costing.note_load(endpoint, orca)
        if seconds is not None:
            self.cost.observe(endpoint, tokens, seconds, predicted_s, model)

    def release(self, key: int) -> bool:
        """The request under ``key`` is over (idempotent: True the first time only)."""
        return self.outstanding.finish(key)
