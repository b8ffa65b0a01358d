"""The resource builders: every field Envoy's behaviour depends on, and deterministic bytes.

No network and no Envoy here; tests/test_envoy_bootstrap.py feeds the same
output to the real binary.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace

import pytest
from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import config_source_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2
from envoy.extensions.access_loggers.filters.cel.v3 import cel_pb2
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from google.protobuf import json_format, struct_pb2
from pydantic import ValidationError

from control_plane import resources, type_urls
from control_plane.resources import endpoints as eds
from control_plane.config import ControlPlaneConfig
from control_plane.model import (
    MAX_WEIGHT,
    DataPlaneSettings,
    Endpoint,
    ExtProcSettings,
    FleetState,
    Health,
    PickPolicySpec,
    Telemetry,
)
from control_plane.resources.listener import cache_fill_mode
from control_plane.resources.struct_wire import encode_struct
from ext_proc.wire import READ_RESPONSE_BODY
from inferlb_runtime.model_routing import Rollout, decode_rollouts, encode_rollouts
from control_plane.resources import (
    build_ext_proc_cluster,
    build_listener,
    build_load_assignment,
    build_resources,
    build_route_configuration,
    build_workers_cluster,
    encode_load_assignment,
    endpoint_metadata,
    quantise,
    weights_of,
)

TELEMETRY = Telemetry(
    observed_at=123.0, cpu_utilization=0.5, latency_mean_s=0.02, latency_p50_s=0.015, latency_p99_s=0.09,
    latency_per_token_s=0.0004, queue_wait_mean_s=0.003, queue_depth=2.0, inflight=3.0, rps=40.0,
    tokens_per_s=5000.0, error_rate=0.01, batch_cost_per_token_s=0.0002, batch_cost_fixed_s=0.004,
)


def fleet(**settings_overrides: object) -> FleetState:
    settings = replace(DataPlaneSettings(), **settings_overrides)  # type: ignore[arg-type]
    return FleetState(
        endpoints=(
            # deliberately unsorted
            Endpoint("127.0.0.1", 8103, health=Health.UNHEALTHY, computed_weight=50),
            Endpoint("127.0.0.1", 8101, health=Health.HEALTHY, computed_weight=200, telemetry=TELEMETRY),
            Endpoint("127.0.0.1", 8102, computed_weight=200, pinned_weight=7, draining=True),
            Endpoint("127.0.0.1", 8104, computed_weight=0),
        ),
        settings=settings,
        pick_policy=PickPolicySpec(name="least_completion_time", params={"alpha": 0.25, "use_queue": True}),
    )


def _unpack(any_message, cls):  # type: ignore[no-untyped-def]
    message = cls()
    assert any_message.Unpack(message), f"expected {cls.DESCRIPTOR.full_name}, got {any_message.type_url}"
    return message


def _hcm(settings: DataPlaneSettings) -> hcm_pb2.HttpConnectionManager:
    listener = build_listener(settings)
    (chain,) = listener.filter_chains
    (network_filter,) = chain.filters
    assert network_filter.name == "envoy.filters.network.http_connection_manager"
    return _unpack(network_filter.typed_config, hcm_pb2.HttpConnectionManager)


def _ext_proc(settings: DataPlaneSettings) -> ext_proc_pb2.ExternalProcessor:
    second = _hcm(settings).http_filters[1]
    assert second.name == "envoy.filters.http.ext_proc"
    return _unpack(second.typed_config, ext_proc_pb2.ExternalProcessor)


def _override_host(cluster: cluster_pb2.Cluster) -> override_host_pb2.OverrideHost:
    (policy,) = cluster.load_balancing_policy.policies
    assert policy.typed_extension_config.name == "envoy.load_balancing_policies.override_host"
    return _unpack(policy.typed_extension_config.typed_config, override_host_pb2.OverrideHost)


def _by_port(state: FleetState, ext_proc: bool = False):  # type: ignore[no-untyped-def]
    cla = build_load_assignment(state, ext_proc=ext_proc)
    (locality,) = cla.endpoints
    return {e.endpoint.address.socket_address.port_value: e for e in locality.lb_endpoints}


def _serialized(resources: dict) -> dict[tuple[str, str], bytes]:
    return {(t, n): m.SerializeToString(deterministic=True) for t, named in resources.items() for n, m in named.items()}


# --- listener ------------------------------------------------------------------------------------

def _comparisons(conditions) -> list[tuple[str, int]]:  # type: ignore[no-untyped-def]
    ops = accesslog_pb2.ComparisonFilter.Op
    return [(ops.Name(c.status_code_filter.comparison.op), c.status_code_filter.comparison.value.default_value)
            for c in conditions]


ENVOYS_OWN = "!response.code_details.startsWith('inferlb_')"  # not ext_proc's own reply (its details prefix)
ENVOYS_EXT_PROC_FILTER = "response.code_details.startsWith('ext_proc_error')"  # Envoy answering for ext_proc


def _mapped(config: hcm_pb2.LocalReplyConfig, expression: str = ENVOYS_OWN) -> dict[tuple, dict]:
    """The local-reply mappers whose CEL condition is ``expression``: their status conditions -> the error
    they answer with."""
    mapped = {}
    for mapper in config.mappers:
        *conditions, cel = mapper.filter.and_filter.filters
        assert cel.extension_filter.name == "envoy.access_loggers.extension_filters.cel"
        found = _unpack(cel.extension_filter.typed_config, cel_pb2.ExpressionFilter).expression
        assert found in (ENVOYS_OWN, ENVOYS_EXT_PROC_FILTER)
        error = json_format.MessageToDict(mapper.body_format_override.json_format)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] is None
        if found == expression:
            mapped[tuple(_comparisons(conditions))] = error
    return mapped


def test_envoys_own_replies_become_openai_errors_and_ext_procs_stay_as_they_are() -> None:
    settings = DataPlaneSettings(ext_proc=ExtProcSettings(max_request_body_bytes=2 * 1024 * 1024))
    config = _hcm(settings).local_reply_config
    assert not config.HasField("body_format")  # a reply no mapper matched (ext_proc's) keeps body and type
    mapped = _mapped(config)
    assert mapped[(("EQ", 413),)] == {"message": "request body is over the limit of 2097152 bytes",
                                       "type": "invalid_request_error", "param": None, "code": "request_too_large"}
    assert mapped[(("EQ", 503),)] == {"message": "%LOCAL_REPLY_BODY%", "type": "server_error", "param": None,
                                       "code": "upstream_unavailable"}  # Envoy's text: "no healthy upstream"
    assert mapped[(("EQ", 504),)]["code"] == "upstream_timeout"
    assert mapped[(("EQ", 404),)]["message"] == "no route for this request"  # Envoy's own text is empty
    # every other status, by class; the specific ones come first (Envoy uses the first mapper that matches)
    assert list(mapped)[-2:] == [(("GE", 400), ("LE", 499)), (("GE", 500),)]
    assert mapped[(("GE", 400), ("LE", 499))]["type"] == "invalid_request_error"
    assert mapped[(("GE", 500),)]["type"] == "server_error"


def test_envoy_answering_for_an_unreachable_or_silent_ext_proc_says_so_first() -> None:
    """Fail closed, Envoy's ext_proc filter answers 504 (a step timed out) or status_on_error (the stream
    failed) with an empty body; those mappers come before the by-status ones, which would keep it empty."""
    config = _hcm(DataPlaneSettings()).local_reply_config
    mapped = _mapped(config, ENVOYS_EXT_PROC_FILTER)
    assert list(mapped) == [(("EQ", 504),), (("GE", 400),)]
    assert mapped[(("EQ", 504),)] == {"message": "the gateway's request processor (ext_proc) did not answer in "
                                                 "time; retry later", "type": "server_error", "param": None,
                                       "code": "gateway_timeout"}
    assert mapped[(("GE", 400),)]["code"] == "gateway_unavailable"
    first_two = [_unpack(m.filter.and_filter.filters[-1].extension_filter.typed_config, cel_pb2.ExpressionFilter)
                 .expression for m in config.mappers[:2]]
    assert first_two == [ENVOYS_EXT_PROC_FILTER] * 2


def test_the_bench_without_a_body_limit_says_so_without_a_number() -> None:
    error = _mapped(resources.build_local_reply_config(None))[(("EQ", 413),)]
    assert error == {"message": "request body is too large", "type": "invalid_request_error", "param": None,
                     "code": "request_too_large"}


def test_the_listener_is_plaintext_unless_a_certificate_and_key_are_named() -> None:
    assert not build_listener(DataPlaneSettings()).filter_chains[0].HasField("transport_socket")
    settings = DataPlaneSettings(listener_tls_cert="/etc/inferlb/tls/cert.pem",
                                 listener_tls_key="/etc/inferlb/tls/key.pem")
    (chain,) = build_listener(settings).filter_chains
    assert chain.transport_socket.name == "envoy.transport_sockets.tls"
    context = _unpack(chain.transport_socket.typed_config, tls_pb2.DownstreamTlsContext)
    (certificate,) = context.common_tls_context.tls_certificates
    assert certificate.certificate_chain.filename == "/etc/inferlb/tls/cert.pem"
    assert certificate.private_key.filename == "/etc/inferlb/tls/key.pem"
    assert list(context.common_tls_context.alpn_protocols) == ["h2", "http/1.1"]
    assert not context.HasField("require_client_certificate")


@pytest.mark.parametrize("data_plane, error", [
    ({"listener_tls_cert": "/etc/tls/cert.pem"}, "go together"),
    ({"listener_tls_key": "/etc/tls/key.pem"}, "go together"),
    ({"listener_tls_cert": "cert.pem", "listener_tls_key": "/etc/tls/key.pem"}, "absolute path"),
])
def test_listener_tls_settings_are_checked(data_plane: dict, error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        ControlPlaneConfig(data_plane=data_plane)


def test_listener_tls_is_refused_with_the_nginx_data_plane() -> None:
    with pytest.raises(ValidationError, match="NGINX data plane does not terminate TLS"):
        ControlPlaneConfig(nginx={"enabled": True}, data_plane={"listener_tls_cert": "/etc/tls/cert.pem",
                                                                "listener_tls_key": "/etc/tls/key.pem"})


def test_listener_address_and_hcm() -> None:
    settings = DataPlaneSettings(listener_address="127.0.0.1", listener_port=10555)
    listener = build_listener(settings)
    assert listener.name == settings.listener_name
    assert listener.address.socket_address.address == "127.0.0.1"
    assert listener.address.socket_address.port_value == 10555

    hcm = _hcm(settings)
    assert hcm.codec_type == hcm_pb2.HttpConnectionManager.AUTO
    assert hcm.stat_prefix
    assert hcm.rds.route_config_name == settings.route_name
    assert hcm.rds.config_source.HasField("ads")
    assert hcm.rds.config_source.resource_api_version == config_source_pb2.V3
    assert hcm.HasField("use_remote_address") and hcm.use_remote_address.value is False
    assert hcm.normalize_path.value is True
    assert hcm.request_timeout.ToTimedelta().total_seconds() == settings.request_timeout_s
    assert hcm.stream_idle_timeout.ToTimedelta().total_seconds() >= settings.request_timeout_s
    assert [f.name for f in hcm.http_filters] == [
        "envoy.filters.http.header_mutation", "envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    strip = _unpack(hcm.http_filters[0].typed_config, header_mutation_pb2.HeaderMutation)
    assert [m.remove for m in strip.mutations.request_mutations] == ["x-gateway-destination-endpoint", "x-inferlb-model"]
    _unpack(hcm.http_filters[2].typed_config, router_pb2.Router)


@pytest.mark.parametrize("fail_open", [True, False])
def test_ext_proc_filter(fail_open: bool) -> None:
    settings = DataPlaneSettings(ext_proc_cluster="picker",
                                 ext_proc=ExtProcSettings(message_timeout_ms=150, failure_mode_allow=fail_open))
    ext = _ext_proc(settings)
    assert ext.grpc_service.envoy_grpc.cluster_name == "picker"
    assert ext.grpc_service.timeout.ToTimedelta().total_seconds() >= settings.request_timeout_s
    assert ext.failure_mode_allow is fail_open
    assert ext.message_timeout.ToMilliseconds() == 150
    # ext_proc may extend one answer's timeout this far (a request waiting in its fair queue).
    assert ext.max_message_timeout.ToMilliseconds() == settings.ext_proc.max_message_timeout_ms == 10_000
    assert ext.status_on_error.code == 503  # failing closed (API keys required): a retryable status
    # ext_proc may ask for one response's body (to fill its gateway cache); the configured modes send none.
    assert ext.allow_mode_override is True
    # and only to ask for that: the very mode ext_proc's answer names (control plane and ext_proc share no code)
    assert list(ext.allowed_override_modes) == [cache_fill_mode()]
    assert pb.ProcessingResponse.FromString(READ_RESPONSE_BODY).mode_override == cache_fill_mode()
    assert ext.processing_mode.response_body_mode == processing_mode_pb2.ProcessingMode.NONE
    assert list(ext.response_attributes) == ["upstream.address"]
    mode = processing_mode_pb2.ProcessingMode
    assert ext.processing_mode == mode(
        request_header_mode=mode.SEND, request_body_mode=mode.BUFFERED, request_trailer_mode=mode.SKIP,
        response_header_mode=mode.SEND, response_body_mode=mode.NONE, response_trailer_mode=mode.SKIP,
    )
    # ext_proc may write the pick into envoy.lb, and only there.
    assert list(ext.metadata_options.receiving_namespaces.untyped) == [settings.pick_metadata_namespace]
    assert ext.route_cache_action == ext_proc_pb2.ExternalProcessor.RETAIN


# --- routes --------------------------------------------------------------------------------------

def test_route_configuration() -> None:
    settings = DataPlaneSettings(retries=3, request_timeout_s=42.5,
                                 ext_proc=ExtProcSettings(max_request_body_bytes=1234567))
    config = build_route_configuration(settings)
    assert config.name == settings.route_name
    (vhost,) = config.virtual_hosts
    assert list(vhost.domains) == ["*"]
    (route,) = vhost.routes
    assert route.match.prefix == "/"
    assert route.route.cluster == settings.workers_cluster
    assert route.route.timeout.ToTimedelta().total_seconds() == 42.5
    retry = route.route.retry_policy
    assert set(retry.retry_on.split(",")) == {"connect-failure", "refused-stream", "reset", "retriable-status-codes"}
    assert list(retry.retriable_status_codes) == [500, 502, 503]  # never 504: a spent budget is not retried
    assert retry.num_retries.value == 3
    assert [p.name for p in retry.retry_host_predicate] == ["envoy.retry_host_predicates.previous_hosts"]
    assert retry.retry_host_predicate[0].typed_config.type_url.endswith("PreviousHostsPredicate")
    assert retry.host_selection_retry_max_attempts == 3
    # The request-body limit that ext_proc BUFFERED mode and retries obey (413 beyond it).
    assert route.request_body_buffer_limit.value == 1234567


# --- clusters ------------------------------------------------------------------------------------

def test_workers_cluster_is_eds_over_ads() -> None:
    settings = DataPlaneSettings(connect_timeout_s=0.25)
    cluster = build_workers_cluster(settings)
    assert cluster.name == settings.workers_cluster
    assert cluster.type == cluster_pb2.Cluster.EDS
    assert cluster.eds_cluster_config.service_name == settings.workers_cluster
    assert cluster.eds_cluster_config.eds_config.HasField("ads")
    assert cluster.eds_cluster_config.eds_config.resource_api_version == config_source_pb2.V3
    assert cluster.connect_timeout.ToMilliseconds() == 250
    assert cluster.ignore_health_on_host_removal  # deregistered hosts leave at once
    # the legacy enum must not compete with load_balancing_policy
    assert cluster.lb_policy == cluster_pb2.Cluster.ROUND_ROBIN and not cluster.HasField("least_request_lb_config")


def test_override_host_sources_and_least_request_fallback() -> None:
    settings = DataPlaneSettings(slow_start_window_s=7.5)
    override = _override_host(build_workers_cluster(settings))
    sources = [(s.header, s.metadata.key, [p.key for p in s.metadata.path]) for s in override.override_host_sources]
    assert sources == [
        ("", "envoy.lb", ["x-gateway-destination-endpoint"]),  # ext_proc's dynamic metadata first
        ("x-gateway-destination-endpoint", "", []),
    ]
    (fallback,) = override.fallback_policy.policies
    assert fallback.typed_extension_config.name == "envoy.load_balancing_policies.least_request"
    least = _unpack(fallback.typed_extension_config.typed_config, least_request_pb2.LeastRequest)
    assert least.choice_count.value == 2
    assert least.slow_start_config.slow_start_window.ToTimedelta().total_seconds() == 7.5


def test_health_check_outlier_detection_and_circuit_breakers() -> None:
    settings = DataPlaneSettings(
        health_check_path="/ready-now", health_check_interval_s=0.5, health_check_timeout_s=0.25,
        unhealthy_threshold=3, healthy_threshold=2, outlier_consecutive_5xx=4, outlier_base_ejection_s=12.0,
        outlier_max_ejection_percent=40, max_connections=11, max_pending_requests=12, max_requests=13, max_retries=14,
    )
    cluster = build_workers_cluster(settings)
    (check,) = cluster.health_checks
    assert check.http_health_check.path == "/ready-now"
    assert check.interval.ToMilliseconds() == 500
    assert check.timeout.ToMilliseconds() == 250
    assert check.no_traffic_interval.ToMilliseconds() == 500  # not Envoy's idle default of 60 s
    assert (check.unhealthy_threshold.value, check.healthy_threshold.value) == (3, 2)

    outlier = cluster.outlier_detection
    assert outlier.consecutive_5xx.value == 4
    assert outlier.base_ejection_time.ToTimedelta().total_seconds() == 12.0
    assert outlier.max_ejection_percent.value == 40

    (thresholds,) = cluster.circuit_breakers.thresholds
    assert (thresholds.max_connections.value, thresholds.max_pending_requests.value,
            thresholds.max_requests.value, thresholds.max_retries.value) == (11, 12, 13, 14)
    assert cluster.common_lb_config.healthy_panic_threshold.value == 0.0


def test_ext_proc_cluster_speaks_http2() -> None:
    settings = DataPlaneSettings(ext_proc_cluster="picker", ext_proc=ExtProcSettings(address="127.0.0.2", port=9555))
    cluster = build_ext_proc_cluster(settings)
    assert cluster.name == "picker"
    assert cluster.type == cluster_pb2.Cluster.STATIC
    assert cluster.connect_timeout.ToTimedelta().total_seconds() == settings.connect_timeout_s
    (locality,) = cluster.load_assignment.endpoints
    (lb_endpoint,) = locality.lb_endpoints
    socket = lb_endpoint.endpoint.address.socket_address
    assert (socket.address, socket.port_value) == ("127.0.0.2", 9555)
    options = _unpack(cluster.typed_extension_protocol_options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"],
                      http_protocol_options_pb2.HttpProtocolOptions)
    assert options.explicit_http_config.HasField("http2_protocol_options")
    # One stream per in-flight request: the breaker must not be Envoy's default 1024.
    assert cluster.circuit_breakers.thresholds[0].max_requests.value == settings.max_requests


def test_ext_proc_cluster_resolves_a_host_name() -> None:
    cluster = build_ext_proc_cluster(DataPlaneSettings(ext_proc=ExtProcSettings(address="ext-proc")))
    assert cluster.type == cluster_pb2.Cluster.STRICT_DNS


def test_ext_proc_disabled_leaves_out_the_filter_and_its_cluster() -> None:
    """Routing on the weights alone: no ext_proc filter or cluster, but a client pick header is still stripped."""
    settings = DataPlaneSettings(ext_proc=ExtProcSettings(enabled=False))
    hcm = _hcm(settings)
    assert [f.name for f in hcm.http_filters] == ["envoy.filters.http.header_mutation", "envoy.filters.http.router"]
    strip = _unpack(hcm.http_filters[0].typed_config, header_mutation_pb2.HeaderMutation)
    assert [m.remove for m in strip.mutations.request_mutations] == [settings.pick_header, "x-inferlb-model"]
    built = build_resources(FleetState(settings=settings))
    assert sorted(built[type_urls.CLUSTER]) == [settings.workers_cluster]
    # The workers cluster is unchanged: the weighted least_request fallback routes every request.
    assert built[type_urls.CLUSTER][settings.workers_cluster] == build_workers_cluster(DataPlaneSettings())


def test_ext_proc_enabled_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from control_plane.config import load_config

    monkeypatch.setenv("INFERLB_CP_DATA_PLANE__EXT_PROC_ENABLED", "false")
    assert load_config().data_plane.settings().ext_proc.enabled is False
    monkeypatch.delenv("INFERLB_CP_DATA_PLANE__EXT_PROC_ENABLED")
    assert load_config().data_plane.settings().ext_proc.enabled is True


# --- endpoints -----------------------------------------------------------------------------------

def test_eds_weights_are_effective_weights() -> None:
    state = fleet()
    cla = build_load_assignment(state)
    assert cla.cluster_name == state.settings.workers_cluster
    assert weights_of(cla) == {e.id: e.effective_weight for e in state.endpoints}
    assert weights_of(cla) == {"127.0.0.1:8101": 200, "127.0.0.1:8102": 7, "127.0.0.1:8103": 50,
                               "127.0.0.1:8104": 1}
    assert min(weights_of(cla).values()) >= 1


def test_weight_is_clamped_never_zero() -> None:
    state = FleetState(endpoints=(Endpoint("10.0.0.1", 1, pinned_weight=0), Endpoint("10.0.0.2", 1, computed_weight=-5),
                                  Endpoint("10.0.0.3", 1, computed_weight=MAX_WEIGHT * 10)))
    assert weights_of(build_load_assignment(state)) == {"10.0.0.1:1": 1, "10.0.0.2:1": 1, "10.0.0.3:1": MAX_WEIGHT}


def test_endpoints_sorted_by_id() -> None:
    (locality,) = build_load_assignment(fleet()).endpoints
    ports = [e.endpoint.address.socket_address.port_value for e in locality.lb_endpoints]
    assert ports == [8101, 8102, 8103, 8104]


def test_health_status_mapping() -> None:
    by_port = _by_port(fleet())
    assert by_port[8101].health_status == health_check_pb2.HEALTHY
    assert by_port[8102].health_status == health_check_pb2.DRAINING
    assert by_port[8103].health_status == health_check_pb2.UNHEALTHY
    assert by_port[8104].health_status == health_check_pb2.UNKNOWN
    # draining wins over unhealthy
    state = FleetState(endpoints=(Endpoint("127.0.0.1", 1, health=Health.UNHEALTHY, draining=True),))
    assert _by_port(state)[1].health_status == health_check_pb2.DRAINING


def test_endpoint_metadata_for_ext_proc() -> None:
    by_port = _by_port(fleet(), ext_proc=True)
    meta = {p: json_format.MessageToDict(e.metadata.filter_metadata["inferlb"]) for p, e in by_port.items()}

    pinned = meta[8102]
    assert pinned == {"id": "127.0.0.1:8102", "weight": 7, "computed_weight": 200, "pinned_weight": 7,
                      "draining": True, "health": "unknown", "models": [], "model_aliases": [], "pool": "default"}

    scraped = meta[8101]
    assert scraped["pinned_weight"] is None and scraped["weight"] == 200 and scraped["health"] == "healthy"
    telemetry = {f.name: getattr(TELEMETRY, f.name) for f in dataclasses.fields(TELEMETRY) if f.name != "observed_at"}
    assert {k: scraped[k] for k in telemetry} == pytest.approx(telemetry)
    assert "observed_at" not in scraped
    assert "cpu_utilization" not in pinned  # never scraped: no figures
    assert meta[8103]["health"] == "unhealthy"


def test_pick_policy_on_the_locality_for_ext_proc() -> None:
    (locality,) = build_load_assignment(fleet(), ext_proc=True).endpoints
    meta = json_format.MessageToDict(locality.metadata.filter_metadata["inferlb"])
    assert meta == {"pick_policy": {"name": "least_completion_time", "params": {"alpha": 0.25, "use_queue": True}},
                    "rollouts": {}}


def test_empty_fleet_still_carries_the_pick_policy() -> None:
    cla = build_load_assignment(FleetState(), ext_proc=True)
    (locality,) = cla.endpoints
    assert not locality.lb_endpoints
    assert locality.metadata.filter_metadata["inferlb"].fields["pick_policy"].struct_value.fields["name"].string_value


@pytest.mark.parametrize("ext_proc", [False, True])
def test_overprovisioning_factor_is_explicit(ext_proc: bool) -> None:
    assert build_load_assignment(fleet(), ext_proc=ext_proc).policy.overprovisioning_factor.value == 100


def test_unserialisable_pick_params_are_rejected() -> None:
    state = replace(fleet(), pick_policy=PickPolicySpec(params={"bad": object()}))
    with pytest.raises(TypeError):
        build_load_assignment(state, ext_proc=True)


def test_envoy_variant_has_no_metadata() -> None:
    """Envoy reads address, health and weight only: no telemetry, no pick policy, no metadata at all."""
    state = fleet()
    (locality,) = build_load_assignment(state).endpoints
    assert not locality.HasField("metadata")
    assert all(not e.HasField("metadata") for e in locality.lb_endpoints)
    rich = build_load_assignment(state, ext_proc=True)
    assert weights_of(build_load_assignment(state)) == weights_of(rich)
    lean_health = {p: e.health_status for p, e in _by_port(state).items()}
    assert lean_health == {p: e.health_status for p, e in _by_port(state, ext_proc=True).items()}


def test_telemetry_changes_only_the_ext_proc_variant() -> None:
    state = fleet()
    endpoints = list(state.endpoints)
    endpoints[1] = replace(endpoints[1], telemetry=replace(TELEMETRY, cpu_utilization=0.75, observed_at=999.0))
    changed = replace(state, endpoints=tuple(endpoints))
    assert encode_load_assignment(changed) == encode_load_assignment(state)
    assert encode_load_assignment(changed, ext_proc=True) != encode_load_assignment(state, ext_proc=True)


def test_telemetry_is_quantised_so_noise_makes_no_new_version() -> None:
    state = fleet()
    endpoints = list(state.endpoints)
    noisy = replace(TELEMETRY, cpu_utilization=0.5000004, rps=40.01, tokens_per_s=5001.0, latency_p99_s=0.09004)
    endpoints[1] = replace(endpoints[1], telemetry=noisy)
    assert encode_load_assignment(replace(state, endpoints=tuple(endpoints)), ext_proc=True) == \
        encode_load_assignment(state, ext_proc=True)
    meta = endpoint_metadata(endpoints[1])
    assert (meta["cpu_utilization"], meta["rps"], meta["tokens_per_s"]) == (0.5, 40.0, 5000.0)
    assert quantise(123456.0) == 123000.0 and quantise(0.00123456) == 0.00123 and quantise(-1.2345) == -1.23
    assert quantise(0.0) == 0.0 and math.isinf(quantise(math.inf))


@pytest.mark.parametrize("ext_proc", [False, True])
def test_encoded_bytes_are_canonical_protobuf(ext_proc: bool) -> None:
    """The hand-assembled bytes are exactly what protobuf's deterministic serialisation gives."""
    state = fleet()
    endpoints = [*state.endpoints, Endpoint("::1", 9, health=Health.HEALTHY, telemetry=replace(TELEMETRY, rps=1e21)),
                 Endpoint("worker-" + "x" * 200, 65535, computed_weight=MAX_WEIGHT,
                          telemetry=replace(TELEMETRY, inflight=-0.0, error_rate=1 / 3))]
    state = replace(state, endpoints=tuple(endpoints),
                    pick_policy=PickPolicySpec(name="ü", params={"n": None, "l": [1, "a", [], {}], "s": {"t": False}}))
    data = encode_load_assignment(state, ext_proc=ext_proc)
    assert endpoint_pb2.ClusterLoadAssignment.FromString(data).SerializeToString(deterministic=True) == data
    assert build_load_assignment(state, ext_proc=ext_proc).SerializeToString(deterministic=True) == data


