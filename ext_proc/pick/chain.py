"""One policy's pick chain, run for one request::

    filters -> sample -> cost -> budget -> admit -> scorers -> picker

Built by the registry (``pick/registry.py``) from a policy's configuration
(``inferlb_runtime/pick_chain.py``); run by the router (``pick/router.py``),
which owns what outlives a policy switch (the cost model, the outstanding
ledger, and the head filters ``routable`` and ``partition`` that every chain
starts with: the router runs them once per EDS view and hands their result in).

Before the filters, a filter that resolves (the built-in ``model`` filter: see
``pick/model_filter.py``) may rewrite the request (the model version it runs on,
which the costing predicts for) or answer it (an unknown model's 404). Built-in
plugins that watch the view (``model``, ``slow_start``) are told each new one
by the router, once; those that watch the decisions (``shed``: the work routed
to each endpoint) are told each one.

The budget step is the chain's own, not a plugin: a request with a deadline
(``RequestView.budget_s``) is never sent where its predicted completion
misses the deadline while another candidate can make it. When none can, all
stay (the worker answers 504 if it cannot start in time; ext_proc's
prediction may be wrong). Admit plugins come after it, so that shedding
judges by the same costed candidates the picker would choose from.

The steps are plain lists read top to bottom, so a decision reads as the
configuration does. The cost of a decision is the filters' (built-ins cache
per sequence object: O(1) until EDS changes), plus O(d) for the sampled
candidates: costing, scoring and picking never see the whole fleet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..model import Admit, Candidate, Decision, EndpointView, Filter, Picker, Reply, RequestView, Scorer
from .catalogue import ModelCatalogue
from .costing import Costing
from .policies import Sampler, Shed


class PickChain:
    """The steps of one policy, in order."""

    def __init__(self, policy: str, admit: Sequence[Admit], filters: Sequence[Filter], sampler: Sampler,
                 scorers: Sequence[tuple[Scorer, float]], picker: Picker) -> None:
        self.policy = policy
        self.admit = tuple(admit)
        self.filters = tuple(filters)
        self.sampler = sampler
        self.scorers = tuple(scorers)
        self.picker = picker
        self._favouring = tuple(s for s, _ in self.scorers if callable(getattr(s, "favourites", None)))
        self._resolving = tuple(f for f in self.filters if callable(getattr(f, "resolve", None)))
        self._watching = tuple(p for p in self.plugins if callable(getattr(p, "new_view", None)))
        self._deciding = tuple(p for p in self.plugins if callable(getattr(p, "decided", None)))
        self._shedding = tuple(a for a in self.admit if isinstance(a, Shed))
        self._single = self.scorers[0][0] if len(self.scorers) == 1 and self.scorers[0][1] == 1.0 else None

    @property
    def plugins(self) -> tuple[object, ...]:
        """Every plugin of the chain, in order (for the guard's observer and for describing it)."""
        return (*self.admit, *self.filters, *(s for s, _ in self.scorers), self.picker)

    def resolve(self, request: RequestView) -> RequestView | Reply:
        """The resolving filters' rewrite of the request (the model version it runs on), or their reply."""
        for r in self._resolving:
            resolved = r.resolve(request)  # type: ignore[attr-defined]
            if type(resolved) is Reply:
                return resolved
            request = resolved
        return request

    def decide(self, request: RequestView, fleet: Sequence[EndpointView], pool: Sequence[EndpointView],
               costing: Costing, resolved: bool = False) -> Decision | Reply | None:
        """A ranked pick, an admit plugin's reply, or None (nothing routable or nothing ranked: the caller
        fails open to Envoy's weighted fallback, or answers 503 when nothing is routable). ``pool`` is what
        the head filters (routable, partition: the router's, run once per view) left of ``fleet``.
        ``resolved``: :meth:`resolve` already ran on this request (a rollout's split must not draw twice)."""
        if not resolved:
            outcome = self.resolve(request)
            if type(outcome) is Reply:
                return outcome
            request = outcome
        candidates = self._candidates(request, pool, costing)
        reply = self._admitted(request, candidates)
        if reply is not None:
            return reply
        if not candidates:
            return None
        single = self._single  # the common case, one scorer of weight 1: its scores are the totals
        scores = single.score(request, candidates) if single is not None else self._totals(request, candidates)
        ranked = self.picker.pick(request, candidates, scores)
        if not ranked:
            return None
        chosen = ranked[0]
        for primary in candidates:
            if primary.endpoint.id == chosen:
                decision = Decision(tuple(ranked), primary.predicted_cost_s, self.policy,
                                    primary.predicted_completion_s, len(candidates), request.version)
                for plugin in self._deciding:
                    plugin.decided(request, decision)  # type: ignore[attr-defined]
                return decision
        raise LookupError(f"the picker chose {chosen}, which is not a candidate")

    def screen(self, request: RequestView, pool: Sequence[EndpointView], costing: Costing) -> Reply | None:
        """The admit plugins' answer to ``request`` as the fleet stands, without a pick and without resolving its
        model (a rollout's split draws once, at the decision): a sheddable request about to wait in the fair
        queue hears at once that it is shed, not after its wait."""
        return self._admitted(request, self._candidates(request, pool, costing, observe=False))

    def screen_unseen(self, request: RequestView, pool: Sequence[EndpointView], costing: Costing) -> Reply | None:
        """The built-in ``shed`` plugins' answer to a request whose body has not come (``request.tokens``: the
        fewest its size suggests, 0 when unknown), with no filter, sample or budget step (each only narrows the
        candidates): the best prediction here bounds from below every one its decision could see, so a request
        shed here would be shed then too (unless the fleet changes meanwhile). Other admit plugins are not
        asked: they judge requests, not a bound."""
        if not self._shedding or not pool:
            return None
        return self._admitted(request, costing.candidates(request, pool, observe=False), self._shedding)

    def _admitted(self, request: RequestView, candidates: Sequence[Candidate],
                  steps: Sequence[Any] | None = None) -> Reply | None:
        """The first reply of the admit plugins (``steps``, all of them by default), or None: it goes on."""
        for step in self.admit if steps is None else steps:
            reply = step.admit(request, candidates)
            if reply is not None:
                return reply
        return None

    def _candidates(self, request: RequestView, pool: Sequence[EndpointView], costing: Costing,
                    observe: bool = True) -> list[Candidate]:
        """filters -> sample -> cost -> budget (``observe``: a decision, whose size and rate costing learns)."""
        for f in self.filters:
            if not pool:
                return []
            pool = f.filter(request, pool)
        if not pool:
            return []
        if self._favouring:
            keep = [e for s in self._favouring for e in s.favourites(request, pool)]  # type: ignore[attr-defined]
            pool = self.sampler.sample(pool, keep)
        else:
            pool = self.sampler.sample(pool)
        candidates = costing.candidates(request, pool, observe)
        if request.budget_s is not None:
            candidates = within_budget(candidates, request.budget_s)
        return candidates

    def new_view(self, routable: Sequence[EndpointView], catalogue: ModelCatalogue) -> None:
        """Tell the plugins that watch the view (once per view, before its decisions)."""
        for plugin in self._watching:
            plugin.new_view(routable, catalogue)  # type: ignore[attr-defined]

    def _totals(self, request: RequestView, candidates: Sequence[Candidate]) -> Sequence[float]:
        totals = [0.0] * len(candidates)
        for scorer, weight in self.scorers:
            for i, s in enumerate(scorer.score(request, candidates)):
                totals[i] += weight * s
        return totals



def within_budget(candidates: list[Candidate], budget_s: float) -> list[Candidate]:
    """The candidates predicted to complete within ``budget_s``; all of them when none is."""
    meeting = [c for c in candidates if c.outstanding_s + c.predicted_cost_s <= budget_s]
    return meeting if meeting else candidates
