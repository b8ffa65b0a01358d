"""An Envoy configured the way the Gateway API Inference Extension's reference gateways are, with inferlb's
ext_proc as its endpoint picker (EPP): a static bootstrap, built from an :class:`EppGateway`.

Why a separate builder: inferlb's own data plane (``listener``, ``clusters``) is fed over ADS by the control
plane and uses BUFFERED ext_proc. A GIE gateway (Envoy Gateway, Istio, kgateway, ...) is configured by its own
controller from an InferencePool: ext_proc in FULL_DUPLEX_STREAMED, the pick read from the
``x-gateway-destination-endpoint`` header or the ``envoy.lb`` metadata, and no inferlb control plane in
Envoy's path. This is that configuration, as a pure function, so that the compatibility tests run a real Envoy
on it and docs/epp.md can print it (``python -m control_plane.resources.epp_gateway``).

The pool's cluster comes in the two shapes GIE's gateways use:

* ``original_dst``: an ORIGINAL_DST cluster with ``use_http_header`` (GIE's test gateway). Envoy dials the
  address in the header, so the EPP must name exactly one endpoint (``fallbacks = 0``); there is no fallback
  walk and no served-endpoint report.
* ``override_host``: the pool's endpoints with the override_host load balancing policy. Envoy walks the
  comma-separated list in order on each retry, reports the host it chose in ``envoy.lb`` /
  ``x-gateway-destination-endpoint-served`` (``selected_host_key``), and when the EPP named none (it failed
  open) load-balances by itself (round robin).

``selected_host_key`` is in Envoy 1.40 but not in the Python protos (xds-protos) yet: it is written into the
packed policy from its field number, and put back into the YAML rendering by :func:`to_yaml`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml
from google.protobuf import json_format

from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import address_pb2, extension_pb2, grpc_service_pb2, protocol_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2
from envoy.extensions.filters.http.header_to_metadata.v3 import header_to_metadata_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2
from envoy.extensions.load_balancing_policies.round_robin.v3 import round_robin_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.metadata.v3 import metadata_pb2
from envoy.type.v3 import http_status_pb2

from inferlb_runtime.hostport import id_of_authority
from inferlb_runtime.protowire import len_field, varint

from .clusters import HTTP_PROTOCOL_OPTIONS_KEY, OVERRIDE_HOST_POLICY
from .listener import EXT_PROC_FILTER, HCM_FILTER, ROUTER_FILTER, STRIP_PICK_FILTER
from .messages import duration, pack, socket_address

PICK_HEADER = "x-gateway-destination-endpoint"
PICK_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
POOL_CLUSTER = "pool"
EPP_CLUSTER = "epp"
SUBSET_FILTER = "envoy.filters.http.header_to_metadata"
ROUND_ROBIN_POLICY = "envoy.load_balancing_policies.round_robin"
# override_host's selected_host_key (a MetadataKey): Envoy 1.40 reads it, the Python protos predate it.
_SELECTED_HOST_KEY_FIELD = 2


@dataclass(frozen=True)
class EppGateway:
    """What the gateway needs to know: where it listens, where the EPP is, the pool's endpoints (``ip:port``;
    only the ``override_host`` cluster lists them) and how it treats the EPP."""

    listener_port: int
    epp_port: int
    admin_port: int
    cluster: Literal["original_dst", "override_host"] = "override_host"
    endpoints: tuple[str, ...] = ()
    listener_address: str = "127.0.0.1"
    epp_address: str = "127.0.0.1"
    # InferencePool's endpointPickerRef.failureMode: FailOpen routes by Envoy's own balancing when the EPP
    # cannot answer; FailClose answers 503 (GIE's default).
    fail_open: bool = False
    # Envoy waits this long for each EPP answer; in FULL_DUPLEX_STREAMED the headers' answer waits for the
    # whole body, and a wait in inferlb's fair queue, so it is long (GIE's gateways use 1000 s).
    message_timeout_s: float = 60.0
    request_timeout_s: float = 60.0
    # Retries of a request that could not reach its endpoint (connect failure, reset): each one takes the next
    # endpoint of the EPP's list (override_host).
    retries: int = 2
    # Test harness only: copy a request header of the subset key's name into the subset hint metadata, the
    # way a gateway's own filter would set it. A client must never choose its own subset in production.
    subset_from_header: bool = False
    # Headers removed from every request before the EPP sees it (only the EPP chooses endpoints).
    strip_headers: tuple[str, ...] = field(default=(PICK_HEADER,))


def _metadata_key(namespace: str, key: str) -> metadata_pb2.MetadataKey:
    return metadata_pb2.MetadataKey(key=namespace, path=[metadata_pb2.MetadataKey.PathSegment(key=key)])


def build_ext_proc_filter(gateway: EppGateway) -> ext_proc_pb2.ExternalProcessor:
    """The EPP's filter as the protocol asks: both bodies FULL_DUPLEX_STREAMED (trailers SEND, which that mode
    requires), the subset hint and the served endpoint forwarded, the pick's metadata accepted."""
    mode = processing_mode_pb2.ProcessingMode
    return ext_proc_pb2.ExternalProcessor(
        grpc_service=grpc_service_pb2.GrpcService(
            envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=EPP_CLUSTER),
            timeout=duration(gateway.request_timeout_s),
        ),
        failure_mode_allow=gateway.fail_open,
        # FailClose answers 503 (clients retry it), not Envoy's default 500.
        status_on_error=http_status_pb2.HttpStatus(code=http_status_pb2.ServiceUnavailable),
        message_timeout=duration(gateway.message_timeout_s),
        max_message_timeout=duration(gateway.message_timeout_s),
        processing_mode=mode(
            request_header_mode=mode.SEND, response_header_mode=mode.SEND,
            request_body_mode=mode.FULL_DUPLEX_STREAMED, response_body_mode=mode.FULL_DUPLEX_STREAMED,
            request_trailer_mode=mode.SEND, response_trailer_mode=mode.SEND,
        ),
        metadata_options=ext_proc_pb2.MetadataOptions(
            forwarding_namespaces=ext_proc_pb2.MetadataOptions.MetadataNamespaces(
                untyped=[SUBSET_NAMESPACE, PICK_NAMESPACE]),
            receiving_namespaces=ext_proc_pb2.MetadataOptions.MetadataNamespaces(untyped=[PICK_NAMESPACE]),
        ),
        route_cache_action=ext_proc_pb2.ExternalProcessor.RETAIN,
    )


