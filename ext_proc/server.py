"""The ``envoy.service.ext_proc.v3.ExternalProcessor`` service: one gRPC stream per HTTP request.

Envoy's filter (configured by the control plane) sends request headers, the
whole request body (BUFFERED, up to the route's buffer limit, in one
message) and the response headers. Per stream:

1. **Request headers** -> CONTINUE, removing any pick header the client sent
   (override_host honours whatever it finds, so only ext_proc may set it).
   A request without a body (GET) is decided here.
2. **Request body** -> count its tokens, rank the routable endpoints, and
   answer with the pick: the ``x-gateway-destination-endpoint`` header and
   the same value as dynamic metadata ``envoy.lb`` (primary first, then
   retry fallbacks), plus ``x-inferlb-tokens`` and ``x-inferlb-predicted-ms``
   for the worker. The request's predicted work counts as outstanding on the
   primary until the response. No routable endpoint: an ImmediateResponse 503
   in OpenAI's error shape. A body over ``max_body_bytes`` (Envoy's buffer
   limit; body chunks are counted as they come, never buffered past it): an
   ImmediateResponse 413 in the same shape, and the stream ends.
3. **Response headers** -> learn: feed the cost model from the worker's
   ``server-timing``, ``x-inferlb-tokens`` and ORCA report (2xx only), and
   release the outstanding work.

After the response headers nothing else is configured to come (response
body NONE, trailers SKIP), so the servicer ends the stream (status OK) right
after answering them instead of waiting for Envoy's half-close: one gRPC
read less per request, and Envoy treats a server-closed stream as processing
complete.

Whatever ends the stream (the response, a client disconnect, an upstream
reset, Envoy cancelling), the outstanding entry is released exactly once: a
``finally`` calls the idempotent ``Outstanding.finish``. When ext_proc cannot
decide (no view yet, a policy error) it lets the request through without a
pick and Envoy's weighted fallback routes it: failing open is the contract.

Speed (this is the per-request path: see docs/benchmarks.md). The servicer is
registered with a raw-bytes method handler: it parses each ProcessingRequest
itself (so it can scan the raw request headers for a client-sent pick header
without walking them) and answers with pre-serialised bytes: constant answers
are serialised once, the pick's header entry and ``envoy.lb`` metadata are
cached per ranked pick, and only the per-request header entries (tokens,
predicted ms) are encoded per request (protobuf wire format, field numbers
read from the descriptors). Handlers are plain functions: a stream costs
three reads and three writes of gRPC and nothing else awaited, unless a large
body is counted in a thread. The request headers are parsed into a dict only
if a policy reads them.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from inferlb_runtime.hostport import id_of_authority
from inferlb_runtime.plugins import PolicyAllowlist

from .cost import CostModel, parse_orca, parse_server_timing, service_seconds
from .metrics import ExtProcMetrics, LiveState
from .model import RequestView
from .outstanding import Outstanding, OutstandingLoad
from .picker import ORCA_INFLIGHT_KEY, Decision, Picker
from .policy_loading import make_pick_policy
from .tokens import TokenCounter
from .xds_client import EndpointView, PickPolicySpec, ViewSource

log = logging.getLogger("inferlb.ext_proc")

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS_METHOD = "Process"
TOKENS_HEADER = "x-inferlb-tokens"
PREDICTED_HEADER = "x-inferlb-predicted-ms"
# On the response to the client, for observability: the primary pick and what ext_proc counted.
ENDPOINT_RESPONSE_HEADER = "x-inferlb-endpoint"
COUNTED_RESPONSE_HEADER = "x-inferlb-counted-tokens"
SERVER_TIMING_HEADER = "server-timing"
ORCA_HEADER = "endpoint-load-metrics"
# Envoy's attribute for the host that actually served (after retries), if the filter asks for it.
UPSTREAM_ATTRIBUTE = "upstream.address"
EXT_PROC_ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


@dataclass(frozen=True)
class ServiceSettings:
    """What the servicer needs from the configuration."""

    pick_header: str = "x-gateway-destination-endpoint"
    pick_metadata_namespace: str = "envoy.lb"
    response_headers: bool = True
    # The most request body a stream may buffer: Envoy's own limit (the route's request_body_buffer_limit).
    max_body_bytes: int = 4 * 1024 * 1024


# --- protobuf wire format, for the answers built per request ---------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SHORT = [bytes((n,)) for n in range(128)]  # one-byte lengths, the common case


def _ld(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (sub-message, string, bytes)."""
    n = len(payload)
    return tag + (_SHORT[n] if n < 128 else _varint(n)) + payload


