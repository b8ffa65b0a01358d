"""Property-based: schemathesis generates requests from the admin API's own ``/openapi.json``
and sends them to a running ``python -m control_plane`` (mutations with the token).

It must find no 5xx, no response that breaks its own documented schema, no
undocumented status code and no wrong content type. Bounded (a few dozen
examples per operation, fixed seed, no example database) to stay well under a
minute on two cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from .conftest import free_port
from .stack import ControlPlane, http, running_control_plane, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.servers]

CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    log_dir: Path = tmp_path_factory.mktemp("schemathesis")
    # Two static endpoints nothing listens on: ids that exist (so some generated paths hit them) without workers.
    with running_control_plane(log_dir, endpoints=[f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"],
                               scrape_interval_s=1.0) as cp:
        yield cp
        assert cp.proc.alive()
        assert "Traceback" not in cp.proc.log(), cp.proc.tail(6)


@pytest.fixture(scope="module")
def admin_schema(control_plane: ControlPlane) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{control_plane.admin_url}/openapi.json")


# Listed here (not collected from the schema at import time: the server is not up then);
# a test below checks that this list is every operation the schema has.
OPERATIONS = [
    ("GET", "/v1/endpoints"), ("POST", "/v1/endpoints"),
    ("GET", "/v1/endpoints/{endpoint_id}"), ("DELETE", "/v1/endpoints/{endpoint_id}"),
    ("PUT", "/v1/endpoints/{endpoint_id}/weight"), ("DELETE", "/v1/endpoints/{endpoint_id}/weight"),
    ("POST", "/v1/endpoints/{endpoint_id}/drain"), ("DELETE", "/v1/endpoints/{endpoint_id}/drain"),
    ("GET", "/v1/policy"), ("PUT", "/v1/policy"),
    ("GET", "/v1/xds/clients"), ("GET", "/v1/dataplane"),
    ("POST", "/v1/api-keys"), ("GET", "/v1/api-keys"),
    ("GET", "/v1/api-keys/{key_id}"), ("DELETE", "/v1/api-keys/{key_id}"),
    ("GET", "/v1/usage"),
    ("GET", "/v1/models"), ("GET", "/v1/rollouts"),
    ("GET", "/v1/rollouts/{alias}"), ("PUT", "/v1/rollouts/{alias}"), ("DELETE", "/v1/rollouts/{alias}"),
    ("POST", "/v1/rollouts/{alias}/rollback"),
    ("GET", "/healthz"), ("GET", "/readyz"),
]


def control_plane_endpoints(cp: ControlPlane) -> list[str]:
    with http() as client:
        return sorted(e["id"] for e in client.get(f"{cp.admin_url}/v1/endpoints").json()["endpoints"])


def created_key(cp: ControlPlane) -> str:
    with http() as client:
        response = client.post(f"{cp.admin_url}/v1/api-keys", json={"tenant": "fuzzed"},
                               headers={"Authorization": f"Bearer {cp.admin_token()}"})
        assert response.status_code == 201, response.text
        return response.json()["id"]


def created_rollout(cp: ControlPlane) -> str:
    """A rollout with a previous split (forced: nothing serves its versions here), so GET, DELETE and rollback
    get past the 404 and the 409."""
    alias = "fuzzed-alias"
    with http() as client:
        for versions in ({"fuzzed-v1": 100}, {"fuzzed-v1": 50, "fuzzed-v2": 50}):
            response = client.put(f"{cp.admin_url}/v1/rollouts/{alias}", params={"force": "true"},
                                  json={"versions": versions}, headers={"Authorization": f"Bearer {cp.admin_token()}"})
            assert response.status_code == 200, response.text
    return alias


def test_the_list_covers_every_operation(admin_schema: schemathesis.BaseSchema) -> None:
    found = {(op.ok().method.upper(), op.ok().path) for op in admin_schema.get_all_operations()}
    assert found - {("GET", "/metrics")} == set(OPERATIONS)


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_the_admin_api_keeps_its_own_schema(method: str, path: str, admin_schema: schemathesis.BaseSchema,
                                            control_plane: ControlPlane) -> None:
    operation = admin_schema[path][method]
    # valid requests, valid ones on an endpoint that exists, and requests that break the schema
    # (those must get a documented 4xx)
    strategies = [operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE)]
    if "{endpoint_id}" in path:
        existing = control_plane_endpoints(control_plane)
        strategies += [operation.as_strategy(GenerationMode.POSITIVE, path_parameters={"endpoint_id": e})
                       for e in existing]
    if "{key_id}" in path:  # a key that exists, so GET and DELETE get past the 404
        strategies.append(operation.as_strategy(GenerationMode.POSITIVE,
                                                path_parameters={"key_id": created_key(control_plane)}))
    if "{alias}" in path:
        strategies.append(operation.as_strategy(GenerationMode.POSITIVE,
                                                path_parameters={"alias": created_rollout(control_plane)}))
    strategy = st.one_of(strategies)
    headers = {"Authorization": f"Bearer {control_plane.admin_token()}"}

    @given(case=strategy)
    @settings(max_examples=40, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    def check(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=control_plane.admin_url, headers=headers, checks=CHECKS, timeout=10)

    check()


def test_the_control_plane_is_healthy_after_the_fuzzing(control_plane: ControlPlane) -> None:
    with http() as client:
        wait_for(lambda: client.get(f"{control_plane.admin_url}/readyz").status_code == 200, 10, "readiness")
        assert client.get(f"{control_plane.admin_url}/v1/endpoints").status_code == 200