def build_subset_filter() -> header_to_metadata_pb2.Config:
    """Test harness: the request header ``x-gateway-destination-endpoint-subset`` as the subset hint."""
    rule = header_to_metadata_pb2.Config.Rule(
        header=SUBSET_KEY, remove=True,
        on_header_present=header_to_metadata_pb2.Config.KeyValuePair(
            metadata_namespace=SUBSET_NAMESPACE, key=SUBSET_KEY, type=header_to_metadata_pb2.Config.STRING),
    )
    return header_to_metadata_pb2.Config(request_rules=[rule])


def build_listener(gateway: EppGateway) -> listener_pb2.Listener:
    """One route to the pool (retried on connect failures and resets: override_host's fallback walk), the EPP's
    ext_proc before the router, a client's pick header dropped first."""
    retry = route_components_pb2.RetryPolicy(retry_on="connect-failure,refused-stream,reset")
    retry.num_retries.value = gateway.retries
    route = route_components_pb2.Route(
        match=route_components_pb2.RouteMatch(prefix="/"),
        route=route_components_pb2.RouteAction(cluster=POOL_CLUSTER, timeout=duration(gateway.request_timeout_s),
                                               retry_policy=retry),
    )
    strip = header_mutation_pb2.HeaderMutation(mutations=header_mutation_pb2.Mutations(
        request_mutations=[mutation_rules_pb2.HeaderMutation(remove=h) for h in gateway.strip_headers]))
    filters = [hcm_pb2.HttpFilter(name=STRIP_PICK_FILTER, typed_config=pack(strip))]
    if gateway.subset_from_header:
        filters.append(hcm_pb2.HttpFilter(name=SUBSET_FILTER, typed_config=pack(build_subset_filter())))
    filters += [hcm_pb2.HttpFilter(name=EXT_PROC_FILTER, typed_config=pack(build_ext_proc_filter(gateway))),
                hcm_pb2.HttpFilter(name=ROUTER_FILTER, typed_config=pack(router_pb2.Router()))]
    manager = hcm_pb2.HttpConnectionManager(
        stat_prefix="epp_gateway",
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        route_config=route_pb2.RouteConfiguration(name="pool", virtual_hosts=[
            route_components_pb2.VirtualHost(name="pool", domains=["*"], routes=[route])]),
        http_filters=filters,
        request_timeout=duration(gateway.request_timeout_s),
    )
    return listener_pb2.Listener(
        name="epp_gateway", address=socket_address(gateway.listener_address, gateway.listener_port),
        filter_chains=[listener_components_pb2.FilterChain(filters=[
            listener_components_pb2.Filter(name=HCM_FILTER, typed_config=pack(manager))])],
    )


