"""Admission: the fair gate in front of the decision, and the sheddable requests refused before they wait.

When this replica's share of the fleet is saturated, a request waits its turn in the fair queue
(``admission/gate.py``): token-weighted fair between tenants (every caller without a key is one flow per client),
strict by class with aging, and within a flow the least work first, aged (``admission/order.py``). Room is
counted in work (``admission/rules.py``): the predicted seconds sent per endpoint stay under a budget, so a
short request fits in a gap that a long one does not, and an idle endpoint always takes one. A request whose
predicted wait is past its maximum is refused at once, with that prediction as its Retry-After.

A ``sheddable`` request the pick chain would shed is told so before it waits (its turn comes after every
critical and standard request's), and, when nothing else must see its body first, even before Envoy buffers
its body: judged at its headers by the least its content-length allows.
"""

from __future__ import annotations

import logging
import math
import time

from inferlb_runtime.request_class import Priority

from ..admission.gate import FairGate, GateSettings, Outcome
from ..admission.rules import RATE_PROBE_TOKENS, AdmissionRules
from ..cache.key import cacheable_request, directives
from ..context import Answer, RequestContext, Verdict, Wait
from ..metrics import ExtProcMetrics
from ..model import Reply, RequestView
from ..pick.router import Router
from ..replies import Replies
from ..wire import source_host
from ..xds.fleet_view import FleetView, ViewSource

log = logging.getLogger("inferlb.ext_proc")

# A sheddable request is judged at its headers as holding content-length / this many tokens: more bytes per
# token than JSON bodies of English take (4-6 for prose through MiniLM's WordPiece, 5.2-9.4 measured on the
# benchmarks' bodies, the short ones' JSON overhead the most), so its cost is rarely overstated and a request
# shed at its headers is one its body would have been shed for too.
HEADERS_BYTES_PER_TOKEN = 10.0


