"""Models and rollouts on the admin API (issue 15), through real HTTP to ``python -m control_plane``.

The control plane scrapes two simulated workers' /metrics (stdlib HTTP servers in this process serving
a worker's metric families plus the issue-15 info metrics): one serves the int8 and fp32 versions, the
other int8 only, in another pool. Through the API: GET /v1/models; PUT, GET, rollback (and a rollback
of the rollback), DELETE of a rollout; the 422/409/404/401 answers; the rollouts and their previous
splits after a restart; and ext_proc's EDS (an ADS client in ext_proc's node group) carrying the
rollout after a PUT and a rollback, while the Envoys' EDS carries no metadata at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf import json_format

from control_plane.type_urls import ENDPOINT
from inferlb_runtime.model_routing import decode_rollouts

from .conftest import free_port
from .stack import ControlPlane, running_control_plane, wait_for
from .test_admin_api import EXT_PROC_CLUSTER, Admin, assert_error
from .test_telemetry import FakeWorkerMetrics
from .xds_client import DeltaClient, SotwClient

pytestmark = [pytest.mark.slow, pytest.mark.servers]

FAMILY = "all-MiniLM-L6-v2"
INT8, FP32 = f"{FAMILY}-int8", f"{FAMILY}-fp32"
HF_ALIAS = f"sentence-transformers/{FAMILY}"
ALIASES = f"{FAMILY},{HF_ALIAS}"


def info_lines(models: list[str], pool: str) -> str:
    lines = ["# TYPE inferlb_worker_model_info gauge"]
    lines += [f'inferlb_worker_model_info{{model="{m}",family="{FAMILY}",aliases="{ALIASES}"}} 1' for m in models]
    lines += ["# TYPE inferlb_worker_pool_info gauge", f'inferlb_worker_pool_info{{pool="{pool}"}} 1', ""]
    return "\n".join(lines)


@contextlib.contextmanager
def simulated_worker_metrics(text: str) -> Iterator[str]:
    """A simulated worker's /metrics (fixed text) on 127.0.0.1:<free port>; yields its endpoint id."""
    body = text.encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            if self.path != "/metrics":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, name="simulated worker metrics", daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@contextlib.contextmanager
def model_fleet(log_dir: Path, data_dir: Path | None = None) -> Iterator[tuple[ControlPlane, str, str]]:
    """(control plane, the both-versions worker, the int8-only worker), once the catalogue is scraped."""
    metrics = FakeWorkerMetrics().text()
    with simulated_worker_metrics(metrics + info_lines([INT8, FP32], "default")) as both, \
            simulated_worker_metrics(metrics + info_lines([INT8], "small")) as small, \
            running_control_plane(log_dir, endpoints=[both, small], data_dir=data_dir) as cp:
        admin = Admin(cp)
        wait_for(lambda: len(admin.ok("GET", "/v1/models")["models"]) == 2, 15, "the models to be scraped")
        yield cp, both, small


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ControlPlane, str, str]]:
    with model_fleet(tmp_path_factory.mktemp("rollouts-admin")) as stack:
        yield stack


@pytest.fixture()
def admin(fleet: tuple[ControlPlane, str, str]) -> Iterator[Admin]:
    """The admin API; every rollout a test leaves is deleted after it."""
    admin = Admin(fleet[0])
    try:
        yield admin
    finally:
        for r in admin.ok("GET", "/v1/rollouts")["rollouts"]:
            admin.ok("DELETE", f"/v1/rollouts/{r['alias']}")


CANARY = {"versions": {INT8: 90, FP32: 10}, "sticky": "api_key"}
HALF = {"versions": {INT8: 50, FP32: 50}, "sticky": "none"}


def test_models_say_what_the_fleet_serves(admin: Admin, fleet: tuple[ControlPlane, str, str]) -> None:
    _, both, small = fleet
    catalogue = admin.ok("GET", "/v1/models")
    assert catalogue == {"rollouts": [], "models": [
        {"id": FP32, "aliases": [FAMILY, HF_ALIAS], "routable": True,
         "endpoints": [{"id": both, "routable": True, "pool": "default"}]},
        {"id": INT8, "aliases": [FAMILY, HF_ALIAS], "routable": True,
         "endpoints": sorted([{"id": both, "routable": True, "pool": "default"},
                              {"id": small, "routable": True, "pool": "small"}], key=lambda e: e["id"])},
    ]}
    admin.ok("POST", f"/v1/endpoints/{both}/drain")
    try:
        fp32 = admin.ok("GET", "/v1/models")["models"][0]
        assert fp32["id"] == FP32 and fp32["routable"] is False and fp32["endpoints"][0]["routable"] is False
    finally:
        admin.ok("DELETE", f"/v1/endpoints/{both}/drain")


