"""The admin REST API through real HTTP: ``python -m control_plane`` on free ports.

One control plane (with one simulated worker and one address nothing
listens on, both static) serves most tests of this module; each test leaves
the state as it found it. Restarts, the token's sources and the reads option
get their own processes. Nothing sleeps to synchronise: every wait polls.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from control_plane.policies import pick_catalogue
from control_plane.type_urls import ENDPOINT

from .conftest import free_port
from .stack import (
    BackgroundLoad,
    ControlPlane,
    SimWorker,
    http,
    running_control_plane,
    running_sim_workers,
    wait_for,
)
from .xds_client import DeltaClient, SotwClient

pytestmark = [pytest.mark.slow, pytest.mark.servers]

EXT_PROC_CLUSTER = "inferlb-ext-proc"


class Admin:
    """The admin API of one control plane, with or without the token."""

    def __init__(self, cp: ControlPlane, token: str | None = None) -> None:
        self.cp = cp
        self.token = token if token is not None else cp.admin_token()

    def call(self, method: str, path: str, *, token: str | None | bool = True, **kwargs: Any) -> httpx.Response:
        headers = dict(kwargs.pop("headers", {}))
        if token is True:
            headers["Authorization"] = f"Bearer {self.token}"
        elif isinstance(token, str):
            headers["Authorization"] = f"Bearer {token}"
        with http() as client:
            return client.request(method, f"{self.cp.admin_url}{path}", headers=headers, **kwargs)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return self.call("GET", path, **kwargs)

    def ok(self, method: str, path: str, status: int = 200, **kwargs: Any) -> Any:
        response = self.call(method, path, **kwargs)
        assert response.status_code == status, (method, path, response.status_code, response.text)
        return response.json()

    def endpoint(self, endpoint_id: str) -> dict | None:
        response = self.get(f"/v1/endpoints/{endpoint_id}")
        if response.status_code == 404:
            return None
        assert response.status_code == 200, response.text
        return response.json()

    def endpoints(self) -> dict[str, dict]:
        return {e["id"]: e for e in self.ok("GET", "/v1/endpoints")["endpoints"]}


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"status", "code", "message", "detail"}, body
    assert body["error"]["status"] == status and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ControlPlane, SimWorker, str]]:
    """(control plane, its simulated worker, a static endpoint nothing listens on)."""
    log_dir = tmp_path_factory.mktemp("admin-api")
    dead = f"127.0.0.1:{free_port()}"
    with running_sim_workers(log_dir, 1, args=("--sim-slots", "2")) as (worker,), \
            running_control_plane(log_dir, endpoints=[worker.id, dead],
                                  env={"INFERLB_CP_DEREGISTRATION_DRAIN_S": "120"}) as cp:
        yield cp, worker, dead


@pytest.fixture()
def admin(stack: tuple[ControlPlane, SimWorker, str]) -> Admin:
    return Admin(stack[0])


# --- reading -------------------------------------------------------------------------------------------


def test_openapi_and_docs_describe_every_route(admin: Admin) -> None:
    schema = admin.ok("GET", "/openapi.json", token=None)
    paths = schema["paths"]
    expected = {
        "/v1/endpoints": {"get", "post"},
        "/v1/endpoints/{endpoint_id}": {"get", "delete"},
        "/v1/endpoints/{endpoint_id}/weight": {"put", "delete"},
        "/v1/endpoints/{endpoint_id}/drain": {"post", "delete"},
        "/v1/policy": {"get", "put"},
        "/v1/xds/clients": {"get"},
    }
    for path, methods in expected.items():
        assert methods <= set(paths[path]), path
        for method in methods:
            responses = paths[path][method]["responses"]
            assert "401" in responses, (path, method)
            if method != "get":
                assert paths[path][method].get("security"), (path, method)  # bearer documented
    assert schema["components"]["schemas"]["WeightPin"]["properties"]["weight"]["maximum"] == 1000
    assert schema["components"]["schemas"]["ErrorResponse"]
    docs = admin.get("/docs", token=None)
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_endpoints_show_source_health_weights_and_telemetry(stack: tuple[ControlPlane, SimWorker, str],
                                                             admin: Admin) -> None:
    cp, worker, dead = stack
    wait_for(lambda: (admin.endpoint(worker.id) or {}).get("telemetry"), 30, "telemetry of the worker", [cp.proc])
    wait_for(lambda: admin.endpoint(dead)["health"] == "unhealthy", 30, "the dead endpoint to be unhealthy")
    endpoints = admin.endpoints()
    assert set(endpoints) >= {worker.id, dead}
    live = endpoints[worker.id]
    assert live["source"] == "static" and live["address"] == "127.0.0.1" and live["port"] == worker.port
    assert live["health"] == "healthy" and live["draining"] is False and live["routable"] is True
    assert live["removing"] is False
    assert set(live["weight"]) == {"effective", "computed", "pinned"} and live["weight"]["pinned"] is None
    assert 1 <= live["weight"]["effective"] <= 1000
    telemetry = live["telemetry"]
    for key in ("cpu_utilization", "latency_p50_s", "latency_p99_s", "queue_depth", "inflight", "rps",
                "tokens_per_s", "age_s", "stale"):
        assert key in telemetry, key
    assert telemetry["age_s"] >= 0
    # What ext_proc costs the endpoint by, as the worker exports it (no traffic here: its fit stays put).
    assert telemetry["slots"] == 2.0
    exported = {s.labels["term"]: s.value for family in text_string_to_metric_families(
        httpx.get(f"{worker.url}/metrics").text) if family.name == "inferlb_worker_batch_cost_seconds"
        for s in family.samples}
    assert telemetry["batch_cost_fixed_s"] == pytest.approx(exported["fixed"])
    assert telemetry["batch_cost_per_token_s"] == pytest.approx(exported["per_token"])
    assert exported["per_token"] > 0
    down = endpoints[dead]
    assert down["routable"] is False and down["telemetry"] is None and down["consecutive_scrape_failures"] >= 3
    assert admin.endpoint(worker.id)["id"] == worker.id


def test_unknown_endpoints_and_routes_are_404_in_the_error_shape(admin: Admin) -> None:
    for path in ("/v1/endpoints/10.1.2.3:4", "/v1/endpoints/not-an-id", "/v1/nothing-here"):
        assert_error(admin.get(path), 404)
    assert_error(admin.get("/v1/endpoints/10.1.2.3:4"), 404, "endpoint_not_found")
    for method, path, body in [("PUT", "/v1/endpoints/10.1.2.3:4/weight", {"weight": 5}),
                               ("DELETE", "/v1/endpoints/10.1.2.3:4/weight", None),
                               ("POST", "/v1/endpoints/10.1.2.3:4/drain", None),
                               ("DELETE", "/v1/endpoints/10.1.2.3:4/drain", None),
                               ("DELETE", "/v1/endpoints/10.1.2.3:4", None)]:
        assert_error(admin.call(method, path, json=body), 404, "endpoint_not_found")
    assert_error(admin.call("PATCH", "/v1/policy"), 405, "method_not_allowed")


# --- auth ---------------------------------------------------------------------------------------------


def _observable_state(admin: Admin) -> tuple:
    endpoints = {i: (e["source"], e["draining"], e["weight"]["pinned"], e["removing"])
                 for i, e in admin.endpoints().items()}
    policy = admin.ok("GET", "/v1/policy")
    return endpoints, policy["weight"], policy["pick"]


def test_every_mutation_needs_the_token_and_nothing_changes_without_it(stack: tuple[ControlPlane, SimWorker, str],
                                                                      admin: Admin) -> None:
    cp, worker, _ = stack
    before = _observable_state(admin)
    mutations = [
        ("POST", "/v1/endpoints", {"address": "10.7.7.7", "port": 7777}),
        ("DELETE", f"/v1/endpoints/{worker.id}", None),
        ("PUT", f"/v1/endpoints/{worker.id}/weight", {"weight": 999}),
        ("DELETE", f"/v1/endpoints/{worker.id}/weight", None),
        ("POST", f"/v1/endpoints/{worker.id}/drain", None),
        ("DELETE", f"/v1/endpoints/{worker.id}/drain", None),
        ("PUT", "/v1/policy", {"weight": {"name": "equal"}, "pick": {"name": "round_robin"}}),
    ]
    for method, path, body in mutations:
        for token, challenge in [(None, 'Bearer realm="inferlb"'), ("wrong-token", "invalid_token"),
                                 (admin.token + "x", "invalid_token"), (admin.token[:-1], "invalid_token")]:
            response = admin.call(method, path, json=body, token=token)
            assert_error(response, 401, "unauthorized")
            assert challenge in response.headers["www-authenticate"], (method, path, token)
        response = admin.call(method, path, json=body, token=False,
                              headers={"Authorization": f"Basic {admin.token}"})
        assert_error(response, 401, "unauthorized")
    # a body that also fails validation, or is not even JSON, is still 401 first: nothing is revealed
    assert_error(admin.call("PUT", f"/v1/endpoints/{worker.id}/weight", json={"weight": 0}, token=None), 401)
    assert_error(admin.call("POST", "/v1/endpoints", content=b"{nope", token=None,
                            headers={"Content-Type": "application/json"}), 401)
    assert_error(admin.call("PUT", "/v1/endpoints/10.9.9.9:9/weight", json={"weight": 5}, token=None), 401)
    assert _observable_state(admin) == before
    assert admin.token not in cp.proc.log()  # the token is never logged


def test_reads_are_open_on_loopback(admin: Admin) -> None:
    for path in ("/v1/endpoints", "/v1/policy", "/v1/xds/clients", "/healthz", "/readyz", "/metrics"):
        assert admin.get(path, token=None).status_code == 200, path


def test_token_file_is_private_and_reused_across_restarts(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {"INFERLB_ADMIN_TOKEN": ""}
    with running_control_plane(tmp_path, endpoints=[], data_dir=data, env=env) as cp:
        path = data / "admin-token"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        token = cp.admin_token()
        assert len(token) >= 32
        assert str(path) in cp.proc.log() and token not in cp.proc.log()
        admin = Admin(cp)
        admin.ok("POST", "/v1/endpoints", 201, json={"address": "10.0.0.1", "port": 1})
    with running_control_plane(tmp_path, endpoints=[], data_dir=data, env=env) as cp:
        assert cp.admin_token() == token
        assert Admin(cp, token).call("PUT", "/v1/endpoints/10.0.0.1:1/weight", json={"weight": 3}).status_code == 200


def test_token_from_the_environment_and_reads_closed_by_the_option(tmp_path: Path) -> None:
    secret = "env-token-" + os.urandom(8).hex()
    with running_control_plane(tmp_path, endpoints=[], data_dir=tmp_path / "data",
                               env={"INFERLB_ADMIN_TOKEN": secret, "INFERLB_CP_ADMIN_AUTH_READS": "true"}) as cp:
        assert not (tmp_path / "data" / "admin-token").exists()
        assert "INFERLB_ADMIN_TOKEN" in cp.proc.log() and secret not in cp.proc.log()
        admin = Admin(cp, secret)
        for path in ("/v1/endpoints", "/v1/policy", "/v1/xds/clients", "/v1/endpoints/10.0.0.1:1"):
            assert_error(admin.get(path, token=None), 401, "unauthorized")
            assert_error(admin.get(path, token="nope"), 401, "unauthorized")
        assert admin.get("/v1/endpoints").status_code == 200
        assert admin.get("/v1/endpoints/10.0.0.1:1").status_code == 404  # authorised, then not found
        for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):  # probes and schema stay open
            assert admin.get(path, token=None).status_code == 200, path
        admin.ok("POST", "/v1/endpoints", 201, json={"address": "10.0.0.1", "port": 1})


# --- registering and deregistering --------------------------------------------------------------------


def test_register_validate_conflict_and_deregister_with_drain(stack: tuple[ControlPlane, SimWorker, str],
                                                               admin: Admin) -> None:
    cp, worker, _ = stack
    port = free_port()  # nothing listens: the drain ends as soon as it is seen unhealthy
    new_id = f"127.0.0.2:{port}"
    response = admin.call("POST", "/v1/endpoints", json={"address": "127.0.0.2", "port": port})
    assert response.status_code == 201, response.text
    assert response.headers["location"] == f"/v1/endpoints/{new_id}"
    created = response.json()
    assert created["id"] == new_id and created["source"] == "api" and created["draining"] is False
    assert created["weight"] == {"effective": 100, "computed": 100, "pinned": None}
    assert admin.endpoint(new_id)["source"] == "api"

    assert_error(admin.call("POST", "/v1/endpoints", json={"address": "127.0.0.2", "port": port}), 409,
                 "endpoint_exists")
    assert_error(admin.call("POST", "/v1/endpoints", json={"address": "127.0.0.1", "port": worker.port}), 409,
                 "endpoint_exists")
    for bad in [{"address": "not-an-ip", "port": 80}, {"address": "worker.example.com", "port": 80},
                {"address": "127.0.0.1", "port": 0}, {"address": "127.0.0.1", "port": 65536},
                {"address": "127.0.0.1", "port": "80"}, {"address": "127.0.0.1", "port": 80.5},
                {"address": "127.0.0.1", "port": True}, {"address": "0.0.0.0", "port": 80},
                {"address": "224.0.0.1", "port": 80}, {"address": "127.0.0.1"}, {"port": 80},
                {"address": "127.0.0.1", "port": 80, "weight": 3}, [], "x", None]:
        error = assert_error(admin.call("POST", "/v1/endpoints", json=bad), 422, "validation_error")
        assert isinstance(error["detail"], list) and error["detail"], bad
    assert_error(admin.call("POST", "/v1/endpoints", content=b"{not json",
                            headers={"Content-Type": "application/json"}), 400, "invalid_json")

    # static endpoints cannot be deregistered
    assert_error(admin.call("DELETE", f"/v1/endpoints/{worker.id}"), 409, "static_endpoint")

    removing = admin.ok("DELETE", f"/v1/endpoints/{new_id}", 202)
    assert removing["removing"] is True and removing["draining"] is True and removing["routable"] is False
    wait_for(lambda: admin.endpoint(new_id) is None, 30, "the deregistered endpoint to be removed", [cp.proc])
    assert new_id not in admin.endpoints()
    assert_error(admin.call("DELETE", f"/v1/endpoints/{new_id}"), 404, "endpoint_not_found")


def test_an_endpoint_being_removed_refuses_other_changes(stack: tuple[ControlPlane, SimWorker, str],
                                                        admin: Admin) -> None:
    cp, _, _ = stack
    # A slow worker kept busy drains until a scrape shows it idle: until the load stops.
    with running_sim_workers(cp.proc.log_path.parent, 1, speed=0.05) as (busy,):
        admin.ok("POST", "/v1/endpoints", 201, json={"address": "127.0.0.1", "port": busy.port})
        with BackgroundLoad(f"{busy.url}/v1/embeddings", {"input": "keep me busy " * 10}, concurrency=3):
            wait_for(lambda: ((admin.endpoint(busy.id) or {}).get("telemetry") or {}).get("inflight", 0) >= 1, 30,
                     "the busy worker to report in-flight requests", [cp.proc])
            removing = admin.ok("DELETE", f"/v1/endpoints/{busy.id}", 202)
            assert removing["removing"] is True and removing["draining"] is True
            assert_error(admin.call("PUT", f"/v1/endpoints/{busy.id}/weight", json={"weight": 5}), 409,
                         "endpoint_removing")
            assert_error(admin.call("DELETE", f"/v1/endpoints/{busy.id}/drain"), 409, "endpoint_removing")
            assert_error(admin.call("POST", "/v1/endpoints", json={"address": "127.0.0.1", "port": busy.port}), 409,
                         "endpoint_exists")
            again = admin.ok("DELETE", f"/v1/endpoints/{busy.id}", 202)  # idempotent while under way
            assert again["removing"] is True
            assert admin.endpoint(busy.id)["removing"] is True  # in-flight work holds the removal
        wait_for(lambda: admin.endpoint(busy.id) is None, 30, "the endpoint to drain and go once idle", [cp.proc])


# --- pins and drains ------------------------------------------------------------------------------------


def test_pin_unpin_drain_undrain(stack: tuple[ControlPlane, SimWorker, str], admin: Admin) -> None:
    cp, worker, _ = stack
    pinned = admin.ok("PUT", f"/v1/endpoints/{worker.id}/weight", json={"weight": 777})
    assert pinned["weight"]["pinned"] == pinned["weight"]["effective"] == 777
    wait_for(lambda: cp.effective_weights().get(worker.id) == 777, 10, "the pin in the controller's metrics")
    assert admin.ok("PUT", f"/v1/endpoints/{worker.id}/weight", json={"weight": 777.0})["weight"]["pinned"] == 777
    for bad in [{"weight": 0}, {"weight": 1001}, {"weight": -5}, {"weight": 1.5}, {"weight": "5"},
                {"weight": None}, {"weight": True}, {}, {"weight": 5, "extra": 1}]:
        assert_error(admin.call("PUT", f"/v1/endpoints/{worker.id}/weight", json=bad), 422, "validation_error")
    assert admin.endpoint(worker.id)["weight"]["pinned"] == 777  # refusals changed nothing
    for edge in (1, 1000):
        assert admin.ok("PUT", f"/v1/endpoints/{worker.id}/weight", json={"weight": edge})["weight"]["pinned"] == edge
    unpinned = admin.ok("DELETE", f"/v1/endpoints/{worker.id}/weight")
    assert unpinned["weight"]["pinned"] is None
    assert unpinned["weight"]["effective"] == unpinned["weight"]["computed"]
    assert admin.ok("DELETE", f"/v1/endpoints/{worker.id}/weight")["weight"]["pinned"] is None  # idempotent

    drained = admin.ok("POST", f"/v1/endpoints/{worker.id}/drain")
    assert drained["draining"] is True and drained["routable"] is False
    assert admin.ok("POST", f"/v1/endpoints/{worker.id}/drain")["draining"] is True  # idempotent
    undrained = admin.ok("DELETE", f"/v1/endpoints/{worker.id}/drain")
    assert undrained["draining"] is False and undrained["routable"] is True
    # IPv6-style and bracketed ids resolve; a malformed one is simply not found
    assert_error(admin.call("POST", "/v1/endpoints/[::1]:1/drain"), 404, "endpoint_not_found")


# --- policies -------------------------------------------------------------------------------------------


def _pick_policy_in_eds(client: DeltaClient) -> dict | None:
    eds = client.of_type(ENDPOINT)
    if not eds:
        return None
    cla = eds[-1].resources().get("workers")
    if cla is None or not cla.endpoints:
        return None
    meta = cla.endpoints[0].metadata.filter_metadata["inferlb"]
    policy = meta.fields["pick_policy"].struct_value
    return {"name": policy.fields["name"].string_value,
            "params": {k: v.number_value if v.HasField("number_value") else v
                       for k, v in policy.fields["params"].struct_value.fields.items()}}


def test_policy_listing_switching_and_validation(stack: tuple[ControlPlane, SimWorker, str],
                                                 admin: Admin) -> None:
    cp, worker, _ = stack
    policy = admin.ok("GET", "/v1/policy")
    assert policy["weight"]["name"] == "capacity" and policy["weight"]["params"]["max_step"] == 1.5
    assert policy["pick"] == {"name": "least_completion_time",
                              "params": {"slo_ms": 2000.0, "d": 4, "weight_exponent": 0.0, "sample_weighted": False, "fallbacks": 2,
                                         "seed": None}}
    weight_names = {p["name"]: p for p in policy["available"]["weight"]}
    pick_names = {p["name"]: p for p in policy["available"]["pick"]}
    assert {"capacity", "equal"} <= set(weight_names)
    assert set(pick_names) == {"least_completion_time", "round_robin", "least_outstanding", "p2c_tokens"}
    assert pick_names["round_robin"]["params_schema"]["properties"]["fallbacks"]["maximum"] == 2
    assert weight_names["capacity"]["params_schema"]["properties"]["max_step"]["type"] == "number"

    bad_requests = [
        ({"pick": {"name": "no_such_policy"}}, 400, "unknown_policy"),
        ({"weight": {"name": "no_such_policy"}}, 400, "unknown_policy"),
        ({"pick": {"name": "round_robin", "params": {"fallbacks": 5}}}, 422, "invalid_params"),
        ({"pick": {"name": "round_robin", "params": {"unknown": 1}}}, 422, "invalid_params"),
        ({"pick": {"name": "least_completion_time", "params": {"d": "4"}}}, 422, "invalid_params"),
        ({"weight": {"name": "capacity", "params": {"max_step": 0.5}}}, 422, "invalid_params"),
        ({"weight": {"name": "capacity", "params": {"nope": 1}}}, 422, "invalid_params"),
        ({}, 422, "validation_error"),
        ({"pick": {"name": ""}}, 422, "validation_error"),
        ({"pick": {"name": "round_robin", "params": []}}, 422, "validation_error"),
        ({"weight": {"name": "equal"}, "pick": {"name": "nope"}}, 400, "unknown_policy"),  # all or nothing
    ]
    for body, status, code in bad_requests:
        assert_error(admin.call("PUT", "/v1/policy", json=body), status, code)
    assert admin.ok("GET", "/v1/policy")["weight"]["name"] == "capacity"

    async def switch_and_watch() -> None:
        async with DeltaClient(f"127.0.0.1:{cp.xds_port}", "ext-proc-admin-test", EXT_PROC_CLUSTER) as ext_proc:
            await ext_proc.subscribe(ENDPOINT, ["workers"])
            first = await ext_proc.wait_for(lambda: _pick_policy_in_eds(ext_proc))
            assert first["name"] == "least_completion_time"
            changed = await asyncio.to_thread(admin.ok, "PUT", "/v1/policy", json={
                "weight": {"name": "equal"}, "pick": {"name": "round_robin", "params": {"fallbacks": 1}}})
            assert changed["weight"] == {"name": "equal", "params": {}}
            assert changed["pick"] == {"name": "round_robin", "params": {"slo_ms": 2000.0, "fallbacks": 1}}
            seen = await ext_proc.wait_for(
                lambda: (p := _pick_policy_in_eds(ext_proc)) and p["name"] == "round_robin" and p, timeout=10)
            assert seen["params"] == {"fallbacks": 1.0}  # EDS metadata carries it to ext_proc
    try:
        asyncio.run(switch_and_watch())
        assert admin.ok("GET", "/v1/policy")["pick"]["name"] == "round_robin"
        # the equal policy computes 100 for everyone at the next scrape round
        wait_for(lambda: admin.endpoint(worker.id)["weight"]["computed"] == 100, 10, "equal weights")
    finally:
        admin.ok("PUT", "/v1/policy", json={"weight": {"name": "capacity"}, "pick": {"name": "least_completion_time"}})


def test_the_control_plane_catalogue_matches_ext_procs_pick_policies() -> None:
    """The control plane validates with the definitions ext_proc builds from (tests may import both services;
    services may not): whatever the catalogue accepts, ext_proc builds."""
    import dataclasses

    from ext_proc.pick.registry import PluginRegistry
    from inferlb_runtime.pick_chain import PRESETS

    registry = PluginRegistry()
    assert set(pick_catalogue.CATALOGUE) == set(PRESETS)
    for name, preset in PRESETS.items():
        defaults = {f.name: f.default for f in dataclasses.fields(preset.params)}
        assert pick_catalogue.CATALOGUE[name].defaults() == defaults, name
        assert pick_catalogue.CATALOGUE[name].summary == preset.summary
        assert registry.build(name, pick_catalogue.validate_pick_params(name, defaults)).policy == name
    extra = {"scorers": [{"plugin": "outstanding_tokens", "weight": 0.5}], "filters": [{"plugin": "rotate"}]}
    chain = registry.build("least_completion_time", pick_catalogue.validate_pick_params("least_completion_time",
                                                                                        extra))
    assert [type(p).__name__ for p in chain.plugins] == ["Shed", "ModelFilter", "FailingFilter", "Rotate",
                                                         "CompletionTime", "OutstandingTokens", "MaxScore"]


# --- xDS clients ----------------------------------------------------------------------------------------


def test_xds_clients_show_nodes_acked_versions_and_the_last_nack(stack: tuple[ControlPlane, SimWorker, str],
                                                                admin: Admin) -> None:
    cp, _, _ = stack
    address = f"127.0.0.1:{cp.xds_port}"

    def refuse_eds(received: Any) -> str | None:
        return "bad EDS for testing: weight too heavy" if received.type_url == ENDPOINT else None

    async def scenario() -> None:
        async with DeltaClient(address, "ext-proc-xds-test", EXT_PROC_CLUSTER) as good, \
                SotwClient(address, "envoy-nacker", "inferlb", decide=refuse_eds) as bad:
            await good.subscribe(ENDPOINT, ["workers"])
            await bad.subscribe(ENDPOINT, ["workers"])
            await good.next(ENDPOINT)
            await bad.next(ENDPOINT)

            async def listed() -> dict[str, dict] | None:
                async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
                    body = (await client.get(f"{cp.admin_url}/v1/xds/clients")).json()
                by_node = {c["node_id"]: c for c in body["clients"]}
                good_eds = by_node.get("ext-proc-xds-test", {}).get("types", {}).get("eds", {})
                bad_eds = by_node.get("envoy-nacker", {}).get("types", {}).get("eds", {})
                # in sync is waited for, not asserted once: the stack's scrapes publish new EDS versions, and
                # one can be current for a moment before the client's ACK of it arrives
                synced = good_eds.get("in_sync") and good_eds.get("acked_version") == good_eds.get("current_version")
                if good_eds.get("acked_version") and synced and bad_eds.get("last_nack"):
                    return by_node
                return None

            by_node = None
            deadline = asyncio.get_running_loop().time() + 30
            while not by_node and asyncio.get_running_loop().time() < deadline:
                by_node = await listed()
                if not by_node:
                    await asyncio.sleep(0.05)
            assert by_node, "the clients never showed their ACK (in sync) and NACK"
            ok = by_node["ext-proc-xds-test"]
            assert ok["node_cluster"] == EXT_PROC_CLUSTER and ok["mode"] == "delta" and ok["group"] == EXT_PROC_CLUSTER
            assert ok["types"]["eds"]["in_sync"] is True and ok["types"]["eds"]["last_nack"] is None
            nacker = by_node["envoy-nacker"]
            assert nacker["mode"] == "sotw" and nacker["node_cluster"] == "inferlb"
            nack = nacker["types"]["eds"]["last_nack"]
            assert nack["message"] == "bad EDS for testing: weight too heavy"
            assert nack["version"] and nacker["types"]["eds"]["nack_count"] >= 1
            assert nacker["types"]["eds"]["in_sync"] is False

    asyncio.run(scenario())


# --- restarts -------------------------------------------------------------------------------------------


def test_operator_state_survives_a_restart(tmp_path: Path) -> None:
    static = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    registered = f"10.20.30.40:{free_port()}"
    data = tmp_path / "data"
    with running_control_plane(tmp_path, endpoints=static, data_dir=data) as cp:
        admin = Admin(cp)
        admin.ok("POST", "/v1/endpoints", 201, json={"address": "10.20.30.40", "port": int(registered.split(":")[1])})
        admin.ok("PUT", f"/v1/endpoints/{registered}/weight", json={"weight": 42})
        admin.ok("PUT", f"/v1/endpoints/{static[0]}/weight", json={"weight": 900})
        admin.ok("POST", f"/v1/endpoints/{static[1]}/drain")
        admin.ok("PUT", "/v1/policy", json={"weight": {"name": "equal"},
                                            "pick": {"name": "least_outstanding", "params": {"d": 2}}})
        before = {i: (e["source"], e["draining"], e["weight"]["pinned"]) for i, e in admin.endpoints().items()}
        policy_before = admin.ok("GET", "/v1/policy")
    with running_control_plane(tmp_path, endpoints=static, data_dir=data) as cp:
        admin = Admin(cp)
        after = {i: (e["source"], e["draining"], e["weight"]["pinned"]) for i, e in admin.endpoints().items()}
        assert after == before == {registered: ("api", False, 42), static[0]: ("static", False, 900),
                                   static[1]: ("static", True, None)}
        policy_after = admin.ok("GET", "/v1/policy")
        assert policy_after["weight"] == policy_before["weight"] == {"name": "equal", "params": {}}
        assert policy_after["pick"]["name"] == "least_outstanding" and policy_after["pick"]["params"]["d"] == 2
        # a deregistration is remembered too
        admin.ok("DELETE", f"/v1/endpoints/{registered}", 202)
        admin.ok("DELETE", f"/v1/endpoints/{static[0]}/weight")
    with running_control_plane(tmp_path, endpoints=static, data_dir=data) as cp:
        endpoints = Admin(cp).endpoints()
        assert set(endpoints) == set(static)
        assert endpoints[static[0]]["weight"]["pinned"] is None and endpoints[static[1]]["draining"] is True


# --- the store failing at run time ----------------------------------------------------------------------


def test_a_failing_store_answers_503_and_changes_nothing(tmp_path: Path) -> None:
    """In process (the app on httpx's ASGI transport): a commit that fails leaves the state as it was."""
    from control_plane.admin import AdminService, create_admin_app
    from control_plane.auth import AdminToken
    from control_plane.config import ControlPlaneConfig
    from control_plane.controller import Controller
    from control_plane.metrics import ControlPlaneMetrics
    from control_plane.store import Store, StoreError
    from control_plane.xds import SnapshotCache

    class BrokenStore(Store):
        async def _acall(self, fn: Any) -> Any:
            raise StoreError(f"{self.path}: disk I/O error")

    async def scenario() -> None:
        config = ControlPlaneConfig(endpoints=["127.0.0.1:8101"])
        controller = Controller(config, SnapshotCache())
        await controller.start()
        store = Store.open(tmp_path)
        store.__class__ = BrokenStore
        try:
            service = AdminService(controller, store)
            app = create_admin_app(controller, ControlPlaneMetrics(lambda: controller.state), service,
                                   AdminToken("t" * 40, "config"))
            headers = {"Authorization": "Bearer " + "t" * 40}
            before = controller.state
            policy_before = controller.policy
            transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 12345))
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
                for method, path, body in [
                    ("PUT", "/v1/endpoints/127.0.0.1:8101/weight", {"weight": 9}),
                    ("POST", "/v1/endpoints/127.0.0.1:8101/drain", None),
                    ("POST", "/v1/endpoints", {"address": "10.0.0.2", "port": 2}),
                    ("PUT", "/v1/policy", {"weight": {"name": "equal"}, "pick": {"name": "round_robin"}}),
                ]:
                    response = await client.request(method, path, json=body, headers=headers)
                    error = assert_error(response, 503, "store_unavailable")
                    assert "disk I/O error" not in response.text and "log" in error["detail"]["store"]
                assert (await client.get("/v1/endpoints")).status_code == 200
            assert controller.state == before and controller.policy is policy_before
        finally:
            store.__class__ = Store
            store.close()
            await controller.stop()

    asyncio.run(scenario())