@pytest.mark.parametrize("value", [
    {}, {"a": 1}, {"": ""}, {"b": True, "a": False, "c": None}, {"x": -0.5, "y": 1e300, "z": 2**40},
    {"nested": {"deep": {"list": [1, "two", None, True, {"k": []}]}}}, {"ü": "ßñ", "long": "v" * 300},
])
def test_struct_encoder_matches_protobuf(value: dict) -> None:
    expected = struct_pb2.Struct()
    expected.update(value)
    assert encode_struct(value) == expected.SerializeToString(deterministic=True)


def test_struct_encoder_sorts_keys_lexicographically() -> None:
    """Where one key is a prefix of another, upb puts the longer first; the encoder (like C++
    protobuf) puts the shorter first: the same Struct either way, and always the same bytes."""
    value = {str(i): i for i in range(50)} | {"a": 1, "ab": 2, "aaa": 3}
    encoded = encode_struct(value)
    assert json_format.MessageToDict(struct_pb2.Struct.FromString(encoded)) == value
    assert encode_struct(dict(reversed(value.items()))) == encoded
    assert _struct_keys_in_wire_order(encoded) == sorted(value)


def _struct_keys_in_wire_order(data: bytes) -> list[str]:
    keys, i = [], 0
    while i < len(data):
        assert data[i] == 0x0A
        length, i = data[i + 1], i + 2  # every entry here is shorter than 128 bytes
        entry = data[i:i + length]
        assert entry[0] == 0x0A
        keys.append(entry[2:2 + entry[1]].decode())
        i += length
    return keys


