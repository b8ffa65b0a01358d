"""The admin token cannot run code: the policy allowlist through the real control plane and ext_proc.

Before: ``PUT /v1/policy {"weight": {"name": "os:system", "params": {"command": ...}}}`` answered 400 after
running the command, and the same spec as a pick policy was stored, sent in EDS and run by every ext_proc.
Now only built-ins, installed entry points and ``module:attribute`` specs under the operator's allowed
module prefixes can be named, in each service, at every door: the API, the store at restart, EDS.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from .stack import ControlPlane, ExtProc, http, running_control_plane, running_ext_proc, sample, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.servers]

STICKY = "examples.policies.sticky_session:SessionAffinity"
# The sticky-session scorer added to the default chain: a pick policy that names a user plugin.
STICKY_CHAIN = {"name": "least_completion_time", "params": {"seed": 1, "scorers": [{"plugin": STICKY}]}}
CANARY = "examples.policies.canary_weights:CanaryWeightPolicy"
ALLOW_EXAMPLES = {"INFERLB_CP_ALLOWED_POLICY_MODULES": "examples.policies"}


def put_policy(cp: ControlPlane, body: dict[str, Any] | bytes) -> httpx.Response:
    headers = {"authorization": f"Bearer {cp.admin_token()}", "content-type": "application/json"}
    with http() as client:
        if isinstance(body, bytes):
            return client.put(f"{cp.admin_url}/v1/policy", content=body, headers=headers)
        return client.put(f"{cp.admin_url}/v1/policy", json=body, headers=headers)


def active_policy(cp: ControlPlane) -> dict[str, Any]:
    with http() as client:
        response = client.get(f"{cp.admin_url}/v1/policy")
    response.raise_for_status()
    return response.json()


def test_the_admin_api_refuses_code_it_was_not_allowed_to_load(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with running_control_plane(tmp_path, endpoints=["127.0.0.1:9"]) as cp:
        for kind in ("weight", "pick"):
            response = put_policy(cp, {kind: {"name": "os:system", "params": {"command": f"touch {marker}"}}})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "unknown_policy"
            assert "not under a module prefix the operator allows" in error["message"] or \
                "is not allowed" in error["message"]
            assert "allowed: built in" in error["message"]
            assert error["detail"]["allowed_module_prefixes"] == []
            assert error["detail"]["available"]  # the built-ins, by name
        assert not marker.exists()
        # An allowed prefix is needed for an example policy too: named, it is refused the same way.
        assert put_policy(cp, {"weight": {"name": CANARY, "params": {"endpoint": "127.0.0.1:9"}}}).status_code == 400
        assert active_policy(cp)["weight"]["name"] == "capacity"


def test_nan_in_policy_params_is_a_400(tmp_path: Path) -> None:
    """Before: NaN (which Python's JSON reader takes) in params got a 500."""
    with running_control_plane(tmp_path, endpoints=["127.0.0.1:9"]) as cp:
        for body in (b'{"weight": {"name": "capacity", "params": {"max_step": NaN}}}',
                     b'{"pick": {"name": "least_completion_time", "params": {"weight_exponent": Infinity}}}',
                     b'{"weight": {"name": "equal", "params": {"nested": [1, -Infinity]}}}'):
            response = put_policy(cp, body)
            assert response.status_code == 400, (body, response.text)
            assert response.json()["error"]["code"] == "invalid_json"
        assert active_policy(cp)["weight"]["name"] == "capacity"  # and nothing changed


def test_a_stored_policy_no_longer_allowed_is_refused_at_restart(tmp_path: Path) -> None:
    data_dir = tmp_path / "cp-data"
    with running_control_plane(tmp_path, endpoints=["127.0.0.1:9"], data_dir=data_dir, env=ALLOW_EXAMPLES) as cp:
        response = put_policy(cp, {"weight": {"name": CANARY, "params": {"endpoint": "127.0.0.1:9"}},
                                   "pick": STICKY_CHAIN})
        assert response.status_code == 200, response.text
        assert active_policy(cp)["weight"]["name"] == "canary"
    # The same store, without the allowance: both are refused (logged), the defaults run, the service is up.
    with running_control_plane(tmp_path, endpoints=["127.0.0.1:9"], data_dir=data_dir) as cp:
        active = active_policy(cp)
        assert active["weight"]["name"] == "capacity" and active["pick"]["name"] == "least_completion_time"
        log = cp.proc.log_path.read_text()
        assert "stored weight policy not applied" in log and "stored pick policy not applied" in log


def test_ext_proc_refuses_a_pick_spec_it_does_not_allow_and_keeps_its_policy(tmp_path: Path) -> None:
    """The control plane allows the example (and sends it in EDS); one ext_proc replica allows it too and
    switches, the other does not: it refuses, counts the refusal and keeps its current policy."""
    with running_control_plane(tmp_path, endpoints=["127.0.0.1:9"], env=ALLOW_EXAMPLES) as cp, \
            running_ext_proc(tmp_path, xds_port=cp.xds_port, node_id="ext-proc-strict") as strict, \
            running_ext_proc(tmp_path, xds_port=cp.xds_port, node_id="ext-proc-allowing",
                             env={"INFERLB_EXT_PROC_ALLOWED_POLICY_MODULES": "examples.policies"}) as allowing:
        response = put_policy(cp, {"pick": STICKY_CHAIN})
        assert response.status_code == 200, response.text

        def switches(ext_proc: ExtProc, result: str) -> float:
            return sample(ext_proc.metrics(), "inferlb_ext_proc_policy_switches_total", result=result) or 0.0

        procs = [cp.proc, strict.proc, allowing.proc]
        wait_for(lambda: switches(allowing, "switched") == 1, 30, "the allowing replica to switch", procs)
        wait_for(lambda: switches(strict, "rejected") == 1, 30, "the strict replica to refuse", procs)
        assert switches(strict, "switched") == 0
        assert "is not under a module prefix the operator allows" in strict.proc.log_path.read_text()
        # Refused once, not on every EDS update that repeats it; the strict replica still serves its default.
        assert switches(strict, "rejected") == 1