class Admission:
    name = "admission"

    def __init__(self, rules: AdmissionRules, settings: GateSettings, cache_answers: bool, source: ViewSource,
                 router: Router, metrics: ExtProcMetrics, replies: Replies) -> None:
        self.rules = rules
        self.cache_answers = cache_answers  # the gateway cache may answer a request (it must see the body)
        self.source = source
        self.router = router
        self.metrics = metrics
        self.replies = replies
        self._capacity = 1  # requests this replica may have in flight before new ones queue (on_view)
        self._endpoints = 1  # routable endpoints of this replica's share
        self._rate = 1.0  # tokens a second this replica's share serves, from the cost model (on_view)
        self.gate: FairGate | None = None
        if rules.depth:
            work = rules.room == "work"
            self.gate = FairGate(self._idle if work else self._has_room, settings, fits=self._fits if work else None,
                                 observer=metrics, failure_observer=metrics)
        else:  # no room to free: this hook is left out of the pipeline (stage.py)
            self.on_end = None  # type: ignore[assignment]

    # -- room -----------------------------------------------------------------------------------------
    def _has_room(self, pending: int) -> bool:
        """Rule "requests": in flight, plus admitted but not yet routed, under the share of the fleet's depth."""
        return len(self.router.outstanding) + pending < self._capacity

    def _idle(self, pending: int) -> bool:
        """Rule "work": an endpoint is idle, so it takes the next request whatever its size (work-conserving)."""
        return len(self.router.outstanding) + pending < self._endpoints

    def _fits(self, pending_tokens: float, tokens: float) -> bool:
        """Rule "work": the predicted seconds sent per endpoint that a worker runs before this request, with
        its own, stay under the budget. The workers serve the least attained service first, so that is the
        work of requests no larger than it: a sentence fits beside batches, a batch only where few wait."""
        ahead = self.router.outstanding.seconds_up_to(int(tokens))
        return ahead + (pending_tokens + tokens) / self._per_endpoint_rate <= self.rules.budget_s * self._endpoints

    @property
    def _per_endpoint_rate(self) -> float:
        return self._rate / self._endpoints

    def on_view(self, view: FleetView) -> None:
        replicas = max(1, view.partition[1])
        routable = view.routable
        self._endpoints = max(1, len(routable) // replicas)
        self._capacity = max(1, self.rules.depth * len(routable) // replicas)
        cost = self.router.cost
        rate = sum(RATE_PROBE_TOKENS / cost.predict(e.id, RATE_PROBE_TOKENS, e.telemetry) for e in routable)
        self._rate = max(rate / replicas, 1.0)
        if self.gate is not None:
            self.gate.notify()  # endpoints may have joined

    # -- the request ----------------------------------------------------------------
    def on_request_headers(self, ctx: RequestContext) -> Answer | None:
        """A sheddable request shed before its body comes, when the shed plugin would shed even the cheapest
        request of its size (of no size without a content-length): Envoy never buffers the body, nothing is
        counted, the 429 goes at once. Only when nothing else must see the body first: its key has no quota
        (checked on the exact token count, before any shed), the gateway cache cannot answer it (off, not a
        cacheable request, or ``no-store``/``no-cache``: a hit costs no worker, so it is served, not shed) and
        the data plane sent no subset hint (its pool is not the one judged here)."""
        if ctx.priority is not Priority.SHEDDABLE or ctx.headers_phase:
            return None
        if not ctx.caller.quota.unlimited or ctx.subset is not None:
            return None
        if self.cache_answers and cacheable_request(ctx.headers):
            asked = directives(ctx.headers)
            if not (asked.no_store or asked.no_cache):
                return None
        length = ctx.headers.get("content-length", "")
        tokens = int(int(length) / HEADERS_BYTES_PER_TOKEN) if length.isdigit() and len(length) < 19 else 0
        return self._screened(ctx, RequestView(tokens, True, None, 0, ctx.headers), unseen=True)

    def on_request(self, ctx: RequestContext) -> Verdict:
        """The fleet is saturated: refuse at once a request that cannot get its turn in time, else wait for
        it (tell Envoy); never a GET (it costs nothing) nor an unknown model's 404."""
        gate = self.gate
        cost = max(ctx.tokens, 1)
        if gate is None or ctx.bodiless or gate.passes_now(cost):
            return None
        assert ctx.request is not None
        view = self.source.view
        if view is not None and view.catalogue.unknown(ctx.request.model):
            return None
        if ctx.priority is Priority.SHEDDABLE:
            shed = self._screened(ctx, ctx.request, unseen=False)
            if shed is not None:
                return shed
        flow, weight, priority = self._flow(ctx), ctx.caller.weight, int(ctx.priority)
        predicted = self._predicted_wait(gate.work_ahead(flow, weight, priority, cost), cost)
        limit = min(gate.settings.max_wait_s, ctx.deadline - time.perf_counter() if ctx.deadline else math.inf)
        if self.rules.early_refusal and predicted > limit and ctx.priority is not Priority.CRITICAL:
            return self._refused_early(ctx, predicted, limit)
        return Wait(self._wait_turn(gate, ctx, flow, cost, predicted), extend_after=0.0)

    def _flow(self, ctx: RequestContext) -> str:
        """The flow a request waits in: its tenant's; a caller without a key, its own client's."""
        tenant = ctx.caller.tenant
        if ctx.caller.key_id is not None or self.rules.flows == "one":
            return tenant
        if self.rules.flows == "header":
            client = ctx.headers.get(self.rules.flow_header, "").rpartition(",")[2].strip()
        else:
            client = source_host(ctx.opening) if ctx.opening is not None else None
        return f"{tenant}@{client}" if client else tenant

    def _predicted_wait(self, work_ahead: float, tokens: int) -> float:
        """Seconds until its turn: the work queued ahead of it at the fleet's rate, plus (rule "work") the
        time for the work sent of requests no larger than it to drain until it fits beside it (a request
        larger than the budget fits only at an idle endpoint: then all that was sent)."""
        excess = 0.0
        if self.rules.room == "work":
            own, budget = tokens / self._per_endpoint_rate, self.rules.budget_s * self._endpoints
            if own > budget:  # it enters only at an idle endpoint: everything in flight goes first
                excess = self.router.outstanding.seconds / self._endpoints
            else:  # until the work of its size or smaller has drained enough for it to fit
                excess = max(0.0, self.router.outstanding.seconds_up_to(tokens) + own - budget) / self._endpoints
        return work_ahead / self._rate + excess

    def _refused_early(self, ctx: RequestContext, predicted: float, limit: float) -> Answer:
        """429 at once, with the prediction as its Retry-After: queuing it would only make it wait for one."""
        ctx.outcome = "shed"
        self.metrics.count("admit_replies", "overloaded")
        self.metrics.count("sheds", "predicted_wait")
        self.metrics.rejected(ctx.caller.tenant, int(ctx.priority), "predicted_wait")
        return ctx.refusal(Reply(
            429, "overloaded", f"The fleet is saturated: this request's turn would come in about {predicted:.1f} s, "
            f"past its maximum wait of {limit:.1f} s. Retry later, or spread requests over time.",
            retry_after_s=max(1, math.ceil(predicted))))

    async def _wait_turn(self, gate: FairGate, ctx: RequestContext, flow: str, cost: int,
                         predicted: float) -> Answer | None:
        """None when admitted (or critical: routed anyway after its wait), else the 429 that ends it."""
        waited = time.perf_counter()
        budget = ctx.deadline - waited if ctx.deadline is not None else None
        outcome = await gate.admit(flow, ctx.caller.weight, int(ctx.priority), cost, budget, ctx.caller.tenant)
        now = time.perf_counter()
        ctx.started += now - waited  # the decision time leaves the wait out
        if outcome is Outcome.ADMITTED:
            self.metrics.admission_waited(ctx.priority, cost, now - waited, predicted)
        if outcome is Outcome.ADMITTED or ctx.priority is Priority.CRITICAL:
            return None
        ctx.outcome = "shed"
        self.metrics.count("admit_replies", "overloaded")
        self.metrics.count("sheds", "fair_queue")
        return ctx.refusal(Reply(
            429, "overloaded", f"The fleet is saturated and this request did not get its turn "
            f"({outcome.value.replace('_', ' ')} after {now - waited:.1f} s in the fair "
            "queue). Retry later, or spread requests over time.", retry_after_s=1))

    def _screened(self, ctx: RequestContext, request: RequestView, unseen: bool) -> Answer | None:
        """The 429 of a screen (``Router.screen``, or ``screen_unseen`` before the body), or None: judged later.
        A failing screen judges nothing (logged): the decision still runs the whole chain."""
        view = self.source.view
        if view is None or not view.routable:
            return None
        request = ctx.chain_request(request)
        try:
            screen = self.router.screen_unseen if unseen else self.router.screen
            reply = screen(request, view.endpoints)
        except Exception:
            log.exception("pick chain failed screening a sheddable request; it is judged later",
                          extra={"unseen": unseen})
            return None
        if reply is None:
            return None
        return self.replies.refuse(ctx, request.model, reply, "request_headers" if unseen else "screen")

    def on_end(self, ctx: RequestContext) -> None:
        """Room may have freed: the request was released (at its response's end, or now)."""
        assert self.gate is not None
        self.gate.notify()
