"""Admin API security (issue 20 item 3), against a running ``python -m control_plane``:

- the token is checked on EVERY mutation: each route of the app's own ``/openapi.json`` (plus the dashboard's
  routes, which the schema leaves out), each mutating method, sent with no token and with wrong ones, gets
  401 in the API's error shape, and the operator state is unchanged afterwards;
- the token appears in none of the answers (error bodies and headers included) nor in the control plane's
  log (stdout and stderr, captured across the whole run: wrong-token attempts, validation errors, 404s).

Schemathesis over every operation with the token is ``tests/test_admin_schemathesis.py``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import free_port
from .stack import ControlPlane, http, running_control_plane

pytestmark = [pytest.mark.slow, pytest.mark.servers]

MUTATIONS = ("POST", "PUT", "PATCH", "DELETE")
# Routes outside /openapi.json (include_in_schema=False): the dashboard's page, assets and feed.
UNLISTED = ("/dashboard", "/dashboard/static/{name}", "/dashboard/api/snapshot", "/dashboard/events")
ALIAS = "secured-alias"
HINT = 8  # how much of the token counts as its prefix: it must not show either


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    log_dir: Path = tmp_path_factory.mktemp("admin-security")
    with running_control_plane(log_dir, endpoints=[f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"],
                               scrape_interval_s=1.0) as cp:
        yield cp


def token_headers(cp: ControlPlane) -> dict[str, str]:
    return {"authorization": f"Bearer {cp.admin_token()}"}


def operator_state(cp: ControlPlane) -> dict[str, Any]:
    """What an operator's mutation can change: endpoints (set, pins, drains, removals), the policies, the API
    keys and the rollouts. (Telemetry and computed weights move on their own: left out.)"""
    with http() as client:
        def get(path: str) -> Any:
            response = client.get(f"{cp.admin_url}{path}", headers=token_headers(cp))
            assert response.status_code == 200, (path, response.text)
            return response.json()
        endpoints = sorted((e["id"], e["source"], e["draining"], e["removing"], e["weight"]["pinned"])
                           for e in get("/v1/endpoints")["endpoints"])
        policy = get("/v1/policy")
        keys = get("/v1/api-keys?include_revoked=true")
        rollouts = get("/v1/rollouts")
    return {"endpoints": endpoints, "weight": policy["weight"], "pick": policy["pick"], "keys": keys,
            "rollouts": rollouts}


def routes(cp: ControlPlane) -> list[str]:
    """Every path the app serves: its OpenAPI document's, and the unlisted dashboard's."""
    with http() as client:
        schema = client.get(f"{cp.admin_url}/openapi.json").json()
    return sorted(schema["paths"]) + list(UNLISTED)


def concrete(path: str, existing: dict[str, str]) -> str:
    """A template's parameters filled with things that exist (so a missing check could really change them)."""
    return re.sub(r"\{(\w+)(?::path)?\}", lambda m: existing.get(m.group(1), "x"), path)


def wrong_tokens(token: str) -> list[dict[str, str]]:
    """No header, and headers that are near misses of the real one (never it)."""
    return [{}, {"authorization": "Bearer not-the-token"}, {"authorization": f"Bearer {token}x"},
            {"authorization": f"Bearer {token[:-1]}"}, {"authorization": f"Bearer {token[:HINT]}"},
            {"authorization": f"Basic {token}"}, {"authorization": token}, {"authorization": "Bearer"},
            {"x-admin-token": token}]