def _tag(message: Any, field: str) -> bytes:
    """The key of a length-delimited field, from the descriptor (never a hand-copied number)."""
    return _varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | 2)


_T_HEADER = _tag(base_pb2.HeaderValueOption, "header")
_T_KEY = _tag(base_pb2.HeaderValue, "key")
_T_RAW_VALUE = _tag(base_pb2.HeaderValue, "raw_value")
_APPEND_ACTION = (_varint(base_pb2.HeaderValueOption.DESCRIPTOR.fields_by_name["append_action"].number << 3)
                  + _varint(_OVERWRITE))
_T_SET_HEADERS = _tag(pb.HeaderMutation, "set_headers")
_T_HEADER_MUTATION = _tag(pb.CommonResponse, "header_mutation")
_T_COMMON = _tag(pb.BodyResponse, "response")
assert _T_COMMON == _tag(pb.HeadersResponse, "response")
_T_REQUEST_HEADERS = _tag(pb.ProcessingResponse, "request_headers")
_T_REQUEST_BODY = _tag(pb.ProcessingResponse, "request_body")
_T_RESPONSE_HEADERS = _tag(pb.ProcessingResponse, "response_headers")
_T_DYNAMIC_METADATA = _tag(pb.ProcessingResponse, "dynamic_metadata")


def _option_prefix(key: str) -> bytes:
    """Everything of a ``set_headers`` entry's HeaderValue before its value's length."""
    return _T_KEY + _varint(len(key.encode())) + key.encode() + _T_RAW_VALUE


def _option(prefix: bytes, value: bytes) -> bytes:
    """One ``set_headers`` entry (OVERWRITE_IF_EXISTS_OR_ADD) from :func:`_option_prefix` and the value."""
    n = len(value)
    header = prefix + (_SHORT[n] if n < 128 else _varint(n)) + value
    return _ld(_T_SET_HEADERS, _ld(_T_HEADER, header) + _APPEND_ACTION)


def _phase(tag: bytes, set_headers: bytes) -> bytes:
    """A ProcessingResponse answering one phase (``tag``) with these ``set_headers`` entries."""
    return _ld(tag, _ld(_T_COMMON, _ld(_T_HEADER_MUTATION, set_headers)))


def _metadata(namespace: str, key: str, value: str) -> bytes:
    """``dynamic_metadata`` {namespace: {key: value}}, serialised by protobuf itself (cached per pick)."""
    struct = struct_pb2.Struct()
    struct.fields[namespace].struct_value.fields[key].string_value = value
    return _ld(_T_DYNAMIC_METADATA, struct.SerializeToString())


_P_TOKENS = _option_prefix(TOKENS_HEADER)
_P_PREDICTED = _option_prefix(PREDICTED_HEADER)
_P_ENDPOINT = _option_prefix(ENDPOINT_RESPONSE_HEADER)
_P_COUNTED = _option_prefix(COUNTED_RESPONSE_HEADER)
_PICK_CACHE_MAX = 4096  # ranked picks whose header entry and metadata are kept serialised

