"""Tracing without a network: what the OTEL_* variables turn on (and refuse), Envoy's tracing resources, the
request-id middleware, and the log filter stamping the bound request on a line."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import httpx
import pytest
from envoy.config.trace.v3 import opentelemetry_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from control_plane import type_urls
from control_plane.config import DataPlaneConfig
from control_plane.resources import build_static_resources
from inferlb_runtime.logs import RequestContextFilter, RequestIds, bind_request, unbind_request
from inferlb_runtime.request_context import RequestContextMiddleware
from inferlb_runtime.tracing import Tracing, TracingConfig, start_tracing

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}


@pytest.mark.parametrize("env", [{}, {"OTEL_SERVICE_NAME": "x"}, {**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"},
                                 {**ENDPOINT, "OTEL_SDK_DISABLED": "true"}])
def test_tracing_is_off_unless_the_variables_turn_it_on(env: dict[str, str]) -> None:
    assert TracingConfig.from_env(env, "svc") is None
    assert start_tracing(None) is None  # off: no provider, no exporter


def test_an_endpoint_or_the_otlp_exporter_turns_it_on() -> None:
    config = TracingConfig.from_env(ENDPOINT, "svc")
    assert config is not None and config.endpoint == "http://127.0.0.1:4317" and config.service_name == "svc"
    named = TracingConfig.from_env({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SERVICE_NAME": "mine"}, "svc")
    assert named is not None and named.endpoint == "http://localhost:4317" and named.service_name == "mine"
    traces = TracingConfig.from_env({**ENDPOINT, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:1234"}, "svc")
    assert traces is not None and traces.collector == ("c", 1234)
    sampled = TracingConfig.from_env({**ENDPOINT, "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                                      "OTEL_TRACES_SAMPLER_ARG": "0.25"}, "svc")
    assert sampled is not None and sampled.sampling_percent == 25.0


@pytest.mark.parametrize("env, names", [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
    ({**ENDPOINT, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "PROTOCOL"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317"}, "not an http:// or https:// URL"),
    ({**ENDPOINT, "OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"),
    ({**ENDPOINT, "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "OTEL_TRACES_SAMPLER_ARG"),
])
def test_a_bad_variable_is_refused_by_name(env: dict[str, str], names: str) -> None:
    with pytest.raises(ValueError, match=names):
        TracingConfig.from_env(env, "svc")


def test_envoy_traces_only_when_the_variables_say_so() -> None:
    off = build_static_resources(DataPlaneConfig().settings({}))
    assert set(off[type_urls.CLUSTER]) == {"workers", "ext_proc"}
    assert not _manager(off).HasField("tracing")

    on = build_static_resources(DataPlaneConfig().settings({**ENDPOINT, "OTEL_TRACES_SAMPLER": "traceidratio",
                                                            "OTEL_TRACES_SAMPLER_ARG": "0.5"}))
    collector = on[type_urls.CLUSTER]["opentelemetry_collector"]
    address = collector.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address
    assert (address.address, address.port_value) == ("127.0.0.1", 4317)
    manager = _manager(on)
    assert manager.tracing.random_sampling.value == 50.0 and manager.tracing.spawn_upstream_span.value
    config = opentelemetry_pb2.OpenTelemetryConfig()
    manager.tracing.provider.typed_config.Unpack(config)
    assert config.grpc_service.envoy_grpc.cluster_name == "opentelemetry_collector"
    assert config.service_name == "inferlb-envoy"
    with pytest.raises(ValueError, match="plaintext"):
        DataPlaneConfig().settings({"OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4317"})


def _manager(resources: dict) -> hcm_pb2.HttpConnectionManager:
    (listener,) = resources[type_urls.LISTENER].values()
    manager = hcm_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(manager)
    return manager


def _logged_app(tracing: Tracing | None = None, **options: object) -> tuple[Starlette, io.StringIO]:
    """An app whose handler logs one line, behind the middleware; the lines go to the returned buffer."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RequestContextFilter())
    handler.setFormatter(logging.Formatter("%(message)s %(request_id)s %(trace_id)s", defaults={
        "request_id": "-", "trace_id": "-"}))
    logger = logging.getLogger(f"test.tracing.{id(out)}")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

    async def route(request: Request) -> JSONResponse:
        logger.info("handled")
        return JSONResponse({})

    app = Starlette(routes=[Route("/work", route)],
                    middleware=[Middleware(RequestContextMiddleware, tracing=tracing, **options)])
    return app, out


def _get(app: Starlette, *headers: dict[str, str]) -> list[httpx.Response]:
    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return [await client.get("/work", headers=h) for h in headers]

    return asyncio.run(scenario())


def test_the_request_id_reaches_the_log_lines_and_the_answer() -> None:
    app, out = _logged_app(generate_id=True, echo_id=True)
    sent, fresh = _get(app, {"x-request-id": "rid-1"}, {})
    assert sent.headers["x-request-id"] == "rid-1" and len(fresh.headers["x-request-id"]) == 36
    lines = out.getvalue().splitlines()
    assert lines == ["handled rid-1 -", f"handled {fresh.headers['x-request-id']} -"]


def test_a_traced_request_is_a_child_of_its_traceparent_and_logs_its_trace_id() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(TracingConfig("http://127.0.0.1:1", "svc"), exporter=exporter)
    app, out = _logged_app(tracing, traced_paths=("/work",))
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    _get(app, {"x-request-id": "rid-2", "traceparent": parent})
    tracing.provider.force_flush()
    (span,) = exporter.get_finished_spans()
    assert format(span.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert span.parent is not None and format(span.parent.span_id, "016x") == "b7ad6b7169203331"
    assert span.attributes["inferlb.request_id"] == "rid-2" and span.attributes["http.response.status_code"] == 200
    assert out.getvalue().splitlines() == ["handled rid-2 0af7651916cd43dd8448eb211c80319c"]
    tracing.shutdown()


def test_a_line_outside_a_request_carries_no_request_id() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    assert RequestContextFilter().filter(record) and not hasattr(record, "request_id")
    token = bind_request(RequestIds("r" * 500, "t"))
    try:
        RequestContextFilter().filter(record)
    finally:
        unbind_request(token)
    assert record.request_id == "r" * 128 and record.trace_id == "t"  # type: ignore[attr-defined]
    assert json.dumps(record.request_id)  # type: ignore[attr-defined]


def test_the_installed_otlp_protos_are_opentelemetry_protos_own() -> None:
    """xds-protos ships an older opentelemetry/proto/* that, unpacked last, broke the OTLP exporter's import
    (no InstrumentationScope) on a fresh clone: the Makefile unpacks opentelemetry-proto again, last."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: F401
    from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope  # noqa: F401
