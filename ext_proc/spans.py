"""The trace span of one ext_proc stream (one HTTP request), when tracing is on.

Its parent: the ``traceparent`` in the stream's gRPC metadata, which Envoy's ext_proc filter sends when
Envoy traces (the filter's gRPC call is a child span of Envoy's request span), so Envoy's request, its call
to ext_proc and ext_proc's decision are one trace. Without one (Envoy not tracing), a ``traceparent`` the
client sent in the request headers, so ext_proc joins the client's trace; else a new trace.

ext_proc does not set ``traceparent`` on the request it forwards: Envoy's router writes its own span's
context there (the worker's span is a child of Envoy's upstream span, the call that reached the worker), and
would overwrite anything ext_proc set. One tree, in the order the calls were made:
Envoy request -> {Envoy's ext_proc call -> ext_proc decision, Envoy's upstream call -> worker request}.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from opentelemetry import trace

from inferlb_runtime.tracing import REQUEST_ID_HEADER, TRACEPARENT_HEADER, Tracing

from . import wire

SPAN_NAME = "ext_proc decision"
_TRACE_KEYS = (TRACEPARENT_HEADER, "tracestate")


class CallContext(Protocol):
    """What a stream's span reads of its call: its gRPC metadata (grpcio's ServicerContext, the native front's
    Invocation)."""

    def invocation_metadata(self) -> Sequence[tuple[str, str | bytes]] | None: ...


def _from_metadata(metadata: Sequence[tuple[str, str | bytes]] | None) -> dict[str, str]:
    carrier = {}
    for key, value in metadata or ():
        if key in _TRACE_KEYS:
            carrier[key] = value.decode("latin-1") if isinstance(value, bytes) else value
    return carrier


def start_span(tracing: Tracing, context: CallContext | None, headers: pb.HttpHeaders) -> trace.Span:
    """The stream's span, started when its request headers arrive (they name the request)."""
    carrier = _from_metadata(context.invocation_metadata() if context is not None else None)
    if TRACEPARENT_HEADER not in carrier:
        sent = wire.header_value(headers, TRACEPARENT_HEADER)
        if sent is not None:
            carrier = {TRACEPARENT_HEADER: sent}
    path = (wire.header_value(headers, ":path") or "").partition("?")[0]
    attributes = {"http.request.method": wire.header_value(headers, ":method") or "", "url.path": path}
    request_id = wire.header_value(headers, REQUEST_ID_HEADER)
    if request_id is not None:
        attributes["inferlb.request_id"] = request_id
    return tracing.tracer.start_span(SPAN_NAME, context=tracing.extract(carrier), kind=trace.SpanKind.SERVER,
                                     attributes=attributes)