# Answers that never change: serialised once.
_CONTINUE_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse()).SerializeToString()
_CONTINUE_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse()).SerializeToString()
_CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse()).SerializeToString()
_PASS_THROUGH = {
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()).SerializeToString(),
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()).SerializeToString(),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()).SerializeToString(),
}


# --- building answers ----------------------------------------------------------------------------


def _set(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                      append_action=_OVERWRITE)


def _headers(headers: pb.HttpHeaders) -> dict[str, str]:
    """Envoy 1.40 sends ``raw_value`` (bytes); older ones ``value``. Keys are lower case."""
    return {h.key: (h.raw_value.decode("latin-1") if h.raw_value else h.value) for h in headers.headers.headers}


def _add_headers(mutation: pb.HeaderMutation, headers: Sequence[tuple[str, str]]) -> None:
    """Append OVERWRITE_IF_EXISTS_OR_ADD entries to ``mutation.set_headers``."""
    add = mutation.set_headers.add
    for key, value in headers:
        option = add()
        option.header.key = key
        option.header.raw_value = value.encode()
        option.append_action = _OVERWRITE


_LEARN_FROM = frozenset({":status", SERVER_TIMING_HEADER, ORCA_HEADER, TOKENS_HEADER})


def _response_headers(headers: pb.HttpHeaders) -> dict[str, str]:
    """Only the response headers ext_proc learns from."""
    out = {}
    for h in headers.headers.headers:
        key = h.key
        if key in _LEARN_FROM:
            raw = h.raw_value
            out[key] = raw.decode("latin-1") if raw else h.value
    return out


class _RequestHeaders(Mapping[str, str]):
    """The request headers as a mapping, parsed from the message only if someone reads them
    (the built-in policies never do), without the stripped ones."""

    __slots__ = ("_message", "_strip", "_dict")

    def __init__(self, message: pb.HttpHeaders, strip: Sequence[str]) -> None:
        self._message = message
        self._strip = strip
        self._dict: dict[str, str] | None = None

    def _parsed(self) -> dict[str, str]:
        if self._dict is None:
            self._dict = _headers(self._message)
            for name in self._strip:
                self._dict.pop(name, None)
        return self._dict

    def __getitem__(self, key: str) -> str:
        return self._parsed()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._parsed())

    def __len__(self) -> int:
        return len(self._parsed())

    def __contains__(self, key: object) -> bool:
        return key in self._parsed()

    def get(self, key: str, default: Any = None) -> Any:
        return self._parsed().get(key, default)

    def __eq__(self, other: object) -> bool:
        return self._parsed() == other if isinstance(other, Mapping) else NotImplemented

    def __repr__(self) -> str:
        return f"_RequestHeaders({self._parsed()!r})"


_NO_HEADERS: Mapping[str, str] = MappingProxyType({})

# The fast forms of the two response headers ext_proc learns from, as the workers write them; anything
# else takes the general parsers in cost.py. Both take the last occurrence, as the general parsers do.
_COMPUTE_MS = re.compile(r"(?:^|,)\s*compute;dur=([0-9]+(?:\.[0-9]+)?)\s*(?=,|$)")
_ORCA_INFLIGHT = re.compile(r"[ ,]named_metrics\.inflight=([0-9]+(?:\.[0-9]+)?)\s*(?=,|$)")


def error_body(message: str, code: str, type_: str = "server_error") -> bytes:
    """OpenAI's error shape, as the workers answer."""
    return orjson.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}})


NO_ENDPOINT_BODY = error_body(
    "No inference endpoint is ready: every worker is unhealthy, draining or not registered. "
    "Retry later.", "no_endpoint_ready")


def _immediate(status: int, body: bytes, details: str, *headers: tuple[str, str]) -> bytes:
    """An ImmediateResponse with a JSON body. ``details`` (Envoy's response code details) starts with
    ``inferlb_``: the listener's local-reply mappers leave such replies as they are (control_plane/resources.py)."""
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),  # type: ignore[arg-type]
        headers=pb.HeaderMutation(set_headers=[_set("content-type", "application/json"),
                                               *(_set(k, v) for k, v in headers)]),
        body=body,
        details=details,
    )).SerializeToString()