def test_every_mutation_needs_the_token(control_plane: ControlPlane) -> None:
    cp = control_plane
    with http() as client:  # things that exist, so that an unchecked mutation would change state
        key = client.post(f"{cp.admin_url}/v1/api-keys", json={"tenant": "secured"}, headers=token_headers(cp))
        assert key.status_code == 201, key.text
        for versions in ({"secured-v1": 100}, {"secured-v1": 50, "secured-v2": 50}):
            put = client.put(f"{cp.admin_url}/v1/rollouts/{ALIAS}", params={"force": "true"},
                             json={"versions": versions}, headers=token_headers(cp))
            assert put.status_code == 200, put.text
        endpoint = client.get(f"{cp.admin_url}/v1/endpoints").json()["endpoints"][0]["id"]
    existing = {"endpoint_id": endpoint, "key_id": key.json()["id"], "alias": ALIAS, "name": "dashboard.js"}
    # a body that would be a valid change of each kind, so a missing check could not hide behind a 422
    body = {"address": "127.0.0.1", "port": free_port(), "weight": 7, "tenant": "intruder",
            "versions": {"secured-v1": 100}, "weight_policy": {"name": "static"}}

    before = operator_state(cp)
    tried = 0
    with http() as client:
        for path in routes(cp):
            url = f"{cp.admin_url}{concrete(path, existing)}"
            for method in MUTATIONS:
                for headers in wrong_tokens(cp.admin_token()):
                    response = client.request(method, url, json=body, headers=headers)
                    tried += 1
                    if path.startswith("/v1/"):
                        assert response.status_code == 401, (method, path, headers, response.text)
                        error = response.json()["error"]
                        assert error["code"] == "unauthorized" and error["message"], response.text
                        assert response.headers["www-authenticate"].startswith("Bearer"), response.headers
                    else:  # probes and the dashboard take no mutation at all
                        assert response.status_code == 405, (method, path, response.status_code, response.text)
            for headers in wrong_tokens(cp.admin_token()):
                if path.startswith(("/v1/api-keys", "/v1/usage")):  # reads that need the token anyway
                    response = client.get(url, headers=headers)
                    assert response.status_code == 401, (path, headers, response.text)
    assert tried >= len(MUTATIONS) * 20
    assert operator_state(cp) == before


def test_the_token_is_in_no_answer_and_no_log_line(control_plane: ControlPlane) -> None:
    cp = control_plane
    token = cp.admin_token()
    secrets = (token, token[:HINT])
    answers: list[httpx.Response] = []
    with http() as client:
        for headers in wrong_tokens(token):  # wrong tokens, on a mutation and on a guarded read
            answers.append(client.post(f"{cp.admin_url}/v1/endpoints", json={"address": "x"}, headers=headers))
            answers.append(client.get(f"{cp.admin_url}/v1/api-keys", headers=headers))
        good = token_headers(cp)
        answers += [  # errors with the right token: validation, bad JSON, unknown things, a bad policy
            client.post(f"{cp.admin_url}/v1/endpoints", content=b"{not json", headers=good),
            client.post(f"{cp.admin_url}/v1/endpoints", json={"port": "many"}, headers=good),
            client.get(f"{cp.admin_url}/v1/endpoints/nowhere:1", headers=good),
            client.delete(f"{cp.admin_url}/v1/api-keys/key_missing", headers=good),
            client.put(f"{cp.admin_url}/v1/policy", json={"weight": {"name": "no-such-policy"}}, headers=good),
            client.get(f"{cp.admin_url}/v1/usage?from=yesterday", headers=good),
            client.get(f"{cp.admin_url}/no/such/path", headers=good),
        ]
        answers.append(client.get(f"{cp.admin_url}/metrics"))
        answers.append(client.get(f"{cp.admin_url}/dashboard/api/snapshot"))
    assert {r.status_code for r in answers} >= {400, 401, 404, 422}, [r.status_code for r in answers]
    for response in answers:
        shown = response.text + "".join(f"{k}: {v}\n" for k, v in response.headers.items())
        for secret in secrets:
            assert secret not in shown, (response.request.method, response.request.url, response.status_code)
    log = cp.proc.log()
    assert log.strip(), cp.proc.log_path  # there is a log to search
    for secret in secrets:
        assert secret not in log, [line for line in log.splitlines() if secret in line][:3]