def test_put_get_rollback_and_delete(admin: Admin) -> None:
    created = admin.ok("PUT", f"/v1/rollouts/{FAMILY}", json=CANARY)
    assert created == {"alias": FAMILY, "versions": {INT8: 90.0, FP32: 10.0}, "sticky": "api_key",
                       "previous": None, "unserved": []}
    assert list(created["versions"]) == [INT8, FP32]  # the order given: buckets are cut in it
    assert admin.ok("GET", f"/v1/rollouts/{FAMILY}") == created
    assert admin.ok("PUT", f"/v1/rollouts/{FAMILY}", json=CANARY) == created  # the same split: nothing changes
    moved = admin.ok("PUT", f"/v1/rollouts/{FAMILY}", json=HALF)
    assert moved["versions"] == {INT8: 50.0, FP32: 50.0} and moved["sticky"] == "none"
    assert moved["previous"] == {"versions": {INT8: 90.0, FP32: 10.0}, "sticky": "api_key"}
    back = admin.ok("POST", f"/v1/rollouts/{FAMILY}/rollback")
    assert (back["versions"], back["sticky"]) == (created["versions"], "api_key")
    assert back["previous"] == {"versions": {INT8: 50.0, FP32: 50.0}, "sticky": "none"}
    forward = admin.ok("POST", f"/v1/rollouts/{FAMILY}/rollback")  # a rollback of a rollback goes forward
    assert forward == moved
    # an alias with a '/' in it, a blue-green switch
    green = admin.ok("PUT", f"/v1/rollouts/{HF_ALIAS}", json={"versions": {FP32: 100}})
    assert green["alias"] == HF_ALIAS and green["sticky"] == "none"
    listed = admin.ok("GET", "/v1/rollouts")["rollouts"]
    assert [r["alias"] for r in listed] == [FAMILY, HF_ALIAS] and listed[0] == forward
    assert admin.ok("GET", "/v1/models")["rollouts"] == listed
    assert admin.ok("DELETE", f"/v1/rollouts/{FAMILY}") == forward
    assert_error(admin.get(f"/v1/rollouts/{FAMILY}"), 404, "rollout_not_found")
    assert_error(admin.call("DELETE", f"/v1/rollouts/{FAMILY}"), 404, "rollout_not_found")
    assert_error(admin.call("POST", f"/v1/rollouts/{FAMILY}/rollback"), 404, "rollout_not_found")
    assert [r["alias"] for r in admin.ok("GET", "/v1/rollouts")["rollouts"]] == [HF_ALIAS]


def test_bad_rollouts_are_refused_saying_why_and_change_nothing(admin: Admin) -> None:
    path = f"/v1/rollouts/{FAMILY}"
    for body, fragment in [
        ({"versions": {INT8: 90, FP32: 20}}, "sum to 100"),
        ({"versions": {INT8: 100, FP32: 0}}, "greater than 0"),
        ({"versions": {}}, "at least 1"),
        ({"versions": {INT8: "100"}}, "valid number"),
        ({"versions": {INT8: 100}, "sticky": "session"}, "'none', 'api_key' or 'user'"),
        ({"versions": {"bad name": 100}}, "pattern"),
        ({"versions": {INT8: 100}, "extra": 1}, "Extra inputs"),
    ]:
        error = assert_error(admin.call("PUT", path, json=body), 422, "validation_error")
        assert fragment in error["message"] + str(error["detail"]), (body, error)
    assert_error(admin.call("PUT", "/v1/rollouts/bad%20alias", json=CANARY), 422, "validation_error")
    # control characters in the alias, a newline too (it used to match no route: a bare 404)
    for alias in ("a%0Ab", "a%0Db", "x%0A", "a%00b", "a/%0A/b"):
        for method, suffix in (("PUT", ""), ("GET", ""), ("DELETE", ""), ("POST", "/rollback")):
            error = assert_error(admin.call(method, f"/v1/rollouts/{alias}{suffix}", json=CANARY), 422,
                                 "validation_error")
            assert "pattern" in str(error["detail"]), (method, alias, error)
    assert_error(admin.call("PUT", path, content=b"{not json", headers={"content-type": "application/json"}), 400,
                 "invalid_json")
    typo = assert_error(admin.call("PUT", path, json={"versions": {INT8: 90, "all-MiniLM-L6-v2-f32": 10}}), 409,
                        "version_not_served")
    assert "'all-MiniLM-L6-v2-f32'" in typo["message"] and typo["detail"]["unserved"] == ["all-MiniLM-L6-v2-f32"]
    assert_error(admin.call("PUT", f"/v1/rollouts/{INT8}", json={"versions": {FP32: 100}}), 409, "alias_is_a_version")
    assert_error(admin.call("PUT", path, json=CANARY, token=None), 401, "unauthorized")
    assert_error(admin.call("PUT", path, json=CANARY, token="wrong"), 401, "unauthorized")
    assert admin.ok("GET", "/v1/rollouts") == {"rollouts": []}  # none of it changed anything

    forced = admin.ok("PUT", path, params={"force": "true"}, json={"versions": {INT8: 90, f"{FAMILY}-v3": 10}})
    assert forced["unserved"] == [f"{FAMILY}-v3"]
    assert_error(admin.call("POST", f"{path}/rollback"), 409, "no_previous_split")


