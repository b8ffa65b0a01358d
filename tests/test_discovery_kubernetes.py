"""Kubernetes discovery: EndpointSlices -> endpoints (pure), and the real control plane and a real Envoy
following a Service's EndpointSlices through ReplayedKubernetesApi (no API server can run here)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Iterator

import kubernetes_validate
import pytest

from inferlb_runtime.backoff import Backoff
from control_plane.discovery.endpointslices import (
    apply_event,
    endpoints_from_slices,
    read_slices,
    readiness,
    slice_port,
)
from control_plane.discovery.kubernetes import KubernetesProvider, KubernetesTarget
from control_plane.discovery.model import DiscoveryFailure, DiscoverySnapshot, Readiness

from .conftest import FIXTURES
from .replayed_kubernetes_api import ReplayedKubernetesApi
from .stack import http, running_control_plane, running_envoy, sample, wait_for

KUBERNETES_VERSION = "1.34"
A, B, C = "127.0.0.2:8101", "127.0.0.3:8101", "127.0.0.4:8101"


@pytest.fixture
def events() -> dict[str, Any]:
    return json.loads((FIXTURES / "endpointslice_events.json").read_text())


def _slice(name: str, endpoints: list[dict[str, Any]], ports: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name}, "addressType": "IPv4", "endpoints": endpoints,
            "ports": [{"name": "http", "port": 8101}] if ports is None else ports}


def _ep(address: str, **conditions: bool) -> dict[str, Any]:
    return {"addresses": [address], "conditions": conditions}


# --- the fixture is what an API server sends ------------------------------------------------------------


def test_fixture_objects_are_valid_endpointslices(events: dict[str, Any]) -> None:
    objects = list(events["list"]["items"])
    for phase in events["phases"]:
        objects += [e["object"] for e in phase.get("events", []) + phase.get("unseen", []) if e["type"] != "BOOKMARK"]
    assert len(objects) >= 6
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


# --- EndpointSlices -> endpoints (pure) ---------------------------------------------------------------


@pytest.mark.parametrize(("conditions", "expected"), [
    ({"ready": True, "serving": True, "terminating": False}, Readiness.READY),
    ({}, Readiness.READY),  # nil ready means ready (the API's own rule)
    ({"ready": False, "serving": False, "terminating": False}, Readiness.NOT_READY),
    ({"ready": False}, Readiness.NOT_READY),  # serving defaults to ready
    ({"ready": False, "serving": True, "terminating": True}, Readiness.DRAINING),
    ({"ready": False, "serving": False, "terminating": True}, Readiness.NOT_READY),
])
def test_conditions_map_to_readiness(conditions: dict[str, bool], expected: Readiness) -> None:
    assert readiness(conditions) is expected


def test_port_by_name_number_or_first() -> None:
    s = _slice("s", [], [{"name": "metrics", "port": 9100}, {"name": "http", "port": 8101}])
    assert slice_port(s, None) == 9100
    assert slice_port(s, "http") == 8101
    assert slice_port(s, "8101") == 8101
    assert slice_port(s, "grpc") is None
    assert slice_port(_slice("empty", [], []), None) is None


def test_slices_merge_and_deduplicate_with_the_best_readiness() -> None:
    slices = [
        _slice("one", [_ep("10.0.0.1"), _ep("10.0.0.2", ready=False)]),
        _slice("two", [_ep("10.0.0.2", ready=True), _ep("10.0.0.3", ready=False, serving=True, terminating=True)]),
        _slice("no-port", [_ep("10.0.0.9")], []),  # a slice without the port contributes nothing
        {"metadata": {"name": "null-endpoints"}, "endpoints": None, "ports": [{"port": 8101}]},
    ]
    found = {e.id: e.readiness for e in endpoints_from_slices(slices, "http")}
    assert found == {"10.0.0.1:8101": Readiness.READY, "10.0.0.2:8101": Readiness.READY,
                     "10.0.0.3:8101": Readiness.DRAINING}


def test_watch_events_update_the_slices_by_name() -> None:
    one = _slice("one", [_ep("10.0.0.1")])
    slices = apply_event({}, "ADDED", one)
    slices = apply_event(slices, "MODIFIED", _slice("one", [_ep("10.0.0.2")]))
    assert [e.id for e in endpoints_from_slices(slices.values())] == ["10.0.0.2:8101"]
    assert apply_event(slices, "BOOKMARK", {"metadata": {"resourceVersion": "9"}}) == slices
    assert apply_event(slices, "DELETED", one) == {}


def test_target_parses_namespace_and_name() -> None:
    assert KubernetesTarget.parse("inferlb/inferlb-worker", "http") == KubernetesTarget("inferlb", "inferlb-worker",
                                                                                        "http")
    for bad in ("inferlb", "/x", "x/", "a/b/c"):
        with pytest.raises(ValueError, match="namespace/name"):
            KubernetesTarget.parse(bad)


# --- the provider against the replayed API ---------------------------------------------------------------


def write_kubeconfig(path: Path, server: str, token: str = "replay-token") -> Path:
    """A kubeconfig for ``server`` (the client's kubeconfig loader is part of what is tested)."""
    path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: replay
  cluster: {{server: "{server}"}}
users:
- name: inferlb-control-plane
  user: {{token: {token}}}
contexts:
- name: replay
  context: {{cluster: replay, user: inferlb-control-plane, namespace: inferlb}}
current-context: replay
""")
    return path


@pytest.fixture
def replayed_api(events: dict[str, Any]) -> Iterator[ReplayedKubernetesApi]:
    with ReplayedKubernetesApi(events) as api:
        yield api


@pytest.mark.servers
def test_provider_lists_watches_relists_after_410_and_reports_an_api_outage(
        replayed_api: ReplayedKubernetesApi, tmp_path: Path) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", replayed_api.url)
    provider = KubernetesProvider(KubernetesTarget("inferlb", "inferlb-worker", "http"), kubeconfig,
                                  backoff=Backoff(0.05, 0.2))

    async def follow() -> list[Any]:
        seen: list[Any] = []
        updates = provider.updates()

        async def until(predicate: Any) -> Any:
            while True:
                update = await asyncio.wait_for(updates.__anext__(), 20)
                seen.append(update)
                if predicate(update):
                    return update

        def ids(*wanted: str) -> Any:
            return lambda u: isinstance(u, DiscoverySnapshot) and {
                e.id: e.readiness.value for e in u.endpoints} == dict(w.split("=") for w in wanted)

        await until(ids(f"{A}=ready", f"{B}=ready"))
        replayed_api.advance()
        await until(ids(f"{A}=ready", f"{B}=not_ready"))
        replayed_api.advance()
        await until(ids(f"{A}=ready", f"{B}=not_ready", f"{C}=ready"))
        replayed_api.advance()  # 410: only a relist can see that b recovered
        await until(ids(f"{A}=ready", f"{B}=ready", f"{C}=ready"))
        replayed_api.stop()
        await until(lambda u: isinstance(u, DiscoveryFailure))
        await updates.aclose()
        return seen

    seen = asyncio.run(follow())
    assert replayed_api.lists() == 2  # the first list and the relist after 410
    assert {r.authorization for r in replayed_api.requests} == {"Bearer replay-token"}
    watches = [r for r in replayed_api.requests if r.watch]
    assert [w.query["resourceVersion"] for w in watches] == ["1000", "1009"]
    assert all(r.query["labelSelector"] == "kubernetes.io/service-name=inferlb-worker" for r in replayed_api.requests)
    assert not any(isinstance(u, DiscoveryFailure) for u in seen[:-1])  # the 410 is no failure


# --- the real control plane and a real Envoy ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.servers
@pytest.mark.envoy
def test_control_plane_and_envoy_follow_the_endpointslices(replayed_api: ReplayedKubernetesApi,
                                                             tmp_path: Path) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", replayed_api.url)
    env = {"INFERLB_CP_KUBERNETES_SERVICE": "inferlb/inferlb-worker", "INFERLB_CP_KUBERNETES_PORT": "http",
           "INFERLB_CP_KUBERNETES_KUBECONFIG": str(kubeconfig)}
    # No scraping during the test (nothing serves the pods' addresses): health is discovery's alone.
    with running_control_plane(tmp_path, endpoints=[], env=env, scrape_interval_s=3600) as cp, \
            running_envoy(tmp_path, xds_port=cp.xds_port) as envoy, http() as client:

        def endpoints() -> dict[str, dict[str, Any]]:
            return {e["id"]: e for e in client.get(f"{cp.admin_url}/v1/endpoints").json()["endpoints"]}

        def expect(what: str, **wanted: tuple[str, bool, bool]) -> None:
            """id -> (health, routable, draining) in the admin API, and the same hosts in Envoy."""
            def matches() -> bool:
                got = endpoints()
                return set(got) == set(wanted) and all(
                    (got[i]["source"], got[i]["health"], got[i]["routable"], got[i]["draining"]) ==
                    ("kubernetes", *wanted[i]) for i in wanted) and set(envoy.hosts()) == set(wanted)
            wait_for(matches, 30, lambda: f"{what}: admin {endpoints()}, envoy {envoy.hosts()}", [cp.proc, envoy.proc])

        def envoy_flags(host: str) -> str:
            return envoy.hosts()[host].get("health_flags", "")

        expect("the listed pods", **{A: ("unknown", True, False), B: ("unknown", True, False)})

        replayed_api.advance()  # b not ready
        expect("b not ready", **{A: ("unknown", True, False), B: ("unhealthy", False, False)})
        wait_for(lambda: "failed_eds_health" in envoy_flags(B), 30, lambda: f"Envoy to fail b: {envoy.hosts()}")
        assert "failed_eds_health" not in envoy_flags(A)

        replayed_api.advance()  # c in a second slice
        expect("c added", **{A: ("unknown", True, False), B: ("unhealthy", False, False),
                             C: ("unknown", True, False)})

        replayed_api.advance()  # 410 Gone; the relist shows b ready again
        expect("b ready after the relist", **{A: ("unknown", True, False), B: ("unknown", True, False),
                                              C: ("unknown", True, False)})
        assert replayed_api.lists() == 2

        replayed_api.advance()  # a terminating, still serving
        expect("a draining", **{A: ("unknown", False, True), B: ("unknown", True, False),
                                C: ("unknown", True, False)})
        wait_for(lambda: "eds_status_draining" in envoy_flags(A), 30, lambda: f"Envoy to drain a: {envoy.hosts()}")

        replayed_api.advance()  # a gone, slice fghij deleted
        expect("a and c removed", **{B: ("unknown", True, False)})

        metrics = cp.metrics()
        assert sample(metrics, "inferlb_cp_discovery_endpoints", source="kubernetes") == 1
        assert (sample(metrics, "inferlb_cp_discovery_last_success_timestamp_seconds", source="kubernetes") or 0) > 0

        replayed_api.stop()  # the API server goes away: errors are counted, the fleet stays
        wait_for(lambda: (sample(cp.metrics(), "inferlb_cp_discovery_errors_total", source="kubernetes") or 0) >= 1,
                 30, "the outage to be counted", [cp.proc])
        assert set(endpoints()) == {B} and set(envoy.hosts()) == {B}


@pytest.mark.slow
@pytest.mark.servers
def test_an_unreadable_kubeconfig_stops_the_control_plane_with_a_clear_error(tmp_path: Path) -> None:
    """Retrying cannot fix a missing kubeconfig: the control plane says so and exits 1, not silently on."""
    import os
    import subprocess
    import sys

    from .conftest import free_port

    env = {**os.environ, "INFERLB_CP_KUBERNETES_SERVICE": "default/workers",
           "INFERLB_CP_KUBERNETES_KUBECONFIG": str(tmp_path / "missing-kubeconfig")}
    proc = subprocess.run(
        [sys.executable, "-m", "control_plane", "--data-dir", str(tmp_path), "--xds-port", str(free_port()),
         "--admin-port", str(free_port())],
        env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    failure = [json.loads(line) for line in proc.stderr.splitlines() + proc.stdout.splitlines()
               if '"component failed"' in line]
    assert failure and failure[0]["task"] == "discovery-kubernetes"
    assert "kube-config" in failure[0]["error"]


# --- only IP literals are published ------------------------------------------------------------------


def _ip_slice(name: str, version: int, addresses: list[str], address_type: str = "IPv4") -> dict[str, Any]:
    return {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
            "metadata": {"name": name, "namespace": "inferlb", "resourceVersion": str(version),
                         "labels": {"kubernetes.io/service-name": "inferlb-worker"}},
            "addressType": address_type, "ports": [{"name": "http", "port": 8101, "protocol": "TCP"}],
            "endpoints": [{"addresses": [a], "conditions": {"ready": True}} for a in addresses]}


def test_a_hostname_in_a_slice_is_skipped_and_the_rest_published() -> None:
    mixed = _slice("s", [_ep("127.0.0.2"), _ep("worker-0.example.internal"), _ep("[::1]"), _ep("not an ip"),
                         _ep("0.0.0.0")])
    endpoints, refused = read_slices([mixed], "http")
    assert [e.id for e in endpoints] == ["127.0.0.2:8101", "::1:8101"]
    assert refused == {"worker-0.example.internal", "not an ip", "0.0.0.0"}
    assert endpoints_from_slices([mixed], "http") == endpoints


@pytest.mark.slow
@pytest.mark.servers
@pytest.mark.envoy
def test_a_hostname_in_an_endpointslice_does_not_freeze_envoy(tmp_path: Path) -> None:
    """Before: the hostname went into EDS; Envoy NACKed the ClusterLoadAssignment (and ext_proc refused it), so
    neither the IP beside it nor any later change reached Envoy. Now the hostname is skipped."""
    fixture = {
        "namespace": "inferlb",
        "list": {"resourceVersion": "2000", "items": [
            _ip_slice("inferlb-worker-mixed", 2000, ["127.0.0.2", "worker-0.example.internal"]),
            _ip_slice("inferlb-worker-fqdn", 2000, ["worker-1.example.internal"], "FQDN"),
        ]},
        "phases": [{"name": "a second pod", "events": [{"type": "MODIFIED", "object": _ip_slice(
            "inferlb-worker-mixed", 2001, ["127.0.0.2", "worker-0.example.internal", "127.0.0.3"])}]}],
    }
    with ReplayedKubernetesApi(fixture) as api:
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url)
        env = {"INFERLB_CP_KUBERNETES_SERVICE": "inferlb/inferlb-worker", "INFERLB_CP_KUBERNETES_PORT": "http",
               "INFERLB_CP_KUBERNETES_KUBECONFIG": str(kubeconfig)}
        with running_control_plane(tmp_path, endpoints=[], env=env, scrape_interval_s=3600) as cp, \
                running_envoy(tmp_path, xds_port=cp.xds_port) as envoy, http() as client:

            def admin_ids() -> set[str]:
                return {e["id"] for e in client.get(f"{cp.admin_url}/v1/endpoints").json()["endpoints"]}

            def both(wanted: set[str]) -> bool:
                return admin_ids() == wanted and set(envoy.hosts()) == wanted

            wait_for(lambda: both({A}), 30, lambda: f"admin {admin_ids()}, envoy {envoy.hosts()}",
                     [cp.proc, envoy.proc])
            api.advance()
            wait_for(lambda: both({A, B}), 30, lambda: f"admin {admin_ids()}, envoy {envoy.hosts()}",
                     [cp.proc, envoy.proc])
            assert (sample(cp.metrics(), "inferlb_cp_xds_nacks_total", type="eds") or 0) == 0
