"""A real OTLP/gRPC trace receiver for tests: the collector's TraceService, built on opentelemetry-proto.

It listens on 127.0.0.1 (an ephemeral port), keeps every span it is sent, flattened to what a test
checks (service, ids, parent, name, attributes), and answers each export with success.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind is not None else None


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root span
    name: str
    attributes: Mapping[str, Any]


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.exports = 0
        self.endpoint = ""  # http://127.0.0.1:<port>, once listening

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        service=str(resource.get("service.name", "")), trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(), parent_id=span.parent_span_id.hex(), name=span.name,
                        attributes={kv.key: _value(kv.value) for kv in span.attributes}))
        with self._lock:
            self._spans.extend(received)
            self.exports += 1
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [span for span in self.spans() if span.trace_id == trace_id]


@contextmanager
def running_otlp_receiver() -> Iterator[OtlpReceiver]:
    """The receiver, serving until the block ends (stopped even when the block fails)."""
    receiver = OtlpReceiver()
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    receiver.endpoint = f"http://127.0.0.1:{port}"
    try:
        yield receiver
    finally:
        server.stop(grace=None).wait(10)
