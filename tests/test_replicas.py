"""Issue 7's acceptance for control-plane replicas: a real PostgreSQL server (tests/postgres.py), two
``python -m control_plane`` processes sharing it (``INFERLB_STORE``), two real Envoys, one on each.

An operator action through either replica reaches both Envoys; both replicas list the same operator
state; their xDS versions never collide; an Envoy whose replica dies and is replaced applies the new
replica's resources. The propagation time is measured and printed (``-s``), never asserted.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from .stack import (
    ControlPlane,
    Envoy,
    running_control_plane,
    running_envoy,
    running_sim_workers,
    wait_for,
)
from .test_admin_api import Admin

pytest_plugins = ("tests.postgres",)  # the postgres_server and postgres_url fixtures
pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy]


def flags(envoy: Envoy, host: str) -> str:
    return envoy.hosts().get(host, {}).get("health_flags", "")


def operator_view(admin: Admin) -> list[tuple[Any, ...]]:
    """What an operator set, as one replica lists it (telemetry and computed weights are per replica)."""
    return [(e["id"], e["source"], e["draining"], e["weight"]["pinned"])
            for e in admin.ok("GET", "/v1/endpoints")["endpoints"]]


def acked_eds_version(admin: Admin, node_id: str) -> str:
    """The EDS version ``node_id`` acknowledged on this replica ('' while it has none)."""
    for client in admin.ok("GET", "/v1/xds/clients")["clients"]:
        if client["node_id"] == node_id and "eds" in client["types"]:
            return client["types"]["eds"]["acked_version"] or ""
    return ""


def envoy_eds_version(envoy: Envoy) -> str:
    """The version of the last EDS update Envoy accepted for the workers (its ``version_text`` readout)."""
    for line in envoy.admin("/stats?filter=^cluster\\.workers\\.version_text$").splitlines():
        name, _, value = line.partition(": ")
        if name == "cluster.workers.version_text":
            return value.strip().strip('"')
    return ""


def replica(stack: ExitStack, tmp_path: Path, name: str, url: str, endpoints: list[str],
            xds_port: int | None = None) -> ControlPlane:
    log_dir = tmp_path / name
    log_dir.mkdir(exist_ok=True)
    return stack.enter_context(running_control_plane(
        log_dir, endpoints=endpoints, xds_port=xds_port, data_dir=log_dir / "data",
        env={"INFERLB_STORE": url, "INFERLB_CP_LOG_LEVEL": "info"}))


def test_a_change_through_either_replica_reaches_both_envoys(tmp_path: Path, postgres_url: str) -> None:
    with ExitStack() as stack:
        w1, w2, w3 = stack.enter_context(running_sim_workers(tmp_path, 3))
        static = [w1.id, w2.id]
        cp_a = replica(stack, tmp_path, "replica-a", postgres_url, static)
        cp_b = replica(stack, tmp_path, "replica-b", postgres_url, static)
        envoy_a = stack.enter_context(running_envoy(tmp_path, xds_port=cp_a.xds_port, node_id="envoy-a"))
        envoy_b = stack.enter_context(running_envoy(tmp_path, xds_port=cp_b.xds_port, node_id="envoy-b"))
        procs = [cp_a.proc, cp_b.proc, envoy_a.proc, envoy_b.proc]
        admin_a, admin_b = Admin(cp_a), Admin(cp_b)
        assert admin_a.token != admin_b.token  # each replica has its own token
        for envoy in (envoy_a, envoy_b):
            wait_for(lambda envoy=envoy: envoy.healthy_hosts() == {w1.id, w2.id}, 30,
                     f"{envoy.node_id} to see both workers healthy", procs)

        # a pin through replica A reaches Envoy B, connected to replica B
        admin_a.ok("PUT", f"/v1/endpoints/{w1.id}/weight", json={"weight": 640})
        committed = time.monotonic()
        wait_for(lambda: envoy_b.weights().get(w1.id) == 640, 15,
                 lambda: f"the pin in Envoy B: {envoy_b.weights()}", procs)
        propagation_s = time.monotonic() - committed
        wait_for(lambda: envoy_a.weights().get(w1.id) == 640, 15, "the pin in Envoy A", procs)
        print(f"\npin through replica A -> Envoy B on replica B: {propagation_s * 1000:.0f} ms "
              "(from the 200 to Envoy B's /clusters, polled every 50 ms)")

        # an unpin and a drain through replica B reach Envoy A
        admin_b.ok("DELETE", f"/v1/endpoints/{w1.id}/weight")
        admin_b.ok("POST", f"/v1/endpoints/{w2.id}/drain")
        wait_for(lambda: envoy_a.weights().get(w1.id) != 640 and "eds_status_draining" in flags(envoy_a, w2.id),
                 15, lambda: f"the unpin and the drain in Envoy A: {envoy_a.hosts()}", procs)
        assert admin_a.endpoint(w1.id)["weight"]["pinned"] is None

        # a registration through replica A reaches Envoy B; the replicas list the same operator state
        admin_a.ok("POST", "/v1/endpoints", 201, json={"address": "127.0.0.1", "port": w3.port})
        wait_for(lambda: w3.id in envoy_b.healthy_hosts(), 30, lambda: f"w3 in Envoy B: {envoy_b.hosts()}", procs)
        wait_for(lambda: operator_view(admin_a) == operator_view(admin_b), 15,
                 lambda: f"the replicas to agree: {operator_view(admin_a)} vs {operator_view(admin_b)}", procs)
        assert (w3.id, "api", False, None) in operator_view(admin_b)

        # the same state, yet versions from different epochs: they never collide
        version_a = wait_for(lambda: acked_eds_version(admin_a, "envoy-a"), 10, "Envoy A's EDS ack", procs)
        version_b = wait_for(lambda: acked_eds_version(admin_b, "envoy-b"), 10, "Envoy B's EDS ack", procs)
        assert version_a.split(".")[0] != version_b.split(".")[0]

        # both followed the other's changes through NOTIFY (and skipped their own)
        for cp in (cp_a, cp_b):
            samples = cp.metrics()
            notified = samples.get(("inferlb_cp_store_changes_total", frozenset({("reason", "notified")})), 0)
            own = samples.get(("inferlb_cp_store_changes_total", frozenset({("reason", "own")})), 0)
            assert notified >= 1 and own >= 1, samples


def test_an_envoy_whose_replica_dies_applies_the_replacements_resources(tmp_path: Path,
                                                                          postgres_url: str) -> None:
    """A replica is killed; a new one takes its address (as behind a Service): the Envoy reconnects, gets
    versions it never saw (a new epoch), applies them, and keeps the operator's pin from the shared store."""
    with ExitStack() as stack:
        w1, w2 = stack.enter_context(running_sim_workers(tmp_path, 2))
        cp_a = replica(stack, tmp_path, "replica-a", postgres_url, [w1.id, w2.id])
        envoy = stack.enter_context(running_envoy(tmp_path, xds_port=cp_a.xds_port, node_id="envoy-a"))
        wait_for(lambda: envoy.healthy_hosts() == {w1.id, w2.id}, 30, "Envoy to see both workers healthy",
                 [cp_a.proc, envoy.proc])
        Admin(cp_a).ok("PUT", f"/v1/endpoints/{w2.id}/weight", json={"weight": 7})
        wait_for(lambda: envoy.weights().get(w2.id) == 7, 15, "the pin in Envoy", [cp_a.proc, envoy.proc])
        before = wait_for(lambda: envoy_eds_version(envoy), 10, "Envoy's EDS version", [envoy.proc])

        cp_a.kill()
        cp_c = replica(stack, tmp_path, "replica-c", postgres_url, [w1.id, w2.id], xds_port=cp_a.xds_port)
        procs = [cp_c.proc, envoy.proc]
        after = wait_for(lambda: (v := acked_eds_version(Admin(cp_c), "envoy-a")) and v != before and v, 30,
                         "Envoy to acknowledge the new replica's EDS", procs)
        epoch_c = after.split(".")[0]
        assert epoch_c != before.split(".")[0]  # a new epoch: nothing "already had"
        # applied, not only acknowledged (later scrapes may push newer EDS versions, all in C's epoch)
        wait_for(lambda: envoy_eds_version(envoy).split(".")[0] == epoch_c, 10,
                 lambda: f"Envoy to apply C's EDS: {envoy_eds_version(envoy)} vs {after}", procs)
        assert envoy.weights().get(w2.id) == 7  # the pin came back from the shared store
        wait_for(lambda: envoy.healthy_hosts() == {w1.id, w2.id}, 15,
                 lambda: f"both workers healthy through C: {envoy.hosts()}", procs)
