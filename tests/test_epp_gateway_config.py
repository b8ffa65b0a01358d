"""The GIE-style gateway bootstrap (``control_plane.resources.epp_gateway``) without a network: what the
Endpoint Picker Protocol needs from Envoy's configuration. Envoy runs it in ``test_epp_gateway_envoy``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2
from envoy.type.metadata.v3 import metadata_pb2
from google.protobuf.unknown_fields import UnknownFieldSet

from control_plane.resources.epp_gateway import (
    EppGateway,
    build_bootstrap,
    build_override_host_policy,
    build_pool_cluster,
    to_dict,
    to_yaml,
)

from .conftest import ROOT

MODE = processing_mode_pb2.ProcessingMode


def filters(gateway: EppGateway) -> dict[str, object]:
    listener = build_bootstrap(gateway).static_resources.listeners[0]
    manager = hcm_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(manager)
    return {f.name: f.typed_config for f in manager.http_filters}


def test_ext_proc_is_full_duplex_with_the_protocols_metadata() -> None:
    packed = filters(EppGateway(8081, 9002, 19000, endpoints=("10.0.0.1:8000",)))["envoy.filters.http.ext_proc"]
    config = ext_proc_pb2.ExternalProcessor()
    packed.Unpack(config)
    mode = config.processing_mode
    assert (mode.request_body_mode, mode.response_body_mode) == (MODE.FULL_DUPLEX_STREAMED, MODE.FULL_DUPLEX_STREAMED)
    assert (mode.request_trailer_mode, mode.response_trailer_mode) == (MODE.SEND, MODE.SEND)  # the mode needs it
    assert set(config.metadata_options.forwarding_namespaces.untyped) == {"envoy.lb.subset_hint", "envoy.lb"}
    assert list(config.metadata_options.receiving_namespaces.untyped) == ["envoy.lb"]
    assert not config.failure_mode_allow  # FailClose unless asked
    assert config.status_on_error.code == 503


def test_filter_order_strips_the_pick_header_first() -> None:
    names = list(filters(EppGateway(8081, 9002, 19000, cluster="original_dst", subset_from_header=True)))
    assert names == ["envoy.filters.http.header_mutation", "envoy.filters.http.header_to_metadata",
                     "envoy.filters.http.ext_proc", "envoy.filters.http.router"]


def test_original_dst_pool_reads_the_pick_header() -> None:
    cluster = build_pool_cluster(EppGateway(8081, 9002, 19000, cluster="original_dst"))
    assert cluster.type == cluster.ORIGINAL_DST and cluster.lb_policy == cluster.CLUSTER_PROVIDED
    assert cluster.original_dst_lb_config.use_http_header
    assert cluster.original_dst_lb_config.http_header_name == "x-gateway-destination-endpoint"


def test_override_host_pool_lists_the_endpoints_and_reports_the_served_one() -> None:
    cluster = build_pool_cluster(EppGateway(8081, 9002, 19000, endpoints=("10.0.0.1:8000", "[2001:db8::2]:8001")))
    addresses = [(e.endpoint.address.socket_address.address, e.endpoint.address.socket_address.port_value)
                 for e in cluster.load_assignment.endpoints[0].lb_endpoints]
    assert addresses == [("10.0.0.1", 8000), ("2001:db8::2", 8001)]
    policy = build_override_host_policy().policies[0].typed_extension_config
    assert policy.name == "envoy.load_balancing_policies.override_host"
    override = override_host_pb2.OverrideHost()
    policy.typed_config.Unpack(override)
    sources = [(s.header, s.metadata.key) for s in override.override_host_sources]
    assert sources == [("x-gateway-destination-endpoint", ""), ("", "envoy.lb")]
    # selected_host_key (field 2): in the packed bytes for Envoy, though the Python protos do not name it.
    (field,) = [f for f in UnknownFieldSet(override) if f.field_number == 2]
    served = metadata_pb2.MetadataKey.FromString(field.data)
    assert served.key == "envoy.lb" and served.path[0].key == "x-gateway-destination-endpoint-served"


def test_yaml_carries_selected_host_key_and_is_deterministic() -> None:
    gateway = EppGateway(8081, 9002, 19000, endpoints=("10.0.0.1:8000",))
    document = yaml.safe_load(to_yaml(gateway))
    assert document == to_dict(gateway) and to_yaml(gateway) == to_yaml(gateway)
    (pool,) = [c for c in document["static_resources"]["clusters"] if c["name"] == "pool"]
    typed = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]["typed_config"]
    assert typed["selected_host_key"] == {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint-served"}]}


@pytest.mark.subprocess
def test_bad_input_is_refused_with_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="endpoints"):
        build_pool_cluster(EppGateway(8081, 9002, 19000))
    with pytest.raises(ValueError, match="ip:port"):
        build_pool_cluster(EppGateway(8081, 9002, 19000, endpoints=("worker-1:8000",)))
    cli = subprocess.run([sys.executable, "-m", "control_plane.resources.epp_gateway", "--endpoint", "nope"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert cli.returncode == 2 and "ip:port" in cli.stderr
    helped = subprocess.run([sys.executable, "-m", "control_plane.resources.epp_gateway", "--help"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "endpoint picker" in helped.stdout