def test_caches_do_not_change_the_bytes() -> None:
    state = fleet()
    warm = [encode_load_assignment(state, ext_proc=x) for x in (False, True)]
    memos = [resources.EndpointMemo(), resources.EndpointMemo()]
    assert [encode_load_assignment(state, ext_proc=x, memo=m) for x, m in zip((False, True), memos)] == warm
    assert [encode_load_assignment(state, ext_proc=x, memo=m) for x, m in zip((False, True), memos)] == warm
    endpoints = list(state.endpoints)
    endpoints[0] = replace(endpoints[0], computed_weight=77, telemetry=TELEMETRY)
    changed = replace(state, endpoints=tuple(endpoints))
    assert [encode_load_assignment(changed, ext_proc=x, memo=m) for x, m in zip((False, True), memos)] == \
        [encode_load_assignment(changed, ext_proc=x) for x in (False, True)]
    for cached in (eds._lean_entry, eds._lb_address):
        cached.cache_clear()
    assert [encode_load_assignment(state, ext_proc=x) for x in (False, True)] == warm


def test_the_memo_keeps_only_what_the_last_build_used() -> None:
    """Telemetry and computed weights take new values at every scrape: the memo's parts follow the fleet's
    size, not the number of scrapes (an LRU over past values grew the control plane's RSS in the soak)."""
    state = fleet()
    memo = resources.EndpointMemo()
    for scrape in range(50):
        endpoints = tuple(replace(e, computed_weight=10 + scrape, telemetry=replace(TELEMETRY, rps=float(scrape)))
                          for e in state.endpoints)
        changed = replace(state, endpoints=endpoints)
        assert encode_load_assignment(changed, ext_proc=True, memo=memo) == encode_load_assignment(changed, ext_proc=True)
        parts = memo._parts
        assert len(parts.base) <= len(endpoints) and len(parts.telemetry) <= len(endpoints)
    # an unchanged endpoint keeps its parts; a weight-only change then reuses its telemetry runs
    assert encode_load_assignment(changed, ext_proc=True, memo=memo) == encode_load_assignment(changed, ext_proc=True)
    kept = dict(memo._parts.telemetry)
    assert kept
    reweighted = replace(changed, endpoints=tuple(replace(e, computed_weight=99) for e in changed.endpoints))
    assert encode_load_assignment(reweighted, ext_proc=True, memo=memo) == \
        encode_load_assignment(reweighted, ext_proc=True)
    assert all(memo._parts.telemetry[text] is runs for text, runs in kept.items())


