"""Identify the caller: its API key, its class and its budget, from the request headers.

Pick headers a client sent (override_host honours whatever it finds, so only ext_proc may set them) and its
API key are removed: the workers never see one. A key's class caps the class asked for, and the workers
order their queues by the class header, so the class the key allows is set on the request.
"""

from __future__ import annotations

import re
import time

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from inferlb_runtime.model_routing import MODEL_HEADER
from inferlb_runtime.request_class import OBJECTIVE_HEADER, BadRequestHeader, Priority, parse_budget_s, parse_priority

from .. import wire
from ..callers import AUTHORIZATION_HEADER, Caller, identify
from ..context import Answer, RequestContext
from ..metrics import ExtProcMetrics
from ..model import Reply
from ..wire import PREDICTED_HEADER, TOKENS_HEADER
from ..xds.fleet_view import ViewSource


class IdentifyCaller:
    """401 without a valid key (when keys are required, or one was sent and is wrong); 400 for a bad class
    or budget header. Leaves the caller, class, deadline and the request-headers mutation on the context."""

    name = "caller"

    def __init__(self, pick_header: str, require_api_keys: bool, source: ViewSource,
                 metrics: ExtProcMetrics) -> None:
        self.require_api_keys = require_api_keys
        self.source = source
        self.metrics = metrics
        self._strip = (pick_header, TOKENS_HEADER, PREDICTED_HEADER, MODEL_HEADER)
        self._strip_all = (*self._strip, AUTHORIZATION_HEADER)
        # Prefilters on the raw headers, one C search each (a false positive only costs a parse): a header to
        # strip, a key, a class or budget header (both budget headers end so).
        self._strip_raw = _any_of(self._strip)
        self._class_raw = _any_of((OBJECTIVE_HEADER, "-timeout-ms"))
        self._authorization_raw = AUTHORIZATION_HEADER.encode()
        self._class_entries = {p: wire.header_entries(((OBJECTIVE_HEADER, p.name.lower()),)) for p in Priority}

    def on_request_headers(self, ctx: RequestContext) -> Answer | None:
        assert ctx.opening is not None
        message, raw = ctx.opening.request_headers, ctx.headers_raw
        maybe_key = raw is None or self._authorization_raw in raw  # a prefilter: False means no key was sent
        if maybe_key or self._strip_raw.search(raw):  # type: ignore[arg-type]
            keys = {h.key for h in message.headers.headers}
            strip = [name for name in self._strip_all if name in keys]
        else:
            strip = []
        ctx.headers = headers = wire.RequestHeaders(message, strip, raw)
        if maybe_key or self.require_api_keys:
            refused = self._identify(ctx, message, AUTHORIZATION_HEADER in strip)
            if refused is not None:
                return refused
        asked: Priority | None = None
        if raw is None or self._class_raw.search(raw):
            try:
                asked = parse_priority(headers) if OBJECTIVE_HEADER in headers else None
                budget = parse_budget_s(headers)
            except BadRequestHeader as exc:
                self.metrics.count("parse_failures", "request_headers")
                return Answer(wire.reply_response(Reply(400, "invalid_header", str(exc),
                                                        type="invalid_request_error")))
            if budget is not None:
                ctx.deadline = time.perf_counter() + budget
        ctx.priority = priority = ctx.caller.priority_for(asked)
        mutation = b"".join([wire.removal(name) for name in strip]) if strip else b""
        if priority is not (asked if asked is not None else Priority.STANDARD):
            mutation += self._class_entries[priority]  # the class the key allows
        ctx.mutation = mutation
        return None

    def _identify(self, ctx: RequestContext, message: pb.HttpHeaders, sent_key: bool) -> Answer | None:
        caller = identify(wire.header_value(message, AUTHORIZATION_HEADER) if sent_key else None,
                          self.source.key_table, self.require_api_keys)
        if type(caller) is not Caller:
            self.metrics.count("auth_failures", "no_key_table" if caller.status == 503 else
                               "invalid_key" if sent_key else "missing_key")
            ctx.outcome = "unauthenticated"
            return Answer(wire.reply_response(caller))
        ctx.caller = caller
        return None


def _any_of(names: tuple[str, ...]) -> re.Pattern[bytes]:
    return re.compile(b"|".join(re.escape(name.encode()) for name in names))
