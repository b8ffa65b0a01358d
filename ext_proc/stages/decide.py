"""Decide: ask the router (the pick chain, ``pick/router.py``) where the request goes.

A pick: the ``x-gateway-destination-endpoint`` header and the same value as dynamic metadata ``envoy.lb``
(primary first, then retry fallbacks), plus ``x-inferlb-tokens`` and ``x-inferlb-predicted-ms`` for the
worker, and the model version chosen in ``x-inferlb-model``. An admit plugin's reply, the model filter's
404 or 503, or no routable endpoint (503): ext_proc answers itself. When it cannot decide (no view yet, a
built-in failing) it lets the request through without a pick and Envoy's weighted fallback routes it:
failing open is the contract.

It also follows the view: departed endpoints' fits are forgotten, and the pick policy EDS names is switched
to, when this replica may load it (else the refusal is logged once, counted, and the current one stays).
"""

from __future__ import annotations

import logging
import time

from .. import wire
from ..context import Answer, RequestContext
from ..metrics import ExtProcMetrics
from ..model import Decision, Reply, RequestView
from ..pick.router import Router
from ..replies import Replies
from ..xds.fleet_view import FleetView, PickPolicySpec, ViewSource

log = logging.getLogger("inferlb.ext_proc")

# The Endpoint Picker Protocol's answer when the data plane's subset hint leaves nothing eligible.
NO_ENDPOINT_IN_SUBSET = Reply(503, "no_endpoint_in_subset", "None of the endpoints this gateway allows for the "
                              "request (its subset hint) is ready. Retry later.", retry_after_s=1)
NO_ENDPOINT = Answer(wire.NO_ENDPOINT)


def same_spec(a: PickPolicySpec, b: PickPolicySpec) -> bool:
    return a.name == b.name and dict(a.params) == dict(b.params)  # EDS numbers are floats: 1.0 == 1


class Decide:
    name = "decide"

    def __init__(self, pick_header: str, metadata_namespace: str, policy_spec: PickPolicySpec, source: ViewSource,
                 router: Router, metrics: ExtProcMetrics, replies: Replies) -> None:
        self.source = source
        self.router = router
        self.metrics = metrics
        self.replies = replies
        self.policy_spec = policy_spec
        self._rejected: PickPolicySpec | None = None  # the last spec EDS asked for that could not be built
        self._answers = wire.PickAnswers(pick_header, metadata_namespace)

    def on_request(self, ctx: RequestContext) -> Answer:
        request = ctx.request
        assert request is not None
        view = self.source.view
        if view is None:
            self.metrics.count("fallbacks", "no_view")
            return self._without_pick(ctx)
        if not view.routable:
            if view.catalogue.unknown(request.model):  # a 404 whatever state the fleet is in
                return self.replies.refuse(ctx, request.model, view.catalogue.not_found(request.model or ""))
            self.metrics.count("fallbacks", "no_endpoint")
            return NO_ENDPOINT
        if request.estimated and ctx.tokens:
            self.metrics.count("fallbacks", "estimated_tokens")
            self.metrics.count("parse_failures", "request_body")
        request = ctx.chain_request(request)
        allowed = ctx.subset.allows if ctx.subset is not None else None
        if allowed is not None and not any(allowed(e.id) for e in view.routable):
            return self.replies.refuse(ctx, request.model, NO_ENDPOINT_IN_SUBSET)
        try:
            outcome = self.router.decide(ctx.key, request, view.endpoints, ctx.resolved is view.catalogue, allowed)
        except Exception:
            log.exception("pick chain failed; letting Envoy's fallback route the request")
            self.metrics.count("fallbacks", "policy_error")
            return self._without_pick(ctx, request.tokens)
        if type(outcome) is Decision:
            ctx.forwarded = True
            return self._with_pick(ctx, view, request, outcome)
        if outcome is None and allowed is not None:  # failing open could go outside the subset
            return self.replies.refuse(ctx, request.model, NO_ENDPOINT_IN_SUBSET)
        if outcome is None:  # view.routable is not empty (checked above): the chain ranked none
            self.metrics.count("fallbacks", "no_decision")
            return self._without_pick(ctx, request.tokens)
        return self.replies.refuse(ctx, request.model, outcome)

    @staticmethod
    def _without_pick(ctx: RequestContext, tokens: int | None = None) -> Answer:
        ctx.forwarded = True
        return Answer(wire.without_pick(ctx.headers_phase, ctx.mutation if ctx.headers_phase else b"", tokens),
                      final=False)

    def _with_pick(self, ctx: RequestContext, view: FleetView, request: RequestView, decision: Decision) -> Answer:
        value, pick_option, metadata = self._answers.pick(decision.ranked, view.pick_values)
        ctx.pick, ctx.predicted_s, ctx.version = decision.ranked[0], decision.predicted_s, decision.version
        answer = self._answers.answer(ctx.headers_phase, pick_option, metadata, request.tokens, decision.predicted_s,
                                      ctx.mutation if ctx.headers_phase else b"", decision.version)
        ctx.decided = now = time.perf_counter()
        self.metrics.decision(decision.policy, ctx.pick, now - ctx.started)
        self.metrics.model_decision(self.replies.model_label(decision.version))
        if request.budget_s is not None:
            self.metrics.count("deadlines", "met" if decision.completion_s <= request.budget_s else "missed")
        if ctx.span is not None:
            ctx.span.set_attributes({
                "inferlb.pick.endpoint": ctx.pick, "inferlb.pick.ranked": value,
                "inferlb.pick.policy": decision.policy, "inferlb.pick.evaluated": decision.evaluated,
                "inferlb.predicted_ms": round(decision.predicted_s * 1000, 3),
                "inferlb.completion_ms": round(decision.completion_s * 1000, 3),
                "inferlb.model.version": decision.version or ""})
        if log.isEnabledFor(logging.DEBUG):
            log.debug("decision", extra={"pick": value, "tokens": request.tokens, "estimated": request.estimated,
                                         "predicted_ms": round(decision.predicted_s * 1000, 3),
                                         "completion_ms": round(decision.completion_s * 1000, 3),
                                         "policy": decision.policy, "evaluated": decision.evaluated,
                                         "tenant": request.tenant})
        return Answer(answer, final=False)

    # -- the view -----------------------------------------------------------------
    def on_view(self, view: FleetView) -> None:
        self.router.cost.retain(set(view.by_id))
        self.metrics.retain_endpoints(view.by_id.keys())
        self.router.set_partition(*view.partition)
        self.router.set_catalogue(view.catalogue)
        spec = view.pick_policy
        if spec is None or same_spec(spec, self.policy_spec):
            return
        if self._rejected is not None and same_spec(spec, self._rejected):
            return  # already refused (and logged): EDS repeats it with every telemetry update
        try:
            self.router.set_policy(spec.name, dict(spec.params))
        except Exception as exc:  # a bad spec must not take the service down: keep the current policy
            self._rejected = spec
            self.metrics.policy_switches.labels(result="rejected").inc()
            log.error("pick policy rejected; keeping the current one",
                      extra={"requested": spec.name, "params": dict(spec.params), "error": str(exc),
                             "current": self.policy_spec.name})
            return
        self.metrics.policy_switches.labels(result="switched").inc()
        log.info("pick policy switched", extra={"from": self.policy_spec.name, "to": spec.name,
                                                "params": dict(spec.params)})
        self.policy_spec = spec
        self._rejected = None