# --- the snapshot --------------------------------------------------------------------------------

@pytest.mark.parametrize("ext_proc", [False, True])
def test_build_resources_keys(ext_proc: bool) -> None:
    state = fleet()
    s = state.settings
    built = build_resources(state, ext_proc=ext_proc)
    assert {t: sorted(named) for t, named in built.items()} == {
        type_urls.CLUSTER: sorted([s.workers_cluster, s.ext_proc_cluster]),
        type_urls.ENDPOINT: [s.workers_cluster],
        type_urls.LISTENER: [s.listener_name],
        type_urls.ROUTE: [s.route_name],
    }
    for type_url, named in built.items():
        for message in named.values():
            assert type_url == f"type.googleapis.com/{message.DESCRIPTOR.full_name}"


@pytest.mark.parametrize("ext_proc", [False, True])
def test_deterministic_bytes(ext_proc: bool) -> None:
    state = fleet()
    first = _serialized(build_resources(state, ext_proc=ext_proc))
    # the same state built again, endpoints in another order, params in another order
    shuffled = replace(state, endpoints=tuple(reversed(state.endpoints)),
                       pick_policy=PickPolicySpec(name="least_completion_time",
                                                  params={"use_queue": True, "alpha": 0.25}))
    assert _serialized(build_resources(state, ext_proc=ext_proc)) == first
    assert _serialized(build_resources(shuffled, ext_proc=ext_proc)) == first


