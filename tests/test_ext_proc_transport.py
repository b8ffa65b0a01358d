"""How Envoy reaches ext_proc (issue 18): a Unix domain socket for a co-located ext_proc (the local stack's
default), and several ext_proc processes sharing one TCP port (SO_REUSEPORT).

The cluster config and the command lines are pure functions, tested without a network; then real Envoy,
control plane, ext_proc and simulated workers show each transport carrying picks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from control_plane.config import DataPlaneConfig
from control_plane.resources.clusters import build_ext_proc_cluster
from ext_proc.config import ExtProcConfig
from inferlb.components import StackPorts, ext_proc_socket, stack_components
from inferlb_runtime.hostport import MAX_UNIX_SOCKET_PATH_BYTES

from .conftest import free_port
from .stack import (
    ExtProc,
    http,
    running_control_plane,
    running_envoy,
    running_ext_proc,
    running_gateway,
    running_sim_workers,
    wait_for,
)

ENDPOINT_HEADER = "x-inferlb-endpoint"
BODY = {"model": "all-MiniLM-L6-v2", "input": "a short input"}
TOO_LONG = "/" + "d" * MAX_UNIX_SOCKET_PATH_BYTES


# --- pure: the cluster, the settings, the command lines ---------------------------------------------------

def test_the_ext_proc_cluster_over_a_unix_socket_is_a_static_pipe_with_http2() -> None:
    cluster = build_ext_proc_cluster(DataPlaneConfig(ext_proc_uds_path="/run/inferlb/ext_proc.sock").settings({}))
    (endpoint,) = cluster.load_assignment.endpoints[0].lb_endpoints
    assert endpoint.endpoint.address.WhichOneof("address") == "pipe"
    assert endpoint.endpoint.address.pipe.path == "/run/inferlb/ext_proc.sock"
    assert cluster.type == cluster.STATIC
    assert "envoy.extensions.upstreams.http.v3.HttpProtocolOptions" in cluster.typed_extension_protocol_options


def test_the_ext_proc_cluster_is_tcp_by_default() -> None:
    cluster = build_ext_proc_cluster(DataPlaneConfig(ext_proc_port=9123).settings({}))
    address = cluster.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address
    assert (address.socket_address.address, address.socket_address.port_value) == ("127.0.0.1", 9123)


def test_a_relative_or_too_long_socket_path_is_refused_with_its_reason() -> None:
    with pytest.raises(ValidationError, match="ext_proc_uds_path must be an absolute path"):
        DataPlaneConfig(ext_proc_uds_path="run/ext_proc.sock")
    with pytest.raises(ValidationError, match="too long for a Unix socket"):
        DataPlaneConfig(ext_proc_uds_path=TOO_LONG)
    with pytest.raises(ValidationError, match="uds_path .* too long for a Unix socket"):
        ExtProcConfig(uds_path=Path(TOO_LONG))


def test_ext_proc_listens_on_its_port_and_on_the_socket_when_set() -> None:
    assert ExtProcConfig(port=9100).grpc_targets == ["127.0.0.1:9100"]
    assert ExtProcConfig(port=9100, uds_path=Path("/tmp/e.sock")).grpc_targets == ["127.0.0.1:9100", "unix:/tmp/e.sock"]


@pytest.mark.envoy  # finds the binary to plan the stack
def test_inferlb_up_points_envoy_at_ext_procs_socket_in_the_data_dir(tmp_path: Path) -> None:
    from ext_proc.__main__ import build_parser as ext_proc_parser

    components = stack_components(workers=1, base_port=8101, data_dir=tmp_path, ports=StackPorts())
    cp, ext = (next(c for c in components if c.name == name) for name in ("control-plane", "ext_proc"))
    socket_path = tmp_path.resolve() / "ext_proc.sock"
    assert ext_proc_parser().parse_args(list(ext.argv[3:])).uds_path == socket_path
    assert cp.env["INFERLB_CP_DATA_PLANE__EXT_PROC_UDS_PATH"] == str(socket_path)


@pytest.mark.envoy  # finds the binary to plan the stack
def test_inferlb_up_falls_back_to_tcp_when_the_data_dir_is_too_deep_for_a_socket(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * MAX_UNIX_SOCKET_PATH_BYTES)
    assert ext_proc_socket(deep) is None
    components = stack_components(workers=1, base_port=8101, data_dir=deep, ports=StackPorts())
    assert not any("--uds-path" in c.argv for c in components)
    assert not any("INFERLB_CP_DATA_PLANE__EXT_PROC_UDS_PATH" in (c.env or {}) for c in components)


def test_nginx_mode_has_no_ext_proc_socket(tmp_path: Path) -> None:
    components = stack_components(workers=1, base_port=8101, data_dir=tmp_path, ports=StackPorts(),
                                  dataplane="nginx")
    assert not any("INFERLB_CP_DATA_PLANE__EXT_PROC_UDS_PATH" in (c.env or {}) for c in components)


# --- through real Envoy ---------------------------------------------------------------------------------

@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path: pytest's tmp_path can be too deep to name a socket."""
    path = Path(tempfile.mkdtemp(prefix="ilb-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def decisions(ext_proc: ExtProc) -> float:
    samples = ext_proc.metrics()
    return sum(v for (name, _), v in samples.items() if name == "inferlb_ext_proc_decisions_total")


def picked(url: str) -> str | None:
    """The endpoint ext_proc picked for one request through Envoy (None: no pick, e.g. a fail-open)."""
    with http() as client:
        response = client.post(url, json=BODY, timeout=10)
    return response.headers.get(ENDPOINT_HEADER) if response.status_code == 200 else None


@pytest.mark.servers
@pytest.mark.envoy
@pytest.mark.slow
def test_envoy_reaches_ext_proc_over_a_unix_socket(tmp_path: Path, short_dir: Path) -> None:
    socket_path = short_dir / "ext_proc.sock"
    with running_gateway(tmp_path, workers=2, name="uds",
                         cp_env={"INFERLB_CP_DATA_PLANE__EXT_PROC_UDS_PATH": str(socket_path)},
                         ext_proc_env={"INFERLB_EXT_PROC_UDS_PATH": str(socket_path)}) as gw:
        clusters = gw.envoy.config_dump("dynamic_active_clusters")["configs"]
        ext = next(c["cluster"] for c in clusters if c["cluster"]["name"] == "ext_proc")
        address = ext["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        assert address == {"pipe": {"path": str(socket_path)}}
        before = decisions(gw.ext_proc)
        picks = [wait_for(lambda: picked(gw.url()), 30, "a pick through Envoy over the socket", gw.procs)
                 for _ in range(10)]
        assert set(picks) <= gw.ids
        assert decisions(gw.ext_proc) >= before + 10
        assert (gw.envoy.stat("cluster.ext_proc.upstream_cx_total") or 0) >= 1


@pytest.mark.servers
@pytest.mark.envoy
@pytest.mark.slow
def test_two_ext_procs_share_one_port_and_the_survivor_takes_the_picks(tmp_path: Path) -> None:
    """Two ext_proc processes bound to one port (SO_REUSEPORT): Envoy's connection lands on one of them;
    when that one stops, Envoy reconnects to the same address and the other picks, with no config change.
    Each is its own xDS node (its own node id), so the control plane partitions among them as before."""
    port = free_port()
    shared = {"INFERLB_EXT_PROC_REUSE_PORT": "true"}
    with ExitStack() as stack:
        sims = stack.enter_context(running_sim_workers(tmp_path, 2))
        cp = stack.enter_context(running_control_plane(tmp_path, endpoints=[w.id for w in sims], ext_proc_port=port))
        a, b = (stack.enter_context(running_ext_proc(tmp_path, xds_port=cp.xds_port, port=port,
                                                     node_id=f"ext-proc-{name}", env=shared)) for name in "ab")
        envoy = stack.enter_context(running_envoy(tmp_path, xds_port=cp.xds_port, node_id="envoy-reuse"))
        procs = [cp.proc, a.proc, b.proc, envoy.proc, *(w.proc for w in sims)]
        ids = {w.id for w in sims}
        wait_for(lambda: envoy.healthy_hosts() == ids, 30, "Envoy to see every worker healthy", procs)
        url = f"http://127.0.0.1:{cp.listener_port}/v1/embeddings"
        wait_for(lambda: picked(url), 30, "a pick through Envoy", procs)
        counts = {name: decisions(e) for name, e in (("a", a), ("b", b))}
        serving, other = (a, b) if counts["a"] > 0 else (b, a)
        assert decisions(serving) > 0
        serving.proc.stop()
        procs.remove(serving.proc)
        before = decisions(other)
        for _ in range(5):
            assert wait_for(lambda: picked(url), 30, "a pick by the surviving ext_proc", procs) in ids
        assert decisions(other) >= before + 5
        with httpx.Client(trust_env=False) as client:  # the survivor still serves its own port's health
            assert client.get(f"{other.metrics_url}/readyz").status_code == 200


@pytest.mark.subprocess
@pytest.mark.parametrize("given, expected", [(None, "-event_engine_listener,-event_engine_for_all_other_endpoints"),
                                             ("", ""), ("pollset_alternative", "pollset_alternative")])
def test_ext_proc_chooses_grpcs_endpoints_before_grpc_loads_unless_told(given: str | None, expected: str) -> None:
    """``python -m ext_proc`` sets GRPC_EXPERIMENTS first thing (grpc reads it once, when it loads), and leaves
    an operator's own value, even an empty one, alone."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if given is not None:
        env["GRPC_EXPERIMENTS"] = given
    code = "import os, ext_proc.__main__; print(os.environ['GRPC_EXPERIMENTS'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected
