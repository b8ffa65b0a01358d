"""The admin API answers only Hosts it knows (issue 41: DNS rebinding), against a running ``python -m control_plane``.

A browser tricked by a rebound name sends that name in ``Host``: every route,
open reads, tenant data, the dashboard's data and mutations with a valid
token alike, refuses it with 400 ``host_not_allowed`` in the API's error
shape, and changes nothing. localhost, IP addresses (loopback ones included,
with or without a port) and the names in ``admin_allowed_hosts`` are
answered as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from control_plane.config import ControlPlaneConfig
from control_plane.host_allowlist import AllowedHosts, host_name

from .conftest import free_port
from .stack import ControlPlane, http, running_control_plane

pytestmark = [pytest.mark.slow, pytest.mark.servers]

PUBLIC_NAME = "cp.example.test"
FOREIGN = ("rebound.attacker.example", "rebound.attacker.example:8080", "localhost.attacker.example",
           "cp.example.test.attacker.example", "127.0.0.1.nip.io")


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    log_dir: Path = tmp_path_factory.mktemp("admin-hosts")
    with running_control_plane(log_dir, endpoints=[f"127.0.0.1:{free_port()}"], scrape_interval_s=1.0,
                               env={"INFERLB_CP_ADMIN_ALLOWED_HOSTS": f"{PUBLIC_NAME}, other.example.test"}) as cp:
        yield cp


@pytest.mark.parametrize("host", FOREIGN)
@pytest.mark.parametrize("path", ["/v1/endpoints", "/v1/policy", "/v1/xds/clients", "/dashboard/api/snapshot",
                                  "/healthz", "/v1/api-keys"])
def test_a_foreign_host_is_refused_on_every_route(control_plane: ControlPlane, host: str, path: str) -> None:
    with http() as client:
        response = client.get(f"{control_plane.admin_url}{path}", headers={"host": host})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"status", "code", "message", "detail"}
    assert (error["status"], error["code"]) == (400, "host_not_allowed")
    assert "admin_allowed_hosts" in error["message"]


def test_a_foreign_host_cannot_mutate_even_with_the_token(control_plane: ControlPlane) -> None:
    port = free_port()
    with http() as client:
        url = f"{control_plane.admin_url}/v1/endpoints"
        headers = {"authorization": f"Bearer {control_plane.admin_token()}"}
        body = {"address": "127.0.0.1", "port": port}
        refused = client.post(url, json=body, headers={**headers, "host": FOREIGN[0]})
        listed = client.get(url).json()["endpoints"]
        accepted = client.post(url, json=body, headers=headers)  # the same request, from a known Host
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "host_not_allowed"
    assert f"127.0.0.1:{port}" not in {e["id"] for e in listed}
    assert accepted.status_code == 201, accepted.text


@pytest.mark.parametrize("host", [None, "127.0.0.1", "localhost", "LOCALHOST.", "[::1]", "::1", "10.1.2.3",
                                  PUBLIC_NAME, "CP.Example.Test.", "other.example.test"])
def test_loopback_addresses_and_configured_names_are_answered(control_plane: ControlPlane, host: str | None
                                                              ) -> None:
    port = control_plane.admin_url.rsplit(":", 1)[1]
    with http() as client:
        for value in ([None] if host is None else [host, f"{host}:{port}"] if host != "::1" else [host]):
            headers = {} if value is None else {"host": value}
            response = client.get(f"{control_plane.admin_url}/v1/endpoints", headers=headers)
            assert response.status_code == 200, (value, response.text)
            assert "endpoints" in response.json()


def test_the_host_rule_parses_ports_and_brackets() -> None:
    assert [host_name(h) for h in ("[::1]:8080", "[::1]", "LocalHost:80", "a.b.:1", "a.b")] == \
        ["[::1]", "[::1]", "localhost", "a.b", "a.b"]
    allowed = AllowedHosts.of(["cp.example.test"])
    assert allowed.allows("cp.example.test:443") and allowed.allows("192.0.2.1:80") and allowed.allows(None)
    assert not allowed.allows("example.test") and not allowed.allows("[not-an-ip]:80")
    assert AllowedHosts.of(["*"]).allows("anything.example")


@pytest.mark.parametrize("entry", ["http://cp.example", "cp.example:8080", "cp.example/path", "", "a b"])
def test_a_malformed_allowed_host_is_refused_at_start(entry: str) -> None:
    with pytest.raises(ValidationError, match="admin_allowed_hosts"):
        ControlPlaneConfig(admin_allowed_hosts=[entry])


def test_allowed_hosts_come_from_the_environment_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERLB_CP_ADMIN_ALLOWED_HOSTS", "A.example, b.example.")
    assert ControlPlaneConfig().admin_allowed_hosts == ["a.example", "b.example"]