@pytest.mark.parametrize("ext_proc", [False, True])
def test_a_weight_change_only_changes_the_load_assignment(ext_proc: bool) -> None:
    state = fleet()
    endpoints = list(state.endpoints)
    endpoints[1] = replace(endpoints[1], computed_weight=321)
    before = _serialized(build_resources(state, ext_proc=ext_proc))
    after = _serialized(build_resources(replace(state, endpoints=tuple(endpoints)), ext_proc=ext_proc))
    changed = {key for key in before if before[key] != after[key]}
    assert changed == {(type_urls.ENDPOINT, state.settings.workers_cluster)}


def test_variants_share_everything_but_the_load_assignment() -> None:
    lean, rich = (_serialized(build_resources(fleet(), ext_proc=x)) for x in (False, True))
    assert {key for key in lean if lean[key] != rich[key]} == {(type_urls.ENDPOINT, "workers")}


def test_the_rich_eds_lists_the_ext_proc_replicas_sorted_and_the_lean_one_never() -> None:
    (locality,) = build_load_assignment(fleet(), ext_proc=True, replicas=("ext-proc-b", "ext-proc-a")).endpoints
    meta = json_format.MessageToDict(locality.metadata.filter_metadata["inferlb"])
    assert meta["ext_proc_replicas"] == ["ext-proc-a", "ext-proc-b"]
    assert meta["pick_policy"]["name"] == "least_completion_time"
    (lean,) = build_load_assignment(fleet(), replicas=("ext-proc-a",)).endpoints
    assert not lean.HasField("metadata")
    (none,) = build_load_assignment(fleet(), ext_proc=True).endpoints
    assert "ext_proc_replicas" not in none.metadata.filter_metadata["inferlb"].fields


