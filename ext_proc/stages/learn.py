"""Learn: what the worker's answer teaches the router, and the request's release.

At the response headers: the endpoint that served (Envoy may have walked down the fallback list), counted
by status and by the model version that served. At the response's end (its headers, unless its body
streams): the router learns the worker's compute time and load report (2xx only) and the request is
released, so its outstanding work leaves the endpoint's count. Whatever ends the stream (a client
disconnect, an upstream reset, Envoy cancelling), the request is released exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from inferlb_runtime.model_routing import MODEL_HEADER

from .. import wire
from ..context import RequestContext
from ..metrics import OTHER_MODEL, ExtProcMetrics
from ..pick.router import Router
from ..replies import Replies


class Learn:
    name = "learn"

    def __init__(self, router: Router, metrics: ExtProcMetrics, replies: Replies) -> None:
        self.router = router
        self.metrics = metrics
        self.replies = replies

    def on_response_headers(self, ctx: RequestContext) -> None:
        if ctx.pick is None:
            return
        status = ctx.status
        served_by = ctx.served_by or ctx.pick
        if served_by != ctx.pick:  # Envoy walked down the fallback list (or retried elsewhere)
            self.metrics.count("served", "fallback")
        self.metrics.count("responses", f"{status[:1]}xx" if status else "unknown")
        served = self.replies.model_label(ctx.response.get(MODEL_HEADER) or ctx.version)  # what served
        self.metrics.model_answer(served, status, time.perf_counter() - ctx.decided)
        ctx.served_by = served_by
        ctx.ending = (served_by, ctx.response, served)

    def on_response_end(self, ctx: RequestContext) -> None:
        """Learn from the response (2xx only) of the endpoint that served it, and release the request."""
        if ctx.ending is None:
            return
        served_by, headers, served = ctx.ending
        ctx.ending = None
        learned = self._learn(ctx, served_by, headers, served if served != OTHER_MODEL else None) \
            if ctx.status.startswith("2") else None
        if ctx.span is not None:
            ctx.span.set_attributes({"inferlb.served_by": served_by,
                                     "inferlb.response_ms": round((time.perf_counter() - ctx.decided) * 1000, 3)})
            if learned is not None and learned.seconds is not None:  # what the prediction was for
                ctx.span.set_attribute("inferlb.actual_ms", round(learned.seconds * 1000, 3))
        if self.router.release(ctx.key):
            self.metrics.count("released", "response")

    def _learn(self, ctx: RequestContext, endpoint: str, headers: Mapping[str, str],
               model: str | None) -> wire.Learned:
        """Teach the router what the worker's answer says (its compute time for ``model``, the version that
        served, and its load report); what it said."""
        learned = wire.read_response(headers)
        if learned.unparsed:
            for what in learned.unparsed:
                self.metrics.count("parse_failures", what)
        predicted = ctx.predicted_s if endpoint == ctx.pick else None
        tokens = learned.tokens if learned.tokens is not None else ctx.tokens
        self.router.learn(endpoint, tokens, learned.seconds, predicted, learned.orca, model)
        return learned

    def on_end(self, ctx: RequestContext) -> None:
        if self.router.release(ctx.key):  # idempotent: only a first release counts
            self.metrics.count("released", ctx.ended)