_NO_ENDPOINT = _immediate(http_status_pb2.ServiceUnavailable, NO_ENDPOINT_BODY, "inferlb_no_endpoint_ready",
                          ("retry-after", "1"))  # never changes: built once


def body_too_large_response(limit: int) -> bytes:
    """413 for a body over ``limit`` bytes, in the workers' shape (``request_too_large``)."""
    return _immediate(http_status_pb2.PayloadTooLarge,
                      error_body(f"request body is over the limit of {limit} bytes", "request_too_large",
                                 "invalid_request_error"),
                      "inferlb_request_too_large")


def _same_spec(a: PickPolicySpec, b: PickPolicySpec) -> bool:
    return a.name == b.name and dict(a.params) == dict(b.params)  # EDS numbers are floats: 1.0 == 1


def _serialize(response: bytes | pb.ProcessingResponse) -> bytes:
    return response if type(response) is bytes else response.SerializeToString()


# --- one stream ----------------------------------------------------------------------------------


class _Stream:
    """The state of one HTTP request's ext_proc stream."""

    __slots__ = ("key", "headers", "body", "body_bytes", "pick", "tokens", "predicted_s")

    def __init__(self, key: int) -> None:
        self.key = key
        self.headers: Mapping[str, str] = _NO_HEADERS
        self.body: list[bytes] = []
        self.body_bytes = 0  # received so far
        self.pick: str | None = None  # the primary endpoint id, once decided (and counted as outstanding)
        self.tokens = 0
        self.predicted_s = 0.0


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    """The per-request path. Its collaborators are passed in, so tests can give it a static view.

    Serve it with :meth:`add_to_server` (raw bytes in and out: the fast path). Registered the
    generated way (``add_ExternalProcessorServicer_to_server``) ``Process`` still works, on messages.
    """

    def __init__(self, settings: ServiceSettings, source: ViewSource, counter: TokenCounter, cost: CostModel,
                 outstanding: Outstanding, picker: Picker, metrics: ExtProcMetrics,
                 policy_factory: Callable[[str, Mapping[str, Any]], Any] = make_pick_policy) -> None:
        self.settings = settings
        self.source = source
        self.counter = counter
        self.cost = cost
        self.outstanding = outstanding
        self.picker = picker
        self.metrics = metrics
        self._policy_factory = policy_factory
        self.policy_spec = PickPolicySpec(picker.policy.name)
        self._rejected: PickPolicySpec | None = None  # the last spec EDS asked for that could not be built
        self.active_streams = 0
        self._keys = itertools.count(1)
        self._strip = (settings.pick_header, TOKENS_HEADER, PREDICTED_HEADER)
        self._strip_raw = tuple(name.encode() for name in self._strip)
        self._p_pick = _option_prefix(settings.pick_header)
        self._too_large = body_too_large_response(settings.max_body_bytes)
        # ranked pick -> (header value, its set_headers entry, its dynamic_metadata); the same for any view,
        # as an endpoint id (host:port) always gives the same pick value.
        self._picks: dict[tuple[str, ...], tuple[str, bytes, bytes]] = {}
        source.add_listener(self.on_view)
        if source.view is not None:
            self.on_view(source.view)

    @classmethod
    def create(cls, settings: ServiceSettings, source: ViewSource, metrics: ExtProcMetrics,
               counter: TokenCounter, default_policy: PickPolicySpec = PickPolicySpec("least_completion_time"),
               allow: PolicyAllowlist = PolicyAllowlist()) -> "ExtProcServicer":
        """The servicer with a fresh cost model, outstanding ledger and picker (``default_policy`` until
        EDS names one; a bad default raises ValueError here, at start-up). Only built-ins, entry points and
        specs under ``allow``'s module prefixes are loaded, whatever EDS names."""
        cost, outstanding = CostModel(), Outstanding()
        factory = functools.partial(make_pick_policy, allow=allow)
        picker = Picker(factory(default_policy.name, dict(default_policy.params)), cost, outstanding,
                        failure_observer=metrics.policy_failure)
        servicer = cls(settings, source, counter, cost, outstanding, picker, metrics, factory)
        servicer.policy_spec = default_policy
        return servicer

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the ExternalProcessor service on raw bytes (this servicer parses and serialises)."""
        handler = grpc.stream_stream_rpc_method_handler(self.process, request_deserializer=None,
                                                        response_serializer=_serialize)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME,
                                                                              {PROCESS_METHOD: handler}),))

    # -- EDS updates ----------------------------------------------------------
    def on_view(self, view: EndpointView) -> None:
        """A new view: forget departed endpoints' fits; switch the pick policy if EDS names another one
        (one this replica may load: else the refusal is logged once, counted, and the current one stays)."""
        self.cost.retain(set(view.by_id))
        self.metrics.retain_endpoints(view.by_id.keys())
        self.picker.set_partition(*view.partition)
        spec = view.pick_policy
        if spec is None or _same_spec(spec, self.policy_spec):
            return
        if self._rejected is not None and _same_spec(spec, self._rejected):
            return  # already refused (and logged): EDS repeats it with every telemetry update
        try:
            policy = self._policy_factory(spec.name, dict(spec.params))
        except Exception as exc:  # a bad spec must not take the service down: keep the current policy
            self._rejected = spec
            self.metrics.policy_switches.labels(result="rejected").inc()
            log.error("pick policy rejected; keeping the current one",
                      extra={"requested": spec.name, "params": dict(spec.params), "error": str(exc),
                             "current": self.policy_spec.name})
            return
        self.picker.set_policy(policy)
        self.metrics.policy_switches.labels(result="switched").inc()
        log.info("pick policy switched", extra={"from": self.policy_spec.name, "to": spec.name,
                                                "params": dict(spec.params)})
        self.policy_spec = spec
        self._rejected = None

    # -- the RPC --------------------------------------------------------------
    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        """The generated API (messages in and out), for a servicer registered the generated way."""
        async for response in self.process(request_iterator, context):
            yield pb.ProcessingResponse.FromString(response)

    async def process(self, request_iterator: AsyncIterator[bytes | pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext | None) -> AsyncIterator[bytes]:
        """One stream: ProcessingRequests (serialised, or messages) in, serialised ProcessingResponses out."""
        stream = _Stream(next(self._keys))
        self.active_streams += 1
        how = "early"  # the stream ended (cancelled, reset, closed) before the response headers
        parse = pb.ProcessingRequest.FromString
        try:
            async for raw in request_iterator:
                if type(raw) is bytes:
                    request = parse(raw)
                else:
                    request, raw = raw, None
                kind = request.WhichOneof("request")
                if kind == "request_body":
                    message = request.request_body
                    stream.body_bytes += len(message.body)
                    if stream.body_bytes > self.settings.max_body_bytes:  # never buffer past Envoy's limit
                        stream.body = []
                        self.metrics.count("fallbacks", "body_too_large")
                        yield self._too_large
                        return  # the immediate response ends the request
                    if not message.end_of_stream:  # BUFFERED sends one message; tolerate chunks anyway
                        stream.body.append(message.body)
                        yield _CONTINUE_BODY
                        continue
                    body = b"".join((*stream.body, message.body)) if stream.body else message.body
                    stream.body = []
                    if self.counter.needs_thread(body):
                        yield await self._decide_in_thread(stream, body)
                    else:
                        yield self._decide(stream, body, False, ())
                elif kind == "request_headers":
                    yield self._on_request_headers(stream, request.request_headers, raw)
                elif kind == "response_headers":
                    yield self._on_response_headers(stream, request)
                    return  # nothing else is configured to come: close now, do not wait for Envoy's half-close
                else:
                    yield _PASS_THROUGH.get(kind or "", _CONTINUE_HEADERS)
        except Exception:
            how = "error"
            log.exception("ext_proc stream failed", extra={"endpoint": stream.pick})
            raise
        finally:  # also on CancelledError and GeneratorExit: Envoy reset or closed the stream
            self.active_streams -= 1
            if self.outstanding.finish(stream.key):  # idempotent: only a first release counts
                self.metrics.count("released", how)

    # -- request headers --------------------------------------------------
    def _on_request_headers(self, stream: _Stream, message: pb.HttpHeaders, raw: bytes | None) -> bytes:
        if raw is None or any(name in raw for name in self._strip_raw):  # maybe a client-sent pick header
            keys = {h.key for h in message.headers.headers}
            strip = [name for name in self._strip if name in keys]
        else:
            strip = []
        stream.headers = _RequestHeaders(message, strip)
        if message.end_of_stream:  # no body is coming (GET): decide now
            return self._decide(stream, b"", True, strip)
        if not strip:
            return _CONTINUE_HEADERS
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(remove_headers=strip)))).SerializeToString()

    # -- request body -----------------------------------------------------
    async def _decide_in_thread(self, stream: _Stream, body: bytes) -> bytes:
        """A large body: counted off the event loop (then decided on the latest view)."""
        started = time.perf_counter()
        view = self.source.view
        if view is None or not view.routable:
            return self._decide(stream, body, False, ())  # no counting needed to answer that
        request = await asyncio.to_thread(self.counter.count, body, stream.headers)
        return self._decide(stream, body, False, (), request, started)

    def _decide(self, stream: _Stream, body: bytes, headers_phase: bool, strip: Sequence[str],
                request: RequestView | None = None, started: float | None = None) -> bytes:
        if started is None:
            started = time.perf_counter()
        view = self.source.view
        if view is None:
            self.metrics.count("fallbacks", "no_view")
            return self._without_pick(headers_phase, strip)
        if not view.routable:
            self.metrics.count("fallbacks", "no_endpoint")
            return _NO_ENDPOINT
        if request is None:
            request = self.counter.count(body, stream.headers)
        if request.estimated and body:
            self.metrics.count("fallbacks", "estimated_tokens")
            self.metrics.count("parse_failures", "request_body")
        stream.tokens = request.tokens
        try:
            decision = self.picker.decide(request, view.endpoints)
        except Exception:
            log.exception("pick policy failed; letting Envoy's fallback route the request")
            self.metrics.count("fallbacks", "policy_error")
            return self._without_pick(headers_phase, strip, request)
        if decision is None:  # view.routable is not empty (checked above): the policy ranked none
            self.metrics.count("fallbacks", "no_decision")
            return self._without_pick(headers_phase, strip, request)
        return self._with_pick(stream, view, request, decision, headers_phase, started)

    def _pick(self, view: EndpointView, ranked: tuple[str, ...]) -> tuple[str, bytes, bytes]:
        """The pick's header value, its set_headers entry and its dynamic metadata (cached)."""
        cached = self._picks.get(ranked)
        if cached is None:
            pick_values = view.pick_values
            value = ",".join([pick_values[e] for e in ranked])
            settings = self.settings
            cached = (value, _option(self._p_pick, value.encode()),
                      _metadata(settings.pick_metadata_namespace, settings.pick_header, value))
            if len(self._picks) >= _PICK_CACHE_MAX:
                self._picks.clear()
            self._picks[ranked] = cached
        return cached

    def _with_pick(self, stream: _Stream, view: EndpointView, request: RequestView, decision: Decision,
                   headers_phase: bool, started: float) -> bytes:
        ranked = decision.ranked
        value, pick_option, metadata = self._pick(view, ranked)
        primary = ranked[0]
        predicted_s = decision.predicted_s
        stream.pick, stream.predicted_s = primary, predicted_s
        self.outstanding.begin(stream.key, primary, request.tokens, predicted_s)
        answer = _phase(_T_REQUEST_HEADERS if headers_phase else _T_REQUEST_BODY,
                        pick_option + _option(_P_TOKENS, str(request.tokens).encode())
                        + _option(_P_PREDICTED, b"%.3f" % (predicted_s * 1000))) + metadata
        self.metrics.decision(decision.policy, primary, time.perf_counter() - started)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("decision", extra={"pick": value, "tokens": request.tokens, "estimated": request.estimated,
                                         "predicted_ms": round(predicted_s * 1000, 3),
                                         "completion_ms": round(decision.completion_s * 1000, 3),
                                         "policy": decision.policy, "evaluated": decision.evaluated})
        return answer

    @staticmethod
    def _without_pick(headers_phase: bool, strip: Sequence[str], request: RequestView | None = None) -> bytes:
        """Fail open: no pick, Envoy's weighted least_request chooses. The client's pick stays removed."""
        response = pb.ProcessingResponse()
        mutation = (response.request_headers if headers_phase else response.request_body).response.header_mutation
        if request is not None:
            _add_headers(mutation, ((TOKENS_HEADER, str(request.tokens)),))
        mutation.remove_headers.extend(strip)
        return response.SerializeToString()

    # -- response headers -------------------------------------------------
    def _on_response_headers(self, stream: _Stream, request: pb.ProcessingRequest) -> bytes:
        if stream.pick is None:
            return _CONTINUE_RESPONSE_HEADERS
        headers = _response_headers(request.response_headers)
        served_by = self._upstream(request) or stream.pick
        status = headers.get(":status", "")
        self.metrics.count("responses", f"{status[:1]}xx" if status else "unknown")
        if status.startswith("2"):
            self._learn(stream, served_by, headers)
        if self.outstanding.finish(stream.key):
            self.metrics.count("released", "response")
        if not self.settings.response_headers:
            return _CONTINUE_RESPONSE_HEADERS
        return _phase(_T_RESPONSE_HEADERS,
                      _option(_P_ENDPOINT, served_by.encode()) + _option(_P_COUNTED, str(stream.tokens).encode())
                      + _option(_P_PREDICTED, b"%.3f" % (stream.predicted_s * 1000)))

    @staticmethod
    def _upstream(request: pb.ProcessingRequest) -> str | None:
        """The id of the host that answered, if Envoy sends the ``upstream.address`` attribute (after a
        retry it is not the primary pick). Envoy writes ``[ip]:port`` for IPv6; the fleet view's ids do not
        bracket, so the attribute is mapped to the id (else an IPv6 worker's responses would teach nothing)."""
        attributes = request.attributes.get(EXT_PROC_ATTRIBUTES_KEY)
        if attributes is None:
            return None
        value = attributes.fields.get(UPSTREAM_ATTRIBUTE)
        if value is None or not value.string_value:
            return None
        try:
            return id_of_authority(value.string_value)
        except ValueError:  # not ip:port (a pipe, an internal address): fall back to the pick
            return None

    def _learn(self, stream: _Stream, endpoint: str, headers: Mapping[str, str]) -> None:
        """Feed the cost model (the worker's compute time) and the picker (its ORCA load report)."""
        orca_text = headers.get(ORCA_HEADER)
        if orca_text:
            found = _ORCA_INFLIGHT.findall(orca_text) if orca_text.startswith("TEXT ") else None
            if found:  # the workers' form: only the in-flight figure is used
                self.picker.note_load(endpoint, {ORCA_INFLIGHT_KEY: float(found[-1])})
            else:
                orca = parse_orca(orca_text)
                if orca:
                    self.picker.note_load(endpoint, orca)
                else:
                    self.metrics.count("parse_failures", "orca")
        tokens = stream.tokens
        raw_tokens = headers.get(TOKENS_HEADER)
        if raw_tokens is not None:  # what the worker actually ran (after truncation)
            try:
                tokens = int(raw_tokens)
            except ValueError:
                self.metrics.count("parse_failures", "tokens_header")
        timing_text = headers.get(SERVER_TIMING_HEADER)
        if not timing_text:
            return  # not a worker's answer (or a worker without timings): nothing to learn
        found = _COMPUTE_MS.findall(timing_text)
        seconds = float(found[-1]) / 1000.0 if found else 0.0
        if not seconds > 0.0:  # not the workers' form, or no compute time: the general parser decides
            seconds = service_seconds(parse_server_timing(timing_text))
            if seconds is None:
                self.metrics.count("parse_failures", "server_timing")
                return
        predicted = stream.predicted_s if endpoint == stream.pick else None
        self.cost.observe(endpoint, tokens, seconds, predicted)

    # -- metrics ----------------------------------------------------------
    def live_state(self) -> LiveState:
        view = self.source.view
        outstanding = self.outstanding.snapshot()  # a fresh dict of frozen loads
        if view is not None:
            for endpoint in view.by_id:
                outstanding.setdefault(endpoint, OutstandingLoad())
        mape = self.cost.mape()
        return LiveState(
            outstanding=outstanding,
            mape=mape if math.isfinite(mape) else None,
            mape_by_endpoint=self.cost.mape_by_endpoint(),
            observations=self.cost.observations,
            leaked=self.outstanding.leaked,
            xds_connected=self.source.connected,
            view_version=view.version if view is not None else None,
            endpoints=len(view.endpoints) if view is not None else 0,
            routable=len(view.routable) if view is not None else 0,
            policy=self.policy_spec.name,
            active_streams=self.active_streams,
            partition=self.picker.partition,
        )