def _rollouts_in_eds(client: DeltaClient) -> dict | None:
    """The locality's inferlb.rollouts of the newest EDS ext_proc's node group got (None before any)."""
    eds = client.of_type(ENDPOINT)
    cla = eds[-1].resources().get("workers") if eds else None
    if cla is None or not cla.endpoints:
        return None
    meta = json_format.MessageToDict(cla.endpoints[0].metadata.filter_metadata["inferlb"])
    return meta.get("rollouts")


def test_ext_procs_eds_carries_the_rollout_after_a_put_and_a_rollback(
        admin: Admin, fleet: tuple[ControlPlane, str, str]) -> None:
    cp, both, small = fleet

    async def watch() -> None:
        address = f"127.0.0.1:{cp.xds_port}"
        async with DeltaClient(address, "ext-proc-rollouts-test", EXT_PROC_CLUSTER) as ext_proc, \
                SotwClient(address, "envoy-rollouts-test", "inferlb") as envoy:
            await ext_proc.subscribe(ENDPOINT, ["workers"])
            await envoy.subscribe(ENDPOINT, ["workers"])
            first = await ext_proc.wait_for(lambda: None if (r := _rollouts_in_eds(ext_proc)) is None else (r,))
            assert first == ({},)  # present, empty
            (locality,) = ext_proc.of_type(ENDPOINT)[-1].resources()["workers"].endpoints
            served = {lb.metadata.filter_metadata["inferlb"].fields["id"].string_value:
                      json_format.MessageToDict(lb.metadata.filter_metadata["inferlb"]) for lb in locality.lb_endpoints}
            assert (served[both]["models"], served[both]["model_aliases"], served[both]["pool"]) == \
                ([FP32, INT8], [FAMILY, HF_ALIAS], "default")
            assert (served[small]["models"], served[small]["pool"]) == ([INT8], "small")

            await asyncio.to_thread(admin.ok, "PUT", f"/v1/rollouts/{FAMILY}", json=CANARY)
            seen = await ext_proc.wait_for(lambda: (r := _rollouts_in_eds(ext_proc)) and r)
            rollout = decode_rollouts(seen)[FAMILY]
            assert rollout.versions == ((INT8, 90.0), (FP32, 10.0)) and rollout.sticky == "api_key"
            await asyncio.to_thread(admin.ok, "PUT", f"/v1/rollouts/{FAMILY}", json=HALF)
            await ext_proc.wait_for(lambda: (r := _rollouts_in_eds(ext_proc)) and r != seen)
            await asyncio.to_thread(admin.ok, "POST", f"/v1/rollouts/{FAMILY}/rollback")
            rolled_back = await ext_proc.wait_for(lambda: (r := _rollouts_in_eds(ext_proc)) == seen and r)
            assert decode_rollouts(rolled_back)[FAMILY] == rollout
            await asyncio.to_thread(admin.ok, "DELETE", f"/v1/rollouts/{FAMILY}")
            await ext_proc.wait_for(lambda: _rollouts_in_eds(ext_proc) == {})
            # the Envoys' EDS: no metadata anywhere, whatever the rollouts
            (lean,) = (await envoy.wait_for(lambda: envoy.of_type(ENDPOINT)))[-1].resources()["workers"].endpoints
            assert not lean.HasField("metadata") and not any(lb.HasField("metadata") for lb in lean.lb_endpoints)

    asyncio.run(asyncio.wait_for(watch(), 60))


def test_rollouts_and_their_previous_splits_survive_a_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with model_fleet(tmp_path, data) as (cp, _, _):
        admin = Admin(cp)
        admin.ok("PUT", f"/v1/rollouts/{FAMILY}", json=CANARY)
        before = admin.ok("PUT", f"/v1/rollouts/{FAMILY}", json=HALF)
        green = admin.ok("PUT", f"/v1/rollouts/{HF_ALIAS}", json={"versions": {FP32: 100}, "sticky": "user"})
    with model_fleet(tmp_path, data) as (cp, _, _):
        admin = Admin(cp)
        assert admin.ok("GET", "/v1/rollouts")["rollouts"] == [before, green]
        back = admin.ok("POST", f"/v1/rollouts/{FAMILY}/rollback")
        assert back["versions"] == {INT8: 90.0, FP32: 10.0} and back["previous"]["versions"] == before["versions"]
        admin.ok("DELETE", f"/v1/rollouts/{HF_ALIAS}")
    with model_fleet(tmp_path, data) as (cp, _, _):
        assert Admin(cp).ok("GET", "/v1/rollouts")["rollouts"] == [back]