# --- models, pools and rollouts (issue 15) ---------------------------------------------------------------

INT8, FP32, FAMILY = "all-MiniLM-L6-v2-int8", "all-MiniLM-L6-v2-fp32", "all-MiniLM-L6-v2"
CANARY = Rollout(FAMILY, ((INT8, 90.0), (FP32, 10.0)), "api_key")
BLUE_GREEN = Rollout("embed", ((FP32, 100.0),))


def _with_models(state: FleetState) -> FleetState:
    """``state`` whose workers serve versions (one serves nothing it declares) in two pools, with rollouts."""
    served = [dict(models=(FP32, INT8), model_aliases=(FAMILY, "sentence-transformers/" + FAMILY)),
              dict(models=(INT8,), model_aliases=(FAMILY,), pool="cpu-small"), {}, dict(models=(FP32,))]
    endpoints = tuple(replace(e, **changes) for e, changes in zip(state.endpoints, served))  # type: ignore[arg-type]
    return replace(state, endpoints=endpoints, rollouts=(CANARY, BLUE_GREEN))


def test_the_rich_eds_says_what_each_endpoint_serves_and_carries_the_rollouts() -> None:
    state = _with_models(fleet())
    meta = {p: json_format.MessageToDict(e.metadata.filter_metadata["inferlb"])
            for p, e in _by_port(state, ext_proc=True).items()}
    assert {p: (m["models"], m["model_aliases"], m["pool"]) for p, m in meta.items()} == {
        8103: ([FP32, INT8], [FAMILY, "sentence-transformers/" + FAMILY], "default"),
        8101: ([INT8], [FAMILY], "cpu-small"),
        8102: ([], [], "default"),
        8104: ([FP32], [], "default"),
    }
    assert meta[8101]["cpu_utilization"] == pytest.approx(TELEMETRY.cpu_utilization)  # telemetry still there
    assert all(endpoint_metadata(e) == meta[e.port] for e in state.endpoints if e.telemetry is None)
    (locality,) = build_load_assignment(state, ext_proc=True).endpoints
    rollouts = json_format.MessageToDict(locality.metadata.filter_metadata["inferlb"])["rollouts"]
    assert rollouts == encode_rollouts([BLUE_GREEN, CANARY])
    assert decode_rollouts(rollouts) == {FAMILY: CANARY, "embed": BLUE_GREEN}


