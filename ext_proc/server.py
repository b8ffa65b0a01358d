"""The ``envoy.service.ext_proc.v3.ExternalProcessor`` service: one gRPC stream per HTTP request.

This module is the gRPC stream and the stage runner only. What happens to a request is in its stages
(``ext_proc/stages/``), in the order ``pipeline.py`` declares; ``stage.py`` says what a stage is.

1. **Request headers**: the headers stages run; the answer CONTINUEs with their mutation (a GET: decided).
2. **Request body** (BUFFERED: one message, up to the route's buffer limit): chunks are counted as they come,
   never buffered past ``max_body_bytes`` (413, and the stream ends). Once whole, the request stages run: a
   final answer (an ImmediateResponse, OpenAI's error shape) ends the request; the decision forwards it. A
   stage that must wait (a thread, the fair queue) gets Envoy's message timeout extended first.
3. **Response headers**: the response stages run and the answer adds the observability and x-ratelimit-*
   headers. Nothing else is configured to come, so the stream ends right after (one gRPC read less, and
   Envoy treats a server-closed stream as complete); a response being cached has its body asked for first.

FULL_DUPLEX_STREAMED (the Endpoint Picker Protocol's mode; docs/epp.md): the headers' answer is held until
the body is in and decided; the body goes back in ``streamed_response`` chunks; response chunks pass through.
Whatever ends the stream, the end hooks run exactly once (a ``finally``): release, usage, leases.

Speed: raw bytes in and out (``wire.py``); hooks are plain functions found once, at build time: a stream costs
three reads and three writes of gRPC and nothing else awaited, unless a stage must wait.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from typing import Any, AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import duration_pb2
from opentelemetry import trace

from inferlb_runtime.logs import bind_request
from inferlb_runtime.plugins import PolicyAllowlist
from inferlb_runtime.tracing import Tracing

from . import wire
from .admission.gate import FairGate
from .cache.redis_store import RedisResponseCache
from .context import Answer, RequestContext, Wait
from .live import live_state
from .metrics import ExtProcMetrics, LiveState
from .pick.registry import PluginRegistry
from .pick.router import Router
from .pipeline import Collaborators, build_stages
from .quota import QuotaStore
from .quota.memory_store import MemoryQuotaStore
from .service_settings import ServiceSettings as ServiceSettings  # importable here, as before
from .spans import CallContext, start_span
from .tokens import TokenCounter
from .wire import PROCESS_METHOD, SERVICE_NAME
from .xds.fleet_view import FleetView, PickPolicySpec, ViewSource

log = logging.getLogger("inferlb.ext_proc")


def _serialize(response: bytes | pb.ProcessingResponse) -> bytes:
    return response if type(response) is bytes else response.SerializeToString()


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    """The per-request path. Its collaborators are passed in, so tests can give it a static view.

    Serve it with :meth:`add_to_server` (raw bytes in and out: the fast path). Registered the
    generated way (``add_ExternalProcessorServicer_to_server``) ``Process`` still works, on messages.
    """

    def __init__(self, settings: ServiceSettings, source: ViewSource, counter: TokenCounter, router: Router,
                 metrics: ExtProcMetrics, policy_spec: PickPolicySpec | None = None,
                 quotas: QuotaStore | None = None, shared_cache: RedisResponseCache | None = None,
                 tracing: Tracing | None = None, allow: PolicyAllowlist = PolicyAllowlist()) -> None:
        self.settings = settings
        self.tracing = tracing  # None: tracing off, and a stream costs one test of it
        self.source = source
        self.counter = counter
        self.router = router
        self.metrics = metrics
        self.quotas: QuotaStore = quotas if quotas is not None else MemoryQuotaStore()
        self.stages = build_stages(settings, Collaborators(source, counter, router, metrics, self.quotas,
                                                           shared_cache), policy_spec or PickPolicySpec(router.policy),
                                   allow)
        self._on_end = self.stages.on_end[::-1]  # the last stage to take the request lets go first
        self._on_response_end = self.stages.on_response_end[::-1]
        # Sent before a stage waits (the fair queue, a large body's counting): Envoy would otherwise give up on
        # the answer after its message_timeout (up to the filter's max_message_timeout, the control plane's).
        self._extend_timeout = pb.ProcessingResponse(override_message_timeout=duration_pb2.Duration(
            seconds=math.ceil(settings.fair_queue.max_wait_s) + 1)).SerializeToString()
        self._too_large = wire.body_too_large_response(settings.max_body_bytes)
        self.active_streams = 0
        self._keys = itertools.count(1)
        source.add_listener(self.on_view)
        if source.view is not None:
            self.on_view(source.view)

    @classmethod
    def create(cls, settings: ServiceSettings, source: ViewSource, metrics: ExtProcMetrics,
               counter: TokenCounter, default_policy: PickPolicySpec = PickPolicySpec("least_completion_time"),
               allow: PolicyAllowlist = PolicyAllowlist(), quotas: QuotaStore | None = None,
               shared_cache: RedisResponseCache | None = None, tracing: Tracing | None = None) -> "ExtProcServicer":
        """The servicer with a fresh router (``default_policy`` until EDS names one; a bad default, or an
        operator stage that cannot be loaded, raises ValueError here, at start-up). Only built-ins, entry
        points and specs under ``allow``'s module prefixes are loaded, whatever EDS names."""
        registry = PluginRegistry.with_slow_start(settings.slow_start_s, allow, metrics.policy_failure)
        router = Router(registry, default_policy.name, dict(default_policy.params))
        return cls(settings, source, counter, router, metrics, default_policy, quotas, shared_cache, tracing, allow)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the ExternalProcessor service on raw bytes (this servicer parses and serialises)."""
        handler = grpc.stream_stream_rpc_method_handler(self.process, request_deserializer=None,
                                                        response_serializer=_serialize)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME,
                                                                              {PROCESS_METHOD: handler}),))

    # -- the stages, as the rest of the service sees them ---------------------------------------------------
    def stage(self, name: str) -> Any:
        """The pipeline's stage of that name (KeyError when this configuration has none)."""
        return self.stages.by_name[name]

    @property
    def policy_spec(self) -> PickPolicySpec:
        return self.stage("decide").policy_spec  # type: ignore[no-any-return]

    @property
    def gate(self) -> FairGate | None:
        return self.stage("admission").gate  # type: ignore[no-any-return]

    def on_view(self, view: FleetView) -> None:
        """A new view from EDS: each stage follows it (capacity, fits, the pick policy, cached versions)."""
        for hook in self.stages.on_view:
            hook(view)

    # -- the RPC ------------------------------------------------------------------------------------------
    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        """The generated API (messages in and out), for a servicer registered the generated way."""
        async for response in self.process(request_iterator, context):
            yield pb.ProcessingResponse.FromString(response)

    async def process(self, request_iterator: AsyncIterator[bytes | pb.ProcessingRequest],
                      context: CallContext | None) -> AsyncIterator[bytes]:
        """One stream: ProcessingRequests (serialised, or messages) in, serialised ProcessingResponses out."""
        ctx = RequestContext(next(self._keys))
        bind_request(ctx)  # this stream's task (and what it starts) logs as this request
        self.active_streams += 1
        parse = pb.ProcessingRequest.FromString
        messages = aiter(request_iterator)
        try:
            async for raw in messages:
                if type(raw) is bytes:
                    request = parse(raw)
                else:
                    request, raw = raw, None
                kind = request.WhichOneof("request")
                if kind == "request_body" or (kind == "request_trailers" and ctx.held):
                    taken = self._take_body(ctx, request, kind)
                    if taken is not None:
                        if taken:
                            yield taken
                        if taken is self._too_large:
                            return  # the immediate response ends the request
                        continue
                elif kind == "request_headers":
                    answer = self._on_request_headers(ctx, request, raw, context)
                    if answer is not None or not ctx.headers_phase:  # else no body is coming (GET): decide now
                        if answer is not None:
                            yield answer
                        if ctx.answered:
                            return
                        continue
                else:
                    yield self._on_response(ctx, request, kind)
                    if ctx.done:
                        return
                    continue
                verdict = self._first_verdict(ctx, 0)
                if type(verdict) is Wait or ctx.held:  # a stage waits (a thread, Redis, the queue), or held
                    async for answer in self._settle(ctx, verdict, kind == "request_trailers"):
                        yield answer
                else:
                    ctx.answered = verdict.final
                    yield verdict.message
                if ctx.answered:
                    return  # the immediate response ends the request
        except Exception as exc:
            ctx.ended = "error"
            log.exception("ext_proc stream failed", extra={"endpoint": ctx.pick})
            if ctx.span is not None:
                ctx.span.record_exception(exc)
                ctx.span.set_status(trace.StatusCode.ERROR)
            raise
        finally:  # also on CancelledError and GeneratorExit: Envoy reset or closed the stream
            self._ended(ctx)
            close = getattr(messages, "aclose", None)  # grpc's receiver: a (Cython) async generator
            if close is not None and not getattr(messages, "ag_running", True):
                # Ended before Envoy's half-close (the usual case): close grpc's receiver here. Left to the
                # garbage collector, its finalizer would wake the loop from outside and run a task per stream.
                await close()

    def _ended(self, ctx: RequestContext) -> None:
        self.active_streams -= 1
        if ctx.span is not None:  # ending only queues it: the SDK's thread exports
            ctx.span.set_attributes({"inferlb.outcome": ctx.outcome, "inferlb.ended": ctx.ended})
            ctx.span.end()
        for hook in self._on_end:
            hook(ctx)

    # -- the request ----------------------------------------------------------------------------------------
    def _on_request_headers(self, ctx: RequestContext, request: pb.ProcessingRequest, raw: bytes | None,
                            context: CallContext | None) -> bytes | None:
        """The headers' answer; None when nothing is to be sent yet (a GET is decided next; a held stream
        answers with its decision)."""
        message = request.request_headers
        if self.tracing is not None:
            ctx.span = start_span(self.tracing, context, message)
        if request.HasField("protocol_config"):  # the stream's first message: how Envoy sends bodies
            ctx.held = request.protocol_config.request_body_mode == wire.FULL_DUPLEX
            ctx.response_streamed = request.protocol_config.response_body_mode == wire.FULL_DUPLEX
        if request.HasField("metadata_context"):
            ctx.subset = wire.subset_hint(request.metadata_context)
        ctx.opening, ctx.headers_raw = request, raw
        ctx.headers_phase = message.end_of_stream
        for hook in self.stages.on_request_headers:
            answer = hook(ctx)
            if answer is not None:
                ctx.answered = True
                return answer.message
        if ctx.headers_phase:
            ctx.held = False
            return None
        return None if ctx.held else wire.request_headers_answer(ctx.mutation)

    def _take_body(self, ctx: RequestContext, request: pb.ProcessingRequest, kind: str) -> bytes | None:
        """Gather a body chunk: what to answer it with (b"": nothing, held), or None once the body is whole
        (``ctx.payload``). Over the cap: the 413."""
        if kind == "request_body":
            message = request.request_body
            chunk, last = message.body, message.end_of_stream
        else:  # FULL_DUPLEX_STREAMED: trailers end a body whose last chunk did not say so
            chunk, last = b"", True
        ctx.body_bytes += len(chunk)
        if ctx.body_bytes > self.settings.max_body_bytes:  # never buffer past Envoy's limit
            ctx.body = []
            self.metrics.count("fallbacks", "body_too_large")
            return self._too_large
        if not last:  # BUFFERED sends one message (chunks tolerated); FULL_DUPLEX_STREAMED many
            ctx.body.append(chunk)
            return b"" if ctx.held else wire.CONTINUE_BODY  # held: nothing is answered until the decision
        ctx.payload = b"".join((*ctx.body, chunk)) if ctx.body else chunk
        ctx.body = []
        ctx.headers_phase = ctx.held  # held: the decision is the headers' answer
        return None

    def _first_verdict(self, ctx: RequestContext, start: int) -> Answer | Wait:
        """Run the request stages from ``start`` until one answers or must wait (the decision always answers);
        ``ctx.step`` is its index."""
        hooks = self.stages.on_request
        for index in range(start, len(hooks)):
            verdict = hooks[index](ctx)
            if verdict is not None:
                ctx.step = index
                return verdict
        raise RuntimeError("the request pipeline ended without a decision")

    async def _settle(self, ctx: RequestContext, verdict: Answer | Wait | None, trailers: bool) -> AsyncIterator[bytes]:
        """Await the waiting stages, each in turn, and go on with the rest until one answers. Envoy's message
        timeout is extended before a wait (or once it outlasts the stage's ``extend_after``); Envoy heeds one
        override per message, so the first covers every later wait."""
        extended = False
        while type(verdict) is Wait:
            after = verdict.extend_after
            if after is None or extended:
                verdict = await verdict.work
            else:
                task = asyncio.ensure_future(verdict.work)
                try:
                    if after <= 0 or not (await asyncio.wait({task}, timeout=after))[0]:
                        extended = True
                        yield self._extend_timeout
                    verdict = await task
                finally:
                    task.cancel()  # a no-op once done; else the stream ended under it
            if verdict is None:
                verdict = self._first_verdict(ctx, ctx.step + 1)
        ctx.answered = verdict.final
        yield verdict.message
        if ctx.held and not verdict.final:  # the decision as the headers' answer, then the body sent back (Envoy
            ctx.held = False                # forwards only what comes back), then the trailers' answer
            for chunk in wire.streamed_body(ctx.payload, not trailers):
                yield chunk
            if trailers:
                yield wire.PASS_THROUGH["request_trailers"]

    # -- the response ---------------------------------------------------------------------------------------
    def _on_response(self, ctx: RequestContext, request: pb.ProcessingRequest, kind: str | None) -> bytes:
        """The answer to a response message; ``ctx.done`` when it is the stream's last."""
        if kind == "response_headers":
            answer = self._on_response_headers(ctx, request)
            if not ctx.response_streamed:  # nothing else is configured to come, unless its body is cached
                ctx.done = ctx.filling is None
            elif request.response_headers.end_of_stream:  # no body is coming
                self._end_response(ctx)
                ctx.done = True
            return answer
        if kind == "response_body" and (ctx.response_streamed or ctx.filling is not None):
            message = request.response_body
            for hook in self.stages.on_response_body:
                hook(ctx, message.body, message.end_of_stream)
            if not ctx.response_streamed:
                ctx.done = True  # the body was the last thing asked for
                return wire.PASS_THROUGH["response_body"]
            if message.end_of_stream:
                self._end_response(ctx)
                ctx.done = True
            return wire.streamed(wire.T_RESPONSE_BODY, message.body, message.end_of_stream)
        if kind == "response_trailers" and ctx.response_streamed:
            self._end_response(ctx)
            ctx.done = True
            return wire.PASS_THROUGH["response_trailers"]
        return wire.PASS_THROUGH.get(kind or "", wire.CONTINUE_HEADERS)

    def _on_response_headers(self, ctx: RequestContext, request: pb.ProcessingRequest) -> bytes:
        ctx.response = headers = wire.response_headers_of(request.response_headers)
        ctx.status = status = headers.get(":status", "")
        ctx.outcome = "served" if status.startswith("2") else "failed"
        if ctx.span is not None:
            ctx.span.set_attribute("http.response.status_code", int(status) if status.isdigit() else 0)
        if ctx.pick is not None:
            ctx.served_by = wire.served_by(request, self.settings.pick_metadata_namespace)
        for hook in self.stages.on_response_headers:
            hook(ctx)
        if not ctx.response_streamed:  # the response's end, as far as learning goes
            for hook in self._on_response_end:
                hook(ctx)
        read_body = ctx.filling is not None and not ctx.response_streamed  # streamed: the body comes anyway
        served_by = ctx.served_by if ctx.pick is not None and self.settings.response_headers else None
        return wire.response_headers_answer(served_by, ctx.tokens, ctx.predicted_s, ctx.limits, read_body)

    def _end_response(self, ctx: RequestContext) -> None:
        """FULL_DUPLEX_STREAMED: the response's body has passed (its end, or its trailers)."""
        for hook in self._on_response_end:
            hook(ctx)

    def live_state(self) -> LiveState:
        return live_state(self.router, self.source, self.policy_spec.name, self.active_streams)
