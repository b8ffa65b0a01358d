"""OpenTelemetry tracing, set up only from the standard ``OTEL_*`` environment variables, and off unless they ask.

Why so: operators already run collectors configured this way, and one set of variables given to ``inferlb up``
(or a pod) turns tracing on for every component alike. Off by default because ext_proc's decisions per
CPU-second is a tracked figure: with nothing set there is no provider, no exporter and no thread, and a
service holds ``None`` where a :class:`Tracing` would be, so the hot path pays one ``is None`` test.

On when ``OTEL_TRACES_EXPORTER`` names ``otlp``, or when it is unset and an OTLP endpoint
(``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``) is; ``OTEL_SDK_DISABLED=true`` or
``OTEL_TRACES_EXPORTER=none`` keep it off. Export is OTLP over gRPC through a BatchSpanProcessor: ending a
span only queues it, and a thread of the SDK's exports, so the event loop never waits on a collector. Trace
context crosses processes as W3C ``traceparent`` (:meth:`Tracing.extract`, :meth:`Tracing.traceparent`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("inferlb.tracing")

TRACEPARENT_HEADER = "traceparent"
REQUEST_ID_HEADER = "x-request-id"  # Envoy generates it (and passes a client's on)
DEFAULT_OTLP_ENDPOINT = "http://localhost:4317"  # the OTLP/gRPC default of the specification
OTLP_GRPC_PORT = 4317
_SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
             "parentbased_traceidratio")
_PROPAGATOR = TraceContextTextMapPropagator()  # stateless


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() == "true"


@dataclass(frozen=True)
class TracingConfig:
    """What the ``OTEL_*`` variables say, checked: where spans go, the service's name and the sampling."""

    endpoint: str  # an OTLP/gRPC URL, http:// (plaintext) or https://
    service_name: str
    sampler: str = "parentbased_always_on"  # the SDK's default
    ratio: float = 1.0  # for the traceidratio samplers

    @classmethod
    def from_env(cls, env: Mapping[str, str], default_service: str) -> "TracingConfig | None":
        """The config, or None when tracing is off. ValueError names the variable that is wrong."""
        if _flag(env, "OTEL_SDK_DISABLED"):
            return None
        endpoint = (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "").strip()
        exporters = env.get("OTEL_TRACES_EXPORTER")
        if exporters is not None and exporters.strip():
            names = {name.strip().lower() for name in exporters.split(",") if name.strip()}
            unknown = names - {"otlp", "none"}
            if unknown:
                raise ValueError(f"OTEL_TRACES_EXPORTER={exporters!r}: only 'otlp' (OTLP over gRPC) and 'none' "
                                 f"are supported, not {', '.join(sorted(unknown))}")
            if "otlp" not in names:
                return None
        elif not endpoint:
            return None  # nothing asked for tracing
        protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
        if protocol.strip().lower() != "grpc":
            raise ValueError(f"OTEL_EXPORTER_OTLP(_TRACES)_PROTOCOL={protocol!r}: spans are exported over OTLP/gRPC "
                             "only; set it to 'grpc' (port 4317 on a collector) or unset it")
        endpoint = endpoint or DEFAULT_OTLP_ENDPOINT
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"OTLP endpoint {endpoint!r} is not an http:// or https:// URL with a host "
                             "(e.g. http://collector:4317)")
        try:
            parts.port
        except ValueError as exc:
            raise ValueError(f"OTLP endpoint {endpoint!r}: {exc}") from None
        sampler = (env.get("OTEL_TRACES_SAMPLER") or "parentbased_always_on").strip().lower()
        if sampler not in _SAMPLERS:
            raise ValueError(f"OTEL_TRACES_SAMPLER={sampler!r} is not one of {', '.join(_SAMPLERS)}")
        ratio = 1.0
        if sampler.endswith("traceidratio"):
            raw = env.get("OTEL_TRACES_SAMPLER_ARG", "1.0")
            try:
                ratio = float(raw)
            except ValueError:
                ratio = -1.0
            if not 0.0 <= ratio <= 1.0:
                raise ValueError(f"OTEL_TRACES_SAMPLER_ARG={raw!r} is not a ratio between 0 and 1")
        return cls(endpoint, (env.get("OTEL_SERVICE_NAME") or "").strip() or default_service, sampler, ratio)

    @property
    def collector(self) -> tuple[str, int]:
        """The collector's (host, port), for a data plane that needs a cluster for it (Envoy)."""
        parts = urlsplit(self.endpoint)
        return parts.hostname or "", parts.port or OTLP_GRPC_PORT

    @property
    def sampling_percent(self) -> float:
        """The share of new traces sampled, 0..100 (what Envoy's ``random_sampling`` takes)."""
        if self.sampler.endswith("always_off"):
            return 0.0
        return self.ratio * 100.0 if self.sampler.endswith("traceidratio") else 100.0

    def build_sampler(self) -> Sampler:
        root: Sampler = {"always_on": ALWAYS_ON, "always_off": ALWAYS_OFF}.get(
            self.sampler.removeprefix("parentbased_"), None) or TraceIdRatioBased(self.ratio)
        return ParentBased(root) if self.sampler.startswith("parentbased_") else root


class Tracing:
    """A tracer provider with its exporter: what a service holds while tracing is on."""

    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None,
                 schedule_delay_ms: float | None = None) -> None:
        """``exporter``: the OTLP/gRPC exporter to ``config.endpoint`` unless given (tests give an in-memory
        one). The batch processor's other knobs (``OTEL_BSP_*``) are the SDK's own."""
        self.config = config
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=config.endpoint, insecure=config.endpoint.startswith("http://"))
        # Resource.create adds OTEL_RESOURCE_ATTRIBUTES; the name given here is the one that was checked.
        self.provider = TracerProvider(sampler=config.build_sampler(), shutdown_on_exit=False,
                                       resource=Resource.create({"service.name": config.service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=schedule_delay_ms))
        self.tracer = self.provider.get_tracer("inferlb")

    @staticmethod
    def extract(carrier: Mapping[str, str]) -> Context:
        """The context a W3C ``traceparent`` (and ``tracestate``) in ``carrier`` names; empty without one."""
        return _PROPAGATOR.extract(carrier)

    @staticmethod
    def traceparent(span: trace.Span) -> str | None:
        """The ``traceparent`` value that makes a callee's span a child of ``span``."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return carrier.get(TRACEPARENT_HEADER)

    def shutdown(self) -> None:
        """Export what is queued (bounded by the exporter's timeout) and stop: on the service's way out."""
        try:
            self.provider.force_flush(5_000)
            self.provider.shutdown()
        except Exception:  # a collector gone at exit must not turn a clean stop into a crash
            log.warning("tracing: flushing spans at shutdown failed", exc_info=True)


def trace_id_of(span: trace.Span) -> str | None:
    """The span's trace id as the 32 hex digits a collector shows, or None for a non-recording span."""
    context = span.get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


def start_tracing(config: TracingConfig | None) -> Tracing | None:
    """Tracing as :meth:`TracingConfig.from_env` found it (checked before logging was set up), or None (off)."""
    if config is None:
        return None
    tracing = Tracing(config)
    log.info("tracing on", extra={"otlp_endpoint": config.endpoint, "service_name": config.service_name,
                                  "sampler": config.sampler, "ratio": config.ratio})
    return tracing
