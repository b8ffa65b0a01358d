"""The ``envoy.service.ext_proc.v3.ExternalProcessor`` service: one gRPC stream per HTTP request.

Envoy's filter (configured by the control plane) sends request headers, the
whole request body (BUFFERED, up to the route's buffer limit, in one
message) and the response headers. Per stream:

1. **Request headers** -> CONTINUE, removing any pick header the client sent
   (override_host honours whatever it finds, so only ext_proc may set it).
   A request without a body (GET) is decided here. A ``sheddable`` one the shed plugin would shed even
   at the least cost its content-length allows is answered 429 here, before Envoy buffers its body
   (``_shed_unseen``).
2. **Request body** -> count its tokens and ask the router (``routing.py``:
   the pick chain) where it goes. A pick: the ``x-gateway-destination-endpoint``
   header and the same value as dynamic metadata ``envoy.lb`` (primary first,
   then retry fallbacks), plus ``x-inferlb-tokens`` and ``x-inferlb-predicted-ms``
   for the worker. An admit plugin's reply, or no routable endpoint (503):
   an ImmediateResponse in OpenAI's error shape. A body over
   ``max_body_bytes`` (Envoy's buffer limit; body chunks are counted as they
   come, never buffered past it): 413 in the same shape, and the stream ends.
3. **Response headers** -> the router learns from the worker's
   ``server-timing``, ``x-inferlb-tokens`` and ORCA report (2xx only), and the
   request is released.

Models (issue 15): the pick chain's ``model`` filter resolves the body's
``model`` (``model_filter.py``); the version chosen goes to the worker in
``x-inferlb-model`` (a client-sent one is removed, as the pick header is), an
unknown model is answered 404 ``model_not_found`` and an unservable one 503
``model_unavailable``, here. ``GET /v1/models`` (and ``/v1/models/{id}``) is
answered here too, from the fleet's catalogue, so a client sees every version,
alias and rollout the fleet serves, not one worker's list; while no worker says
what it serves (an older fleet) it goes to a worker as before. Per version:
decisions, answers by status class and the time from the decision to the
response headers (the version that served, from the worker's
``x-inferlb-model``, else the one chosen; "other" for names outside the catalogue).

After the response headers nothing else is configured to come (response
body NONE, trailers SKIP), so the servicer ends the stream (status OK) right
after answering them instead of waiting for Envoy's half-close: one gRPC
read less per request, and Envoy treats a server-closed stream as processing
complete.

The gateway cache (issue 16; ``response_cache.py``, keys in ``cache_key.py``):
once the quota is checked (a hit uses it as a served request does) and the model
resolved to a version (the key names it), before the fair queue and the pick,
a repeated ``POST /v1/embeddings`` is answered with the stored 200 as an
ImmediateResponse (``x-inferlb-cache: hit``). A miss whose answer may be stored
(a 200 from the version its key names, not over the per-entry cap, no
``no-store``) gets a ``mode_override`` in the response-headers answer: Envoy
sends that one body (BUFFERED_PARTIAL: never failed for its size), which is
stored, and only then does the stream end. Every other response costs nothing
more than its ``x-inferlb-cache: miss`` header.

FULL_DUPLEX_STREAMED (the Endpoint Picker Protocol's mode, GIE gateways; docs/epp.md):
Envoy says so in the first message's ``protocol_config``. The request-headers
answer is held; body chunks are gathered (under the same cap) until the last
one or the trailers; the decision then goes out as the headers' answer, and
the body back in ``streamed_response`` chunks. Response chunks pass through;
learning and the release wait for the response's end. The data plane's subset
hint (request metadata) bounds the candidates (503 when none is eligible), and
the endpoint it reports as served is the one learnt for.

Whatever ends the stream (the response, a client disconnect, an upstream
reset, Envoy cancelling), the request is released exactly once: a
``finally`` calls the idempotent ``Router.release``. When ext_proc cannot
decide (no view yet, a built-in failing) it lets the request through without
a pick and Envoy's weighted fallback routes it: failing open is the contract.

Speed: the servicer is registered with a raw-bytes method handler. It parses
each ProcessingRequest itself (so it can scan the raw request headers for a
client-sent pick header without walking them) and answers with bytes built by
``wire.py``. Handlers are plain functions: a stream costs three reads and
three writes of gRPC and nothing else awaited, unless a large body is counted
in a thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import AsyncIterator, Mapping
from urllib.parse import unquote

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import duration_pb2
from opentelemetry import trace

from inferlb_runtime.logs import bind_request
from inferlb_runtime.model_routing import MODEL_HEADER
from inferlb_runtime.plugins import PolicyAllowlist
from inferlb_runtime.request_class import OBJECTIVE_HEADER, BadRequestHeader, Priority, parse_budget_s, parse_priority
from inferlb_runtime.tracing import REQUEST_ID_HEADER, Tracing, trace_id_of

from . import wire
from .cache_key import cacheable_request, directives, request_key
from .callers import ANONYMOUS, AUTHORIZATION_HEADER, Caller, identify
from .catalogue import ModelCatalogue
from .metrics import OTHER_MODEL, ExtProcMetrics, LiveState
from .model import Decision, Reply, RequestView
from .fair_queue import FairGate, GateSettings, Outcome
from .outstanding import OutstandingLoad
from .quota import Lease, QuotaOutcome, QuotaStore, rate_limit_headers
from .quota_memory import MemoryQuotaStore
from .quota_reply import quota_reply
from .registry import PluginRegistry
from .response_cache import CachedResponse, ResponseCache
from .response_cache_redis import RedisResponseCache
from .routing import Router
from .spans import CallContext, start_span
from .tokens import TokenCounter
from .wire import PREDICTED_HEADER, PROCESS_METHOD, SERVICE_NAME, TOKENS_HEADER
from .xds_client import FleetView, PickPolicySpec, ViewSource

log = logging.getLogger("inferlb.ext_proc")

# A large body still being counted (and its quota checked) after this long gets Envoy's message timeout extended:
# half the control plane's default message_timeout (200 ms), so the extension is sent well before Envoy gives up.
COUNT_BEFORE_EXTENDING_S = 0.1
# A body this large gets the extension at once: counting it takes a good part of the message timeout (about
# 0.5 s per MiB of short inputs), and on a busy host the timer above fired too late (a 504 in a fresh-clone run).
EXTEND_AT_ONCE_BYTES = 128 * 1024

# A sheddable request is judged at its headers as holding content-length / this many tokens: more bytes per
# token than JSON bodies of English take (4-6 for prose through MiniLM's WordPiece, 5.2-9.4 measured on the
# benchmarks' bodies, the short ones' JSON overhead the most), so its cost is rarely overstated and a request
# shed at its headers is one its body would have been shed for too.
HEADERS_BYTES_PER_TOKEN = 10.0

# The Endpoint Picker Protocol's answer when the data plane's subset hint leaves nothing eligible.
NO_ENDPOINT_IN_SUBSET = Reply(503, "no_endpoint_in_subset", "None of the endpoints this gateway allows for the "
                              "request (its subset hint) is ready. Retry later.", retry_after_s=1)

@dataclass(frozen=True)
class ServiceSettings:
    """What the servicer needs from the configuration."""

    pick_header: str = "x-gateway-destination-endpoint"
    pick_metadata_namespace: str = "envoy.lb"
    response_headers: bool = True
    # The most request body a stream may buffer: Envoy's own limit (the route's request_body_buffer_limit).
    max_body_bytes: int = 4 * 1024 * 1024
    # A request without a known API key is refused (401) rather than served as the anonymous tenant.
    require_api_keys: bool = False
    # Fair admission: requests in flight per routable endpoint (of this replica's share) before new ones wait
    # in the fair queue (0: no queue), and the queue's bounds.
    fair_queue_depth: int = 0
    fair_queue: GateSettings = GateSettings()
    # A newly routable endpoint's share of the picks ramps up over this many seconds (0: no slow start).
    slow_start_s: float = 0.0
    # The gateway cache (in process): its byte bound (0: off), an entry's lifetime and largest size, and
    # whether tenants share answers (False) or each has its own (True).
    cache_max_bytes: int = 0
    cache_ttl_s: float = 300.0
    cache_max_entry_bytes: int = 1024 * 1024
    cache_per_tenant: bool = False


def _same_spec(a: PickPolicySpec, b: PickPolicySpec) -> bool:
    return a.name == b.name and dict(a.params) == dict(b.params)  # EDS numbers are floats: 1.0 == 1


def _serialize(response: bytes | pb.ProcessingResponse) -> bytes:
    return response if type(response) is bytes else response.SerializeToString()


class _Stream:
    """The state of one HTTP request's ext_proc stream; bound as the request of the log lines written for it
    (``request_id`` and ``trace_id`` are read only when a line is written)."""

    __slots__ = ("key", "headers", "body", "body_bytes", "pick", "tokens", "predicted_s", "priority", "deadline",
                 "caller", "quota", "forwarded", "outcome", "mutation", "started", "version", "decided",
                 "cache_key", "cache_version", "resolved", "filling", "span", "held", "response_streamed",
                 "subset", "ending")

    def __init__(self, key: int) -> None:
        self.key = key
        self.headers: Mapping[str, str] = wire.NO_HEADERS
        self.body: list[bytes] = []
        self.body_bytes = 0  # received so far
        self.pick: str | None = None  # the primary endpoint id, once decided (and counted as outstanding)
        self.tokens = 0
        self.predicted_s = 0.0
        self.priority = Priority.STANDARD  # x-gateway-inference-objective
        self.deadline: float | None = None  # time.perf_counter() seconds, from a budget header
        self.caller: Caller = ANONYMOUS  # from the API key (callers.py)
        self.quota: QuotaOutcome | None = None  # the quota check's outcome, if the caller has a quota
        self.forwarded = False  # sent on to a worker (with or without a pick): its quota is used, not refunded
        self.outcome = "failed"  # for the tenant's usage: served, failed, rate_limited, shed, unauthenticated
        self.mutation = b""  # request-header entries a GET's decision still has to apply
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

    @property
    def request_id(self) -> str | None:
        return self.headers.get(REQUEST_ID_HEADER)  # Envoy's x-request-id

    @property
    def trace_id(self) -> str | None:
        return trace_id_of(self.span) if self.span is not None else None


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    """The per-request path. Its collaborators are passed in, so tests can give it a static view.

    Serve it with :meth:`add_to_server` (raw bytes in and out: the fast path). Registered the
    generated way (``add_ExternalProcessorServicer_to_server``) ``Process`` still works, on messages.
    """

    def __init__(self, settings: ServiceSettings, source: ViewSource, counter: TokenCounter, router: Router,
                 metrics: ExtProcMetrics, policy_spec: PickPolicySpec | None = None,
                 quotas: QuotaStore | None = None, shared_cache: RedisResponseCache | None = None,
                 tracing: Tracing | None = None) -> None:
        self.settings = settings
        self.tracing = tracing  # None: tracing off, and a stream costs one test of it
        self.source = source
        self.counter = counter
        self.router = router
        self.metrics = metrics
        self.quotas: QuotaStore = quotas if quotas is not None else MemoryQuotaStore()
        self._releases: set[asyncio.Task[None]] = set()  # quota leases being given back
        self._capacity = 1  # requests this replica may have in flight before new ones queue (on_view)
        self.gate: FairGate | None = None
        if settings.fair_queue_depth:
            self.gate = FairGate(self._has_room, settings.fair_queue, observer=metrics, failure_observer=metrics)
        # Sent before a wait in the fair queue or a large body's counting: Envoy would otherwise give up on the
        # answer after its message_timeout (up to the filter's max_message_timeout, which the control plane sets).
        self._extend_timeout = pb.ProcessingResponse(override_message_timeout=duration_pb2.Duration(
            seconds=math.ceil(settings.fair_queue.max_wait_s) + 1)).SerializeToString()
        self.policy_spec = policy_spec or PickPolicySpec(router.policy)
        self._rejected: PickPolicySpec | None = None  # the last spec EDS asked for that could not be built
        self.active_streams = 0
        self._keys = itertools.count(1)
        self._created = int(time.time())  # the "created" of the models ext_proc lists
        self._models_answer: tuple[ModelCatalogue, bytes] | None = None  # GET /v1/models, per catalogue
        self._strip = (settings.pick_header, TOKENS_HEADER, PREDICTED_HEADER, MODEL_HEADER)
        self._strip_raw = tuple(name.encode() for name in self._strip)
        # A prefilter on the raw headers (a false positive only costs a parse): both budget headers end so.
        self._class_raw = (OBJECTIVE_HEADER.encode(), b"-timeout-ms")
        self._authorization_raw = AUTHORIZATION_HEADER.encode()
        self._strip_all = (*self._strip, AUTHORIZATION_HEADER)
        self._class_entries = {p: wire.header_entries(((OBJECTIVE_HEADER, p.name.lower()),)) for p in Priority}
        self._answers = wire.PickAnswers(settings.pick_header, settings.pick_metadata_namespace)
        self._too_large = wire.body_too_large_response(settings.max_body_bytes)
        self.cache: ResponseCache | None = None
        if settings.cache_max_bytes:
            self.cache = ResponseCache(settings.cache_max_bytes, settings.cache_ttl_s, settings.cache_max_entry_bytes)
            metrics.cache_levels("memory")
        # The shared level (Redis), behind the in-process one; only with it.
        self.shared_cache = shared_cache if self.cache is not None else None
        if self.shared_cache is not None:
            metrics.cache_levels("redis")
        self._shared_stores: set[asyncio.Task[None]] = set()
        self._cached_versions: frozenset[str] = frozenset()  # the catalogue's versions the cache was checked by
        source.add_listener(self.on_view)
        if source.view is not None:
            self.on_view(source.view)

    @classmethod
    def create(cls, settings: ServiceSettings, source: ViewSource, metrics: ExtProcMetrics,
               counter: TokenCounter, default_policy: PickPolicySpec = PickPolicySpec("least_completion_time"),
               allow: PolicyAllowlist = PolicyAllowlist(), quotas: QuotaStore | None = None,
               shared_cache: RedisResponseCache | None = None, tracing: Tracing | None = None) -> "ExtProcServicer":
        """The servicer with a fresh router (``default_policy`` until EDS names one; a bad default raises
        ValueError here, at start-up). Only built-ins, entry points and specs under ``allow``'s module
        prefixes are loaded, whatever EDS names."""
        registry = PluginRegistry.with_slow_start(settings.slow_start_s, allow, metrics.policy_failure)
        router = Router(registry, default_policy.name, dict(default_policy.params))
        return cls(settings, source, counter, router, metrics, default_policy, quotas, shared_cache, tracing)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the ExternalProcessor service on raw bytes (this servicer parses and serialises)."""
        handler = grpc.stream_stream_rpc_method_handler(self.process, request_deserializer=None,
                                                        response_serializer=_serialize)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME,
                                                                              {PROCESS_METHOD: handler}),))

    # -- EDS updates ----------------------------------------------------------
    def on_view(self, view: FleetView) -> None:
        """A new view: forget departed endpoints' fits; switch the pick policy if EDS names another one
        (one this replica may load: else the refusal is logged once, counted, and the current one stays)."""
        self._capacity = max(1, self.settings.fair_queue_depth * len(view.routable) // max(1, view.partition[1]))
        if self.gate is not None:
            self.gate.notify()  # endpoints may have joined
        self.router.cost.retain(set(view.by_id))
        self.metrics.retain_endpoints(view.by_id.keys())
        self.router.set_partition(*view.partition)
        self.router.set_catalogue(view.catalogue)
        if self.cache is not None:
            self._retain_cached(view.catalogue)
        spec = view.pick_policy
        if spec is None or _same_spec(spec, self.policy_spec):
            return
        if self._rejected is not None and _same_spec(spec, self._rejected):
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

    def _retain_cached(self, catalogue: ModelCatalogue) -> None:
        """A version the catalogue no longer lists has its answers dropped (checked only when the set of
        versions changes: EDS repeats the same catalogue with every telemetry update)."""
        versions = frozenset(catalogue.versions)
        if versions == self._cached_versions or self.cache is None:
            return
        self._cached_versions = versions
        dropped = self.cache.retain_versions(versions)
        if dropped:
            self.metrics.cache_state("memory", self.cache.bytes, 0)
            log.info("gateway cache dropped answers of versions gone from the catalogue",
                     extra={"entries": dropped, "versions": sorted(versions)})

    # -- the RPC --------------------------------------------------------------
    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        """The generated API (messages in and out), for a servicer registered the generated way."""
        async for response in self.process(request_iterator, context):
            yield pb.ProcessingResponse.FromString(response)

    async def process(self, request_iterator: AsyncIterator[bytes | pb.ProcessingRequest],
                      context: CallContext | None) -> AsyncIterator[bytes]:
        """One stream: ProcessingRequests (serialised, or messages) in, serialised ProcessingResponses out."""
        stream = _Stream(next(self._keys))
        bind_request(stream)  # this stream's task (and what it starts) logs as this request
        tracing = self.tracing
        self.active_streams += 1
        how = "early"  # the stream ended (cancelled, reset, closed) before the response headers
        parse = pb.ProcessingRequest.FromString
        messages = aiter(request_iterator)
        try:
            async for raw in messages:
                if type(raw) is bytes:
                    request = parse(raw)
                else:
                    request, raw = raw, None
                kind = request.WhichOneof("request")
                if kind == "request_body" or (kind == "request_trailers" and stream.held):
                    if kind == "request_body":
                        message = request.request_body
                        chunk, last = message.body, message.end_of_stream
                    else:  # FULL_DUPLEX_STREAMED: trailers end a body whose last chunk did not say so
                        chunk, last = b"", True
                    stream.body_bytes += len(chunk)
                    if stream.body_bytes > self.settings.max_body_bytes:  # never buffer past Envoy's limit
                        stream.body = []
                        self.metrics.count("fallbacks", "body_too_large")
                        yield self._too_large
                        return  # the immediate response ends the request
                    if not last:  # BUFFERED sends one message (chunks tolerated); FULL_DUPLEX_STREAMED many
                        stream.body.append(chunk)
                        if not stream.held:  # held: nothing is answered until the decision
                            yield wire.CONTINUE_BODY
                        continue
                    body = b"".join((*stream.body, chunk)) if stream.body else chunk
                    stream.body = []
                    extended = False
                    if len(body) > EXTEND_AT_ONCE_BYTES and not stream.held:  # held (EPP): no per-message wait
                        # Counting a large body (say, 200k short inputs) can outlast Envoy's message_timeout,
                        # a 504 for a request the worker would refuse cleanly: extend it (once) before counting.
                        extended = True
                        yield self._extend_timeout
                        counted = await self._count_and_check(stream, body)
                    elif self.counter.needs_thread(body):  # not done soon: extend it (once)
                        task = asyncio.ensure_future(self._count_and_check(stream, body))
                        try:
                            if not (await asyncio.wait({task}, timeout=COUNT_BEFORE_EXTENDING_S))[0]:
                                extended = True
                                yield self._extend_timeout
                            counted = await task
                        finally:
                            task.cancel()  # a no-op once done; else the stream ended under it
                    else:
                        counted = await self._count_and_check(stream, body)
                    if type(counted) is bytes:  # refused: over its quota
                        yield counted
                        continue
                    if self.cache is not None:  # after the quota (a hit counts as served), before the queue
                        looked = await self._look_up(stream, counted, body)
                        if type(looked) is bytes:  # a hit
                            yield looked
                            return  # the immediate response ends the request
                        counted = looked
                    gate = self.gate
                    # It will wait for its turn (tell Envoy); an unknown model's 404 never waits
                    if gate is not None and not gate.passes_now() and not self._unknown_model(counted):
                        shed = self._shed_before_waiting(stream, counted)
                        if shed is not None:
                            yield shed
                            continue
                        if not extended:  # Envoy heeds one override per message; the first covers both
                            yield self._extend_timeout
                        refused = await self._wait_turn(gate, stream)
                        if refused is not None:
                            yield refused
                            continue
                    if stream.held:
                        for answer in self._release_held(stream, counted, body, kind == "request_body"):
                            yield answer
                        continue
                    yield self._decide(stream, counted, False)
                elif kind == "request_headers":
                    if tracing is not None:
                        stream.span = start_span(tracing, context, request.request_headers)
                    if request.HasField("protocol_config"):  # the stream's first message: how Envoy sends bodies
                        stream.held = request.protocol_config.request_body_mode == wire.FULL_DUPLEX
                        stream.response_streamed = request.protocol_config.response_body_mode == wire.FULL_DUPLEX
                    if request.HasField("metadata_context"):
                        stream.subset = wire.subset_hint(request.metadata_context)
                    answer = self._on_request_headers(stream, request.request_headers, raw)
                    if answer is None:  # no body (GET): decide now (never queued: it costs nothing)
                        counted = await self._count_and_check(stream, b"")
                        answer = counted if type(counted) is bytes else (
                            self._list_models(stream) or self._decide(stream, counted, True))
                    elif not answer:
                        continue  # held: answered with the decision, once the body is in
                    yield answer
                elif kind == "response_headers":
                    if stream.response_streamed:
                        stream.body_bytes = 0  # from now on: the response's, if it is being cached
                    yield self._on_response_headers(stream, request)
                    if stream.response_streamed:
                        if request.response_headers.end_of_stream:  # no body is coming
                            self._end_response(stream)
                            return
                    elif stream.filling is None:
                        return  # nothing else is configured to come: close now, do not wait for Envoy's half-close
                elif kind == "response_body" and stream.response_streamed:
                    message = request.response_body
                    if stream.filling is not None:
                        self._collect(stream, message.body)
                    if message.end_of_stream:
                        self._end_response(stream)
                    yield wire.streamed(wire.T_RESPONSE_BODY, message.body, message.end_of_stream)
                    if message.end_of_stream:
                        return
                elif kind == "response_trailers" and stream.response_streamed:
                    self._end_response(stream)
                    yield wire.PASS_THROUGH["response_trailers"]
                    return
                elif kind == "response_body" and stream.filling is not None:
                    self._fill(stream, request.response_body)
                    yield wire.PASS_THROUGH["response_body"]
                    return  # the body was the last thing asked for
                else:
                    yield wire.PASS_THROUGH.get(kind or "", wire.CONTINUE_HEADERS)
        except Exception as exc:
            how = "error"
            log.exception("ext_proc stream failed", extra={"endpoint": stream.pick})
            if stream.span is not None:
                stream.span.record_exception(exc)
                stream.span.set_status(trace.StatusCode.ERROR)
            raise
        finally:  # also on CancelledError and GeneratorExit: Envoy reset or closed the stream
            self.active_streams -= 1
            if stream.span is not None:  # ending only queues it: the SDK's thread exports
                stream.span.set_attributes({"inferlb.outcome": stream.outcome, "inferlb.ended": how})
                stream.span.end()
            if self.router.release(stream.key):  # idempotent: only a first release counts
                self.metrics.count("released", how)
                if self.gate is not None:
                    self.gate.notify()
            self.metrics.tenant_usage(stream.caller.tenant, stream.outcome, stream.tokens)
            lease = stream.quota.lease if stream.quota is not None else None
            if lease is not None and lease.releases(stream.forwarded):  # usually not: nothing in flight to free
                self._give_back(lease, stream.forwarded)
            close = getattr(messages, "aclose", None)  # grpc's receiver: a (Cython) async generator
            if close is not None and not getattr(messages, "ag_running", True):
                # Ended before Envoy's half-close (the usual case): close grpc's receiver here. Left to the
                # garbage collector, its finalizer would wake the loop from outside and run a task per stream.
                await close()

    def _has_room(self, pending: int) -> bool:
        """The fair gate's test: this replica's requests in flight, plus those admitted but not yet routed,
        under its share of the fleet's depth."""
        return len(self.router.outstanding) + pending < self._capacity

    def _give_back(self, lease: Lease, served: bool) -> None:
        """Return a quota lease (in-flight tokens; the minute's share too if the request never ran), off the
        stream: the stream may be ending by cancellation, and Redis is a round trip away."""
        task = asyncio.get_running_loop().create_task(self.quotas.release(lease, served))
        self._releases.add(task)
        task.add_done_callback(self._released)

    def _released(self, task: asyncio.Task[None]) -> None:
        self._releases.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("quota lease release failed", exc_info=task.exception())

    # -- request headers --------------------------------------------------
    def _on_request_headers(self, stream: _Stream, message: pb.HttpHeaders, raw: bytes | None) -> bytes | None:
        """The answer to the request headers; None when no body is coming (a GET): decide now, with
        ``stream.mutation`` still to apply."""
        maybe_key = raw is None or self._authorization_raw in raw  # a prefilter: False means no key was sent
        if maybe_key or any(name in raw for name in self._strip_raw):  # type: ignore[operator]
            keys = {h.key for h in message.headers.headers}
            # Pick headers a client sent, and its API key: the workers never see one.
            strip = [name for name in self._strip_all if name in keys]
        else:
            strip = []
        stream.headers = headers = wire.RequestHeaders(message, strip, raw)
        if maybe_key or self.settings.require_api_keys:
            sent_key = AUTHORIZATION_HEADER in strip
            caller = identify(wire.header_value(message, AUTHORIZATION_HEADER) if sent_key else None,
                              self.source.key_table, self.settings.require_api_keys)
            if type(caller) is not Caller:
                self.metrics.count("auth_failures", "no_key_table" if caller.status == 503 else
                                   "invalid_key" if sent_key else "missing_key")
                stream.outcome = "unauthenticated"
                return wire.reply_response(caller)
            stream.caller = caller
        asked: Priority | None = None
        if raw is None or any(name in raw for name in self._class_raw):
            try:
                asked = parse_priority(headers) if OBJECTIVE_HEADER in headers else None
                budget = parse_budget_s(headers)
            except BadRequestHeader as exc:
                self.metrics.count("parse_failures", "request_headers")
                return wire.reply_response(Reply(400, "invalid_header", str(exc), type="invalid_request_error"))
            if budget is not None:
                stream.deadline = time.perf_counter() + budget
        stream.priority = priority = stream.caller.priority_for(asked)
        mutation = b"".join([wire.removal(name) for name in strip]) if strip else b""
        if priority is not (asked if asked is not None else Priority.STANDARD):
            # The workers order their queues by the class header: tell them the class the key allows.
            mutation += self._class_entries[priority]
        if priority is Priority.SHEDDABLE and not message.end_of_stream:
            shed = self._shed_unseen(stream)
            if shed is not None:
                return shed
        if message.end_of_stream:  # no body is coming (GET): decide now (or list the models)
            stream.mutation = mutation
            stream.held = False
            return None
        if stream.held:  # FULL_DUPLEX_STREAMED: the mutation goes with the decision (b"": nothing to send yet)
            stream.mutation = mutation
            return b""
        return wire.request_headers_answer(mutation)

    def _release_held(self, stream: _Stream, request: RequestView, body: bytes, body_ended: bool) -> list[bytes]:
        """FULL_DUPLEX_STREAMED: the decision as the request-headers answer (the pick header, ``envoy.lb``
        metadata, the held mutation), then the body sent back to Envoy (which forwards only what comes back),
        then the trailers' answer if trailers ended it; or only the refusal (an ImmediateResponse)."""
        stream.held = False
        answer = self._decide(stream, request, True)
        if answer.startswith(wire.T_IMMEDIATE):
            return [answer]
        answers = [answer, *wire.streamed_body(body, body_ended)]
        if not body_ended:
            answers.append(wire.PASS_THROUGH["request_trailers"])
        return answers

    def _list_models(self, stream: _Stream) -> bytes | None:
        """``GET /v1/models`` (or ``/v1/models/{id}``) answered from the catalogue; None for any other request,
        and while the catalogue is empty (no worker says what it serves: the worker answers). Like any request
        of a key, it has passed the key's quota check, and carries its x-ratelimit-* headers."""
        headers = stream.headers
        path = headers.get(":path", "").partition("?")[0]
        if not path.startswith("/v1/models") or headers.get(":method") != "GET":
            return None
        view = self.source.view
        catalogue = view.catalogue if view is not None else None
        if catalogue is None or catalogue.empty:
            return None
        limits = tuple(rate_limit_headers(stream.quota)) if stream.quota is not None else ()
        if path in ("/v1/models", "/v1/models/"):
            stream.outcome, stream.forwarded = "served", True  # answered: its quota is used, as a worker's answer's
            if limits:
                return wire.json_response(catalogue.models_list(self._created), "inferlb_models", *limits)
            cached = self._models_answer
            if cached is None or cached[0] is not catalogue:
                cached = self._models_answer = (catalogue, wire.json_response(catalogue.models_list(self._created),
                                                                              "inferlb_models"))
            return cached[1]
        if not path.startswith("/v1/models/"):
            return None
        name = unquote(path[len("/v1/models/"):])  # an alias may hold a slash (sentence-transformers/...)
        entry = catalogue.model(name, self._created)
        if entry is not None:
            stream.outcome, stream.forwarded = "served", True
            return wire.json_response(entry, "inferlb_model", *limits)
        self.metrics.model_answer(OTHER_MODEL, "404")
        return self._refusal(stream, Reply(404, "model_not_found", catalogue.unknown_message(name),
                                           type="invalid_request_error", param="model"))

    def _shed_unseen(self, stream: _Stream) -> bytes | None:
        """A sheddable request shed before its body comes, when the shed plugin would shed even the cheapest
        request of its size (``HEADERS_BYTES_PER_TOKEN``; of no size without a content-length): Envoy never
        buffers the body, nothing is counted, the 429 goes at once. Only when nothing
        else must see the body first: its key has no quota (checked on the exact token count, before any
        shed), the gateway cache cannot answer it (off, not a cacheable request, or ``no-store``/``no-cache``:
        a hit costs no worker, so it is served, not shed) and the data plane sent no subset hint (its pool is
        not the one judged here). None: judged as before, once the body is in."""
        if not stream.caller.quota.unlimited or stream.subset is not None:
            return None
        if self.cache is not None and cacheable_request(stream.headers):
            asked = directives(stream.headers)
            if not (asked.no_store or asked.no_cache):
                return None
        length = stream.headers.get("content-length", "")
        tokens = int(int(length) / HEADERS_BYTES_PER_TOKEN) if length.isdigit() and len(length) < 19 else 0
        return self._screened(stream, RequestView(tokens, True, None, 0, stream.headers), unseen=True)

    def _shed_before_waiting(self, stream: _Stream, request: RequestView) -> bytes | None:
        """A sheddable request the chain would shed is told so before it waits in the fair queue, where its
        turn comes after every critical and standard request's (its 429 took seconds): the chain's admit
        verdict on the fleet as it stands, no pick made. None: it waits, and is judged again when decided."""
        if stream.priority is not Priority.SHEDDABLE:
            return None
        return self._screened(stream, request, unseen=False)

    def _screened(self, stream: _Stream, request: RequestView, unseen: bool) -> bytes | None:
        """The 429 of a screen (``Router.screen``, or ``screen_unseen`` before the body), or None: judged later.
        A failing screen judges nothing (logged): the decision still runs the whole chain."""
        view = self.source.view
        if view is None or not view.routable:
            return None
        request = self._with_caller(stream, request)
        try:
            screen = self.router.screen_unseen if unseen else self.router.screen
            reply = screen(request, view.endpoints)
        except Exception:
            log.exception("pick chain failed screening a sheddable request; it is judged later",
                          extra={"unseen": unseen})
            return None
        return self._reply(stream, request, reply, "request_headers" if unseen else "screen") \
            if reply is not None else None

    def _unknown_model(self, request: RequestView) -> bool:
        view = self.source.view
        return view is not None and view.catalogue.unknown(request.model)

    def _model_label(self, version: str | None) -> str:
        """A version as a metric label: one the catalogue lists, else "other" (bounded label values)."""
        view = self.source.view
        return version if version is not None and view is not None and version in view.catalogue.versions \
            else OTHER_MODEL

    # -- admission and the decision ---------------------------------------
    async def _count_and_check(self, stream: _Stream, body: bytes) -> RequestView | bytes:
        """Count the tokens, then check the caller's quota: the counted request, or the answer refusing it.
        (Counted even when nothing is routable yet: the view may change while the request waits its turn,
        and the tenant's usage counts its tokens whatever answers it.)"""
        stream.started = time.perf_counter()
        if self.counter.needs_thread(body):  # a large body: counted off the event loop
            request = await asyncio.to_thread(self.counter.count, body, stream.headers)
        else:
            request = self.counter.count(body, stream.headers)
        stream.tokens = request.tokens
        if stream.span is not None:
            stream.span.set_attributes({"inferlb.tokens": request.tokens,
                                        "inferlb.tokens_estimated": request.estimated,
                                        "inferlb.tenant": stream.caller.tenant})
        if not stream.caller.quota.unlimited:
            waited = time.perf_counter()
            refused = await self._check_quota(stream, request.tokens)
            if refused is not None:
                return refused
            stream.started += time.perf_counter() - waited  # the decision time leaves the round trip out
        return request

    async def _wait_turn(self, gate: FairGate, stream: _Stream) -> bytes | None:
        """The fleet is saturated: wait in the fair queue; None when admitted (or critical: routed anyway
        after its wait), else the 429 that ends the request."""
        waited = time.perf_counter()
        budget = stream.deadline - waited if stream.deadline is not None else None
        caller = stream.caller
        outcome = await gate.admit(caller.tenant, caller.weight, int(stream.priority), max(stream.tokens, 1),
                                   budget)
        stream.started += time.perf_counter() - waited  # the decision time leaves the wait out
        if outcome is Outcome.ADMITTED or stream.priority is Priority.CRITICAL:
            return None
        stream.outcome = "shed"
        self.metrics.count("admit_replies", "overloaded")
        self.metrics.count("sheds", "fair_queue")
        return self._refusal(stream, Reply(
            429, "overloaded", f"The fleet is saturated and this request did not get its turn "
            f"({outcome.value.replace('_', ' ')} after {time.perf_counter() - waited:.1f} s in the fair "
            "queue). Retry later, or spread requests over time.", retry_after_s=1))

    @staticmethod
    def _refusal(stream: _Stream, reply: Reply) -> bytes:
        """A reply to a request that passed its quota check: with the key's x-ratelimit-* headers too."""
        if stream.quota is not None:
            reply = dataclasses.replace(reply, headers=(*reply.headers, *rate_limit_headers(stream.quota)))
        return wire.reply_response(reply)

    async def _check_quota(self, stream: _Stream, tokens: int) -> bytes | None:
        """Take the tokens from the caller's quota; the 429 (or, with the store unreachable and failing
        closed, the 503) when it has not got them."""
        caller = stream.caller
        stream.quota = outcome = await self.quotas.acquire(caller.tenant, caller.quota, tokens)
        if outcome.admitted:
            return None
        stream.outcome = "rate_limited"
        if outcome.store_failed:
            self.metrics.count("admit_replies", "quota_unavailable")
            return wire.reply_response(Reply(
                503, "quota_unavailable", "Quotas cannot be checked right now (the quota store is unreachable "
                "and this gateway is configured to fail closed). Retry shortly.", retry_after_s=1))
        self.metrics.count("admit_replies", "rate_limit_exceeded")
        return wire.reply_response(quota_reply(caller.tenant, outcome, tokens))

    def _decide(self, stream: _Stream, request: RequestView, headers_phase: bool) -> bytes:
        mutation = stream.mutation if headers_phase else b""
        view = self.source.view
        if view is None:
            self.metrics.count("fallbacks", "no_view")
            stream.forwarded = True
            return wire.without_pick(headers_phase, mutation)
        if not view.routable:
            if view.catalogue.unknown(request.model):  # a 404 whatever state the fleet is in
                return self._reply(stream, request, view.catalogue.not_found(request.model or ""))
            self.metrics.count("fallbacks", "no_endpoint")
            return wire.NO_ENDPOINT
        if request.estimated and stream.tokens:
            self.metrics.count("fallbacks", "estimated_tokens")
            self.metrics.count("parse_failures", "request_body")
        request = self._with_caller(stream, request)
        allowed = stream.subset.allows if stream.subset is not None else None
        if allowed is not None and not any(allowed(e.id) for e in view.routable):
            return self._reply(stream, request, NO_ENDPOINT_IN_SUBSET)
        try:
            outcome = self.router.decide(stream.key, request, view.endpoints, stream.resolved is view.catalogue,
                                         allowed)
        except Exception:
            log.exception("pick chain failed; letting Envoy's fallback route the request")
            self.metrics.count("fallbacks", "policy_error")
            stream.forwarded = True
            return wire.without_pick(headers_phase, mutation, request.tokens)
        if type(outcome) is Decision:
            stream.forwarded = True
            return self._with_pick(stream, view, request, outcome, headers_phase, mutation)
        if outcome is None and allowed is not None:  # failing open could go outside the subset
            return self._reply(stream, request, NO_ENDPOINT_IN_SUBSET)
        if outcome is None:  # view.routable is not empty (checked above): the chain ranked none
            self.metrics.count("fallbacks", "no_decision")
            stream.forwarded = True
            return wire.without_pick(headers_phase, mutation, request.tokens)
        return self._reply(stream, request, outcome)

    @staticmethod
    def _with_caller(stream: _Stream, request: RequestView) -> RequestView:
        """The request as the chain sees it: its class, budget left, tenant and key id (a sticky rollout's)."""
        if stream.priority is not Priority.STANDARD or stream.deadline is not None or stream.caller.key_id:
            budget = stream.deadline - time.perf_counter() if stream.deadline is not None else None
            return dataclasses.replace(request, priority=stream.priority, budget_s=budget,
                                       tenant=stream.caller.tenant, key_id=stream.caller.key_id)
        return request

    # -- the gateway cache --------------------------------------------------
    async def _look_up(self, stream: _Stream, request: RequestView, body: bytes) -> RequestView | bytes:
        """The cached answer (an ImmediateResponse), or the request to route: resolved to its model version
        when it could be (the key names the version), with ``stream.cache_key`` set when its answer may be
        stored. Unresolvable (no view, nothing routable, an unknown model): routed as without a cache."""
        if not cacheable_request(stream.headers):
            return request
        asked = directives(stream.headers)
        view = self.source.view
        if asked.no_store or view is None or not view.routable:
            return request
        resolved = self.router.resolve(self._with_caller(stream, request), view.endpoints)
        if type(resolved) is Reply:
            return request  # the decision answers it (404, 503) as without a cache
        stream.resolved = view.catalogue
        tenant = stream.caller.tenant if self.settings.cache_per_tenant else None
        name = resolved.version or resolved.model or ""
        if self.counter.needs_thread(body):  # a large body: parsed and hashed off the event loop
            key = await asyncio.to_thread(request_key, body, name, tenant)
        else:
            key = request_key(body, name, tenant)
        if key is None:
            return resolved
        stream.cache_key, stream.cache_version = key, resolved.version
        if asked.no_cache:
            self.metrics.cache_request("memory", "bypass")
            if stream.span is not None:
                stream.span.set_attribute("inferlb.cache", "bypass")
            return resolved
        assert self.cache is not None
        hit = self.cache.get(key)
        self.metrics.cache_request("memory", "hit" if hit is not None else "miss")
        if stream.span is not None:
            stream.span.set_attribute("inferlb.cache", "hit" if hit is not None else "miss")
        if hit is None and self.shared_cache is not None:
            hit = await self.shared_cache.get(key)
            if hit is not None and hit.version not in view.catalogue.versions:
                hit = None  # stored by a replica before its version left the catalogue
            self.metrics.cache_request("redis", "hit" if hit is not None else "miss")
            if hit is not None:
                self.cache.put(key, hit)  # the next one is answered here
        if hit is None:
            return resolved
        stream.outcome, stream.forwarded, stream.cache_key = "served", True, None  # its quota is used
        self.metrics.model_answer(hit.version, "200")  # a 200 of that version, answered here
        limits = tuple(rate_limit_headers(stream.quota)) if stream.quota is not None else ()
        return wire.cached_response(hit.body, hit.content_type, hit.version, *limits)

    def _fillable(self, stream: _Stream, headers: Mapping[str, str], status: str) -> tuple[str, str] | None:
        """(content-type, version) when this response is to be stored: a 200 from the version its key names
        (any version, for a bare alias) and not over the per-entry cap by its length."""
        if stream.cache_key is None or status != "200" or self.cache is None:
            return None
        served = headers.get(MODEL_HEADER)
        if not served or (stream.cache_version is not None and served != stream.cache_version):
            return None
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or not self.cache.fits(int(length))):
            return None
        return headers.get("content-type", "application/json"), served

    def _fill(self, stream: _Stream, message: pb.HttpBody) -> None:
        """Store the worker's answer (whole: a body over Envoy's buffer limit comes in part, and is not)."""
        if message.end_of_stream:
            self._store(stream, bytes(message.body))
        stream.filling = None

    def _store(self, stream: _Stream, body: bytes) -> None:
        assert stream.filling is not None and stream.cache_key is not None and self.cache is not None
        content_type, version = stream.filling
        stream.filling = None
        evictions = self.cache.evictions
        response = CachedResponse(body, content_type, version)
        if self.cache.put(stream.cache_key, response):
            self.metrics.cache_state("memory", self.cache.bytes, self.cache.evictions - evictions)
        if self.shared_cache is not None:  # off the stream: it is ending, and Redis is a round trip away
            task = asyncio.get_running_loop().create_task(self._share(stream.cache_key, response))
            self._shared_stores.add(task)
            task.add_done_callback(self._shared)

    async def _share(self, key: bytes, response: CachedResponse) -> None:
        assert self.shared_cache is not None
        stored = await self.shared_cache.put(key, response)
        if stored is not None:
            self.metrics.cache_state("redis", *stored)

    def _shared(self, task: asyncio.Task[None]) -> None:
        self._shared_stores.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("gateway cache: storing in Redis failed", exc_info=task.exception())

    def _reply(self, stream: _Stream, request: RequestView, reply: Reply, at: str = "decision") -> bytes:
        """ext_proc answers the request itself (an admit plugin's reply, the model filter's 404 or 503);
        ``at``: the step that judged it, counted for a shed (how many 429s never waited for their body)."""
        self.metrics.count("admit_replies", reply.code)
        if reply.status == 429:
            self.metrics.count("sheds", at)
        if reply.param == "model":
            self.metrics.model_answer(self._model_label(request.model), str(reply.status))
        stream.outcome = "shed" if reply.status == 429 else "failed"
        return self._refusal(stream, reply)

    def _with_pick(self, stream: _Stream, view: FleetView, request: RequestView, decision: Decision,
                   headers_phase: bool, mutation: bytes) -> bytes:
        value, pick_option, metadata = self._answers.pick(decision.ranked, view.pick_values)
        stream.pick, stream.predicted_s, stream.version = decision.ranked[0], decision.predicted_s, decision.version
        answer = self._answers.answer(headers_phase, pick_option, metadata, request.tokens, decision.predicted_s,
                                      mutation, decision.version)
        stream.decided = now = time.perf_counter()
        self.metrics.decision(decision.policy, stream.pick, now - stream.started)
        self.metrics.model_decision(self._model_label(decision.version))
        if request.budget_s is not None:
            self.metrics.count("deadlines", "met" if decision.completion_s <= request.budget_s else "missed")
        if stream.span is not None:
            stream.span.set_attributes({
                "inferlb.pick.endpoint": stream.pick, "inferlb.pick.ranked": value,
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
        return answer

    # -- response headers -------------------------------------------------
    def _on_response_headers(self, stream: _Stream, request: pb.ProcessingRequest) -> bytes:
        headers = wire.response_headers_of(request.response_headers)
        status = headers.get(":status", "")
        stream.outcome = "served" if status.startswith("2") else "failed"
        if stream.span is not None:
            stream.span.set_attribute("http.response.status_code", int(status) if status.isdigit() else 0)
        limits = self._limit_entries(stream.quota)
        stream.filling = fill = self._fillable(stream, headers, status)
        read_body = fill is not None and not stream.response_streamed  # streamed: the body comes anyway
        if stream.pick is None:
            return wire.response_headers_answer(None, 0, 0.0, limits, read_body)
        served_by = wire.served_by(request, self.settings.pick_metadata_namespace) or stream.pick
        if served_by != stream.pick:  # Envoy walked down the fallback list (or retried elsewhere)
            self.metrics.count("served", "fallback")
        self.metrics.count("responses", f"{status[:1]}xx" if status else "unknown")
        served = self._model_label(headers.get(MODEL_HEADER) or stream.version)  # the version that served
        self.metrics.model_answer(served, status, time.perf_counter() - stream.decided)
        if stream.response_streamed:  # learnt, and released, when the body has passed
            stream.ending = (served_by, headers, served)
        else:
            self._finish(stream, served_by, headers, served)
        if not self.settings.response_headers:
            return wire.response_headers_answer(None, 0, 0.0, limits, read_body)
        return wire.response_headers_answer(served_by, stream.tokens, stream.predicted_s, limits, read_body)

    def _end_response(self, stream: _Stream) -> None:
        """FULL_DUPLEX_STREAMED: the response's body has passed (its end, or its trailers): learn and release,
        and store it if it is to be cached."""
        if stream.ending is not None:
            self._finish(stream, *stream.ending)
            stream.ending = None
        if stream.filling is not None:
            self._store(stream, b"".join(stream.body))
        stream.body = []

    def _collect(self, stream: _Stream, chunk: bytes) -> None:
        """FULL_DUPLEX_STREAMED: keep a chunk of a response being cached; past the per-entry cap it is not."""
        stream.body.append(chunk)
        stream.body_bytes += len(chunk)
        assert self.cache is not None
        if not self.cache.fits(stream.body_bytes):
            stream.filling, stream.body = None, []

    def _finish(self, stream: _Stream, served_by: str, headers: Mapping[str, str], served: str) -> None:
        """Learn from the response (2xx only) of the endpoint that served it, and release the request."""
        status = headers.get(":status", "")
        learned = self._learn(stream, served_by, headers, served if served != OTHER_MODEL else None) \
            if status.startswith("2") else None
        if stream.span is not None:
            stream.span.set_attributes({"inferlb.served_by": served_by,
                                        "inferlb.response_ms": round((time.perf_counter() - stream.decided) * 1000, 3)})
            if learned is not None and learned.seconds is not None:  # what the prediction was for
                stream.span.set_attribute("inferlb.actual_ms", round(learned.seconds * 1000, 3))
        if self.router.release(stream.key):
            self.metrics.count("released", "response")
            if self.gate is not None:
                self.gate.notify()

    @staticmethod
    def _limit_entries(outcome: QuotaOutcome | None) -> bytes:
        """OpenAI's x-ratelimit-* headers as the quota check left them (none for a caller without a quota)."""
        return wire.header_entries(rate_limit_headers(outcome)) if outcome is not None else b""

    def _learn(self, stream: _Stream, endpoint: str, headers: Mapping[str, str], model: str | None) -> wire.Learned:
        """Teach the router what the worker's answer says (its compute time for ``model``, the version that
        served, and its load report); what it said."""
        learned = wire.read_response(headers)
        if learned.unparsed:
            for what in learned.unparsed:
                self.metrics.count("parse_failures", what)
        predicted = stream.predicted_s if endpoint == stream.pick else None
        tokens = learned.tokens if learned.tokens is not None else stream.tokens
        self.router.learn(endpoint, tokens, learned.seconds, predicted, learned.orca, model)
        return learned

    # -- metrics ----------------------------------------------------------
    def live_state(self) -> LiveState:
        view = self.source.view
        router = self.router
        outstanding = router.outstanding.snapshot()  # a fresh dict of frozen loads
        if view is not None:
            for endpoint in view.by_id:
                outstanding.setdefault(endpoint, OutstandingLoad())
        mape = router.cost.mape()
        return LiveState(
            outstanding=outstanding,
            mape=mape if math.isfinite(mape) else None,
            mape_by_endpoint=router.cost.mape_by_endpoint(),
            observations=router.cost.observations,
            leaked=router.outstanding.leaked,
            xds_connected=self.source.connected,
            view_version=view.version if view is not None else None,
            endpoints=len(view.endpoints) if view is not None else 0,
            routable=len(view.routable) if view is not None else 0,
            policy=self.policy_spec.name,
            active_streams=self.active_streams,
            partition=router.partition.partition,
        )
