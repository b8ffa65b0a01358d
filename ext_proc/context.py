"""What one request's stages share: its typed context, and what a stage may answer.

State has three owners (as in the Gateway API Inference Extension's director): the **request** (this
:class:`RequestContext`, one per ext_proc stream, dropped when the stream ends), each **stage** (its own
object: the cache, the fair gate, the quota store, the router) and the **data layer** (the fleet view
from EDS, ``xds_client.ViewSource``). A stage reads and writes the request's fields; it keeps nothing of a
request past its ``on_end``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Optional

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from opentelemetry import trace

from inferlb_runtime.request_class import Priority
from inferlb_runtime.tracing import REQUEST_ID_HEADER, trace_id_of

from . import wire
from .callers import ANONYMOUS, Caller
from .model import Reply, RequestView
from .quota import QuotaOutcome, rate_limit_headers


class Answer(NamedTuple):
    """A stage's answer to Envoy. ``final``: ext_proc answered the request itself (an ImmediateResponse) and
    the stream ends; otherwise it is the request's forwarding answer (the decision), and the stream goes on.
    (A named tuple: one is made per request, and a frozen dataclass costs several times more to make.)"""

    message: bytes
    final: bool = True


@dataclass(frozen=True, slots=True)
class Wait:
    """A stage that must wait (a thread, a round trip, the fair queue) before it answers: the runner awaits
    ``work`` (its verdict: an :class:`Answer`, or None to pass the request on). ``extend_after``: send Envoy
    the message-timeout extension at once (0), after this many seconds of waiting, or never (None)."""

    work: Awaitable[Optional[Answer]]
    extend_after: float | None = None


Verdict = Optional[Answer | Wait]


class RequestContext:
    """One HTTP request's ext_proc stream. Bound as the request of the log lines written for it
    (``request_id`` and ``trace_id`` are read only when a line is written)."""

    __slots__ = ("key", "headers", "body", "body_bytes", "request", "pick", "tokens", "predicted_s", "priority",
                 "deadline", "caller", "quota", "forwarded", "outcome", "mutation", "started", "version",
                 "decided", "cache_key", "cache_version", "resolved", "filling", "span", "held",
                 "response_streamed", "subset", "ending", "headers_phase", "response", "status", "served_by",
                 "limits", "opening", "headers_raw", "payload", "ended", "answered", "done", "step")

    def __init__(self, key: int) -> None:
        self.key = key
        self.headers: Mapping[str, str] = wire.NO_HEADERS
        self.body: list[bytes] = []  # chunks so far (the request's, then a response's being cached)
        self.body_bytes = 0  # received so far
        self.payload = b""  # the whole request body, once it is in
        self.answered = False  # ext_proc answered the request itself (a final Answer): the stream ends
        self.done = False  # the stream's last answer was sent
        self.step = 0  # the index of the request stage that answered, or waits
        self.ended = "early"  # how the stream ended: early (before the response), response, or error
        self.request: RequestView | None = None  # once counted
        self.pick: str | None = None  # the primary endpoint id, once decided (and counted as outstanding)
        self.tokens = 0
        self.predicted_s = 0.0
        self.priority = Priority.STANDARD  # x-gateway-inference-objective
        self.deadline: float | None = None  # time.perf_counter() seconds, from a budget header
        self.caller: Caller = ANONYMOUS  # from the API key (callers.py)
        self.quota: QuotaOutcome | None = None  # the quota check's outcome, if the caller has a quota
        self.forwarded = False  # sent on to a worker (with or without a pick): its quota is used, not refunded
        self.outcome = "failed"  # for the tenant's usage: served, failed, rate_limited, shed, unauthenticated
        self.mutation = b""  # request-header entries the headers' answer carries (or the decision, if held)
        self.started = 0.0  # time.perf_counter() the decision began (admission waits added: not counted)
        self.version: str | None = None  # the model version chosen for it (x-inferlb-model), if one was
        self.decided = 0.0  # time.perf_counter() of the pick
        self.cache_key: bytes | None = None  # its gateway-cache key, when its answer may be stored
        self.cache_version: str | None = None  # the version the key names (None: a bare alias, or no model)
        self.resolved: object = None  # the catalogue its model was resolved against before the decision
        self.filling: tuple[str, str] | None = None  # (content-type, version) of the answer being stored
        self.span: trace.Span | None = None  # its trace span, while tracing is on (spans.py)
        # FULL_DUPLEX_STREAMED (the Endpoint Picker Protocol's mode; Envoy says so in protocol_config): the
        # request-headers answer is held until the body is in and decided; the response body passes through.
        self.held = False
        self.response_streamed = False
        self.subset: wire.Subset | None = None  # the data plane's subset hint, when it sent one
        self.ending: tuple[str, Mapping[str, str], str] | None = None  # learnt at the response's end (streamed)
        self.headers_phase = False  # decided in the request-headers answer (no body, or held)
        self.response: Mapping[str, str] = wire.NO_HEADERS  # the response headers, once they came
        self.status = ""  # the response's :status
        self.served_by: str | None = None  # the endpoint named in the response-headers answer
        self.limits = b""  # x-ratelimit-* header entries for the response-headers answer
        # The stream's first message, the request headers (and serialised, when it came as bytes): for the
        # stage that reads the caller's headers without parsing them all, and its address.
        self.opening: pb.ProcessingRequest | None = None
        self.headers_raw: bytes | None = None

    @property
    def request_id(self) -> str | None:
        return self.headers.get(REQUEST_ID_HEADER)  # Envoy's x-request-id

    @property
    def trace_id(self) -> str | None:
        return trace_id_of(self.span) if self.span is not None else None

    @property
    def bodiless(self) -> bool:
        """No body came (a GET, decided at its headers): no listing, cache or wait applies to a body."""
        return self.headers_phase and not self.held

    def chain_request(self, request: RequestView) -> RequestView:
        """The request as the pick chain sees it: its class, budget left, tenant and key id (a sticky
        rollout's)."""
        if self.priority is not Priority.STANDARD or self.deadline is not None or self.caller.key_id:
            budget = self.deadline - time.perf_counter() if self.deadline is not None else None
            return dataclasses.replace(request, priority=self.priority, budget_s=budget,
                                       tenant=self.caller.tenant, key_id=self.caller.key_id)
        return request

    def refusal(self, reply: Reply) -> Answer:
        """ext_proc refuses the request itself: with the key's x-ratelimit-* headers once its quota was
        checked."""
        if self.quota is not None:
            reply = dataclasses.replace(reply, headers=(*reply.headers, *rate_limit_headers(self.quota)))
        return Answer(wire.reply_response(reply))