def build_override_host_policy() -> cluster_pb2.LoadBalancingPolicy:
    """override_host: the EPP's list from the header, else from ``envoy.lb`` metadata; the chosen host reported
    as ``envoy.lb`` / ``x-gateway-destination-endpoint-served``; round robin when the EPP named none."""
    fallback = cluster_pb2.LoadBalancingPolicy(policies=[cluster_pb2.LoadBalancingPolicy.Policy(
        typed_extension_config=_typed(ROUND_ROBIN_POLICY, round_robin_pb2.RoundRobin()))])
    override = override_host_pb2.OverrideHost(
        override_host_sources=[
            override_host_pb2.OverrideHost.OverrideHostSource(header=PICK_HEADER),
            override_host_pb2.OverrideHost.OverrideHostSource(metadata=_metadata_key(PICK_NAMESPACE, PICK_HEADER)),
        ],
        fallback_policy=fallback,
    )
    packed = pack(override)
    packed.value += len_field(varint(_SELECTED_HOST_KEY_FIELD << 3 | 2),
                              _metadata_key(PICK_NAMESPACE, SERVED_KEY).SerializeToString(deterministic=True))
    config = _typed(OVERRIDE_HOST_POLICY, None)
    config.typed_config.CopyFrom(packed)
    return cluster_pb2.LoadBalancingPolicy(policies=[cluster_pb2.LoadBalancingPolicy.Policy(
        typed_extension_config=config)])


def _typed(name: str, message: Any) -> extension_pb2.TypedExtensionConfig:
    config = extension_pb2.TypedExtensionConfig(name=name)
    if message is not None:
        config.typed_config.CopyFrom(pack(message))
    return config


def build_pool_cluster(gateway: EppGateway) -> cluster_pb2.Cluster:
    if gateway.cluster == "original_dst":
        return cluster_pb2.Cluster(
            name=POOL_CLUSTER, type=cluster_pb2.Cluster.ORIGINAL_DST, lb_policy=cluster_pb2.Cluster.CLUSTER_PROVIDED,
            connect_timeout=duration(5.0),
            original_dst_lb_config=cluster_pb2.Cluster.OriginalDstLbConfig(use_http_header=True,
                                                                          http_header_name=PICK_HEADER),
        )
    if not gateway.endpoints:
        raise ValueError("an override_host pool needs its endpoints (ip:port)")
    lb_endpoints = []
    for endpoint in gateway.endpoints:
        try:
            host, _, port = id_of_authority(endpoint).rpartition(":")
        except ValueError as exc:
            raise ValueError(f"a pool endpoint must be ip:port ([ip]:port for IPv6), got {endpoint!r}: {exc}") \
                from None
        lb_endpoints.append(endpoint_components_pb2.LbEndpoint(endpoint=endpoint_components_pb2.Endpoint(
            address=socket_address(host, int(port)))))
    return cluster_pb2.Cluster(
        name=POOL_CLUSTER, type=cluster_pb2.Cluster.STATIC, connect_timeout=duration(5.0),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(cluster_name=POOL_CLUSTER, endpoints=[
            endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=lb_endpoints)]),
        load_balancing_policy=build_override_host_policy(),
    )