# --- the gRPC server -----------------------------------------------------------------------------


def server_options(max_message_bytes: int, reuse_port: bool = False) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Envoy PINGs the ext_proc connection (HTTP/2 keepalive) even when idle; gRPC's
        # defaults would answer that with GOAWAY "too_many_pings".
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 0),
        # By default fail loudly if the port is taken instead of silently sharing it. With reuse_port,
        # several ext_proc processes share the port and the kernel spreads Envoy's connections (not
        # streams) over them: scaling past one core needs as many connections as processes.
        ("grpc.so_reuseport", 1 if reuse_port else 0),
    ]


class HealthReporter:
    """grpc.health.v1: NOT_SERVING until the first EDS view, then SERVING; NOT_SERVING while stopping."""

    def __init__(self, source: ViewSource) -> None:
        self.servicer = health_aio.HealthServicer()
        self._tasks: set[asyncio.Task[None]] = set()
        self._serving = False
        source.add_listener(self._on_view)

    async def start(self, ready: bool) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.SERVING if ready
                            else health_pb2.HealthCheckResponse.NOT_SERVING)
        self._serving = ready

    def _on_view(self, view: EndpointView) -> None:
        if not self._serving:
            self._serving = True
            task = asyncio.get_running_loop().create_task(self._set_all(health_pb2.HealthCheckResponse.SERVING))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _set_all(self, status: int) -> None:
        for service in ("", SERVICE_NAME):
            await self.servicer.set(service, status)

    async def stop(self) -> None:
        await self.servicer.enter_graceful_shutdown()


async def serve_grpc(servicer: ExtProcServicer, health: HealthReporter, target: str,
                     max_message_bytes: int, reuse_port: bool = False) -> grpc.aio.Server:
    server = grpc.aio.server(options=server_options(max_message_bytes, reuse_port))
    servicer.add_to_server(server)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    if server.add_insecure_port(target) == 0:
        raise OSError(f"cannot listen on {target}")
    await server.start()
    await health.start(ready=servicer.source.view is not None)
    return server
