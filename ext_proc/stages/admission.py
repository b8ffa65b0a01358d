"""Admission: the fair gate in front of the decision, and the sheddable requests refused before they wait.

When this replica's share of the fleet is saturated (``fair_queue_depth`` requests in flight per routable
endpoint), a request waits its turn in the fair queue (``fair_queue.py``): token-weighted fair between
tenants, strict by class with aging. A ``sheddable`` request the pick chain would shed is told so before it
waits (its turn comes after every critical and standard request's), and, when nothing else must see its body
first, even before Envoy buffers its body: judged at its headers by the least its content-length allows.
"""

from __future__ import annotations

import logging
import time

from inferlb_runtime.request_class import Priority

from ..cache_key import cacheable_request, directives
from ..context import Answer, RequestContext, Verdict, Wait
from ..fair_queue import FairGate, GateSettings, Outcome
from ..fleet_view import FleetView, ViewSource
from ..metrics import ExtProcMetrics
from ..model import Reply, RequestView
from ..replies import Replies
from ..routing import Router

log = logging.getLogger("inferlb.ext_proc")

# A sheddable request is judged at its headers as holding content-length / this many tokens: more bytes per
# token than JSON bodies of English take (4-6 for prose through MiniLM's WordPiece, 5.2-9.4 measured on the
# benchmarks' bodies, the short ones' JSON overhead the most), so its cost is rarely overstated and a request
# shed at its headers is one its body would have been shed for too.
HEADERS_BYTES_PER_TOKEN = 10.0


class Admission:
    name = "admission"

    def __init__(self, depth: int, settings: GateSettings, cache_answers: bool, source: ViewSource,
                 router: Router, metrics: ExtProcMetrics, replies: Replies) -> None:
        self.depth = depth  # requests in flight per routable endpoint before new ones wait (0: no queue)
        self.cache_answers = cache_answers  # the gateway cache may answer a request (it must see the body)
        self.source = source
        self.router = router
        self.metrics = metrics
        self.replies = replies
        self._capacity = 1  # requests this replica may have in flight before new ones queue (on_view)
        self.gate = FairGate(self._has_room, settings, observer=metrics, failure_observer=metrics) \
            if depth else None
        if self.gate is None:  # no room to free: these hooks are left out of the pipeline (stage.py)
            self.on_end = None  # type: ignore[assignment]

    def _has_room(self, pending: int) -> bool:
        """This replica's requests in flight, plus those admitted but not yet routed, under its share of the
        fleet's depth."""
        return len(self.router.outstanding) + pending < self._capacity

    def on_view(self, view: FleetView) -> None:
        self._capacity = max(1, self.depth * len(view.routable) // max(1, view.partition[1]))
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
        """The fleet is saturated: wait for a turn (tell Envoy); never a GET (it costs nothing) nor an unknown
        model's 404."""
        gate = self.gate
        if gate is None or ctx.headers_phase and not ctx.held or gate.passes_now():
            return None
        assert ctx.request is not None
        view = self.source.view
        if view is not None and view.catalogue.unknown(ctx.request.model):
            return None
        if ctx.priority is Priority.SHEDDABLE:
            shed = self._screened(ctx, ctx.request, unseen=False)
            if shed is not None:
                return shed
        return Wait(self._wait_turn(gate, ctx), extend_after=0.0)

    async def _wait_turn(self, gate: FairGate, ctx: RequestContext) -> Answer | None:
        """None when admitted (or critical: routed anyway after its wait), else the 429 that ends it."""
        waited = time.perf_counter()
        budget = ctx.deadline - waited if ctx.deadline is not None else None
        caller = ctx.caller
        outcome = await gate.admit(caller.tenant, caller.weight, int(ctx.priority), max(ctx.tokens, 1), budget)
        ctx.started += time.perf_counter() - waited  # the decision time leaves the wait out
        if outcome is Outcome.ADMITTED or ctx.priority is Priority.CRITICAL:
            return None
        ctx.outcome = "shed"
        self.metrics.count("admit_replies", "overloaded")
        self.metrics.count("sheds", "fair_queue")
        return ctx.refusal(Reply(
            429, "overloaded", f"The fleet is saturated and this request did not get its turn "
            f"({outcome.value.replace('_', ' ')} after {time.perf_counter() - waited:.1f} s in the fair "
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