def build_epp_cluster(gateway: EppGateway) -> cluster_pb2.Cluster:
    """The EPP: gRPC, so HTTP/2."""
    options = http_protocol_options_pb2.HttpProtocolOptions(
        explicit_http_config=http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
            http2_protocol_options=protocol_pb2.Http2ProtocolOptions()))
    cluster = cluster_pb2.Cluster(
        name=EPP_CLUSTER, type=cluster_pb2.Cluster.STATIC, connect_timeout=duration(5.0),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(cluster_name=EPP_CLUSTER, endpoints=[
            endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=[endpoint_components_pb2.LbEndpoint(
                endpoint=endpoint_components_pb2.Endpoint(
                    address=socket_address(gateway.epp_address, gateway.epp_port)))])]),
    )
    cluster.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS_KEY].CopyFrom(pack(options))
    return cluster


def build_bootstrap(gateway: EppGateway) -> bootstrap_pb2.Bootstrap:
    """The whole static bootstrap."""
    return bootstrap_pb2.Bootstrap(
        admin=bootstrap_pb2.Admin(address=address_pb2.Address(socket_address=address_pb2.SocketAddress(
            address="127.0.0.1", port_value=gateway.admin_port))),
        static_resources=bootstrap_pb2.Bootstrap.StaticResources(
            listeners=[build_listener(gateway)],
            clusters=[build_pool_cluster(gateway), build_epp_cluster(gateway)],
        ),
    )


def to_dict(gateway: EppGateway) -> dict[str, Any]:
    """The bootstrap as Envoy's YAML reads it (proto field names), ``selected_host_key`` included."""
    # Through JSON: MessageToDict leaves the Any payloads as OrderedDicts, which YAML's safe dumper refuses.
    document = json.loads(json_format.MessageToJson(build_bootstrap(gateway), preserving_proto_field_name=True))
    if gateway.cluster == "override_host":
        for cluster in document["static_resources"]["clusters"]:
            if cluster["name"] == POOL_CLUSTER:
                policy = cluster["load_balancing_policy"]["policies"][0]["typed_extension_config"]["typed_config"]
                policy["selected_host_key"] = json_format.MessageToDict(
                    _metadata_key(PICK_NAMESPACE, SERVED_KEY), preserving_proto_field_name=True)
    return document


def to_yaml(gateway: EppGateway) -> str:
    return yaml.safe_dump(to_dict(gateway), sort_keys=False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m control_plane.resources.epp_gateway",
        description="Print the bootstrap of an Envoy configured like the Gateway API Inference Extension's "
                    "reference gateways, with inferlb's ext_proc as its endpoint picker (docs/epp.md).")
    parser.add_argument("--listener-port", type=int, default=8081)
    parser.add_argument("--epp-port", type=int, default=9002, help="inferlb's ext_proc gRPC port")
    parser.add_argument("--admin-port", type=int, default=19000)
    parser.add_argument("--cluster", choices=("original_dst", "override_host"), default="override_host")
    parser.add_argument("--endpoint", action="append", default=[], metavar="IP:PORT",
                        help="an endpoint of the pool (override_host; repeat for each)")
    parser.add_argument("--fail-open", action="store_true", help="route by Envoy's own balancing when the EPP fails")
    parser.add_argument("--json", action="store_true", help="JSON instead of YAML")
    args = parser.parse_args(argv)
    try:
        gateway = EppGateway(args.listener_port, args.epp_port, args.admin_port, args.cluster,
                             tuple(args.endpoint), fail_open=args.fail_open)
        print(json.dumps(to_dict(gateway), indent=2) if args.json else to_yaml(gateway), end="")
    except ValueError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    main()