def test_models_and_rollouts_leave_the_envoys_eds_byte_for_byte_as_it_was() -> None:
    state = fleet()
    assert encode_load_assignment(_with_models(state)) == encode_load_assignment(state)
    assert _serialized(build_resources(_with_models(state))) == _serialized(build_resources(state))
    assert encode_load_assignment(_with_models(state), ext_proc=True) != encode_load_assignment(state, ext_proc=True)


def test_the_rich_eds_with_models_is_canonical_and_deterministic() -> None:
    state = _with_models(fleet())
    data = encode_load_assignment(state, ext_proc=True)
    assert endpoint_pb2.ClusterLoadAssignment.FromString(data).SerializeToString(deterministic=True) == data
    memo = resources.EndpointMemo()
    assert encode_load_assignment(state, ext_proc=True, memo=memo) == data
    assert encode_load_assignment(state, ext_proc=True, memo=memo) == data
    shuffled = replace(state, endpoints=tuple(reversed(state.endpoints)), rollouts=tuple(reversed(state.rollouts)))
    assert encode_load_assignment(shuffled, ext_proc=True) == data


def test_a_change_of_models_or_rollouts_makes_a_new_rich_eds_even_through_the_memo() -> None:
    state = _with_models(fleet())
    memo = resources.EndpointMemo()
    before = encode_load_assignment(state, ext_proc=True, memo=memo)
    endpoints = list(state.endpoints)
    endpoints[2] = replace(endpoints[2], models=(INT8,))
    changed = replace(state, endpoints=tuple(endpoints))
    after = encode_load_assignment(changed, ext_proc=True, memo=memo)
    assert after != before and after == encode_load_assignment(changed, ext_proc=True)
    rolled_back = replace(state, rollouts=(Rollout(FAMILY, ((INT8, 100.0),)), BLUE_GREEN))
    assert encode_load_assignment(rolled_back, ext_proc=True, memo=memo) != before
    assert encode_load_assignment(rolled_back, ext_proc=True, memo=memo) == \
        encode_load_assignment(rolled_back, ext_proc=True)


def test_envoy_writes_one_json_access_log_line_per_request_keyed_by_request_id() -> None:
    from envoy.extensions.access_loggers.stream.v3 import stream_pb2

    (log,) = _hcm(DataPlaneSettings()).access_log
    assert log.name == "envoy.access_loggers.stdout"
    stdout = stream_pb2.StdoutAccessLog()
    log.typed_config.Unpack(stdout)
    fields = json_format.MessageToDict(stdout.log_format.json_format)
    assert fields["request_id"] == "%REQ(X-REQUEST-ID)%" and fields["component"] == "envoy"
    assert {"status", "upstream", "duration_ms", "trace_id", "cache"} <= set(fields)
    assert not _hcm(DataPlaneSettings(access_log=False)).access_log  # envoy_access_log = false
    assert ControlPlaneConfig().data_plane.settings({}).access_log is True
