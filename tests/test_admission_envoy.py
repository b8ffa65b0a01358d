"""Shedding and deadlines through the real wire: Envoy, the control plane, ext_proc and simulated workers.

"Over the SLO" is made certain rather than timed: the operator sets an SLO of a microsecond through the
admin API, which every predicted completion exceeds, so every sheddable request is shed and the test
needs no load. What it proves is the path: the class header read by ext_proc behind Envoy, the 429 with
Retry-After in OpenAI's shape answered without a worker, critical and standard requests served, and a
bad class header refused with a 400 before any worker sees it.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from .stack import http, running_gateway, sample, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy]

OBJECTIVE = "x-gateway-inference-objective"


def test_sheddable_requests_are_shed_over_the_slo_and_critical_ones_served(tmp_path: Path) -> None:
    with running_gateway(tmp_path, workers=2, name="admission") as gw:
        ext_proc, procs, ids, url = gw.ext_proc, gw.procs, gw.ids, gw.url()

        def post(objective: str | None, **headers: str) -> httpx.Response:
            if objective is not None:
                headers[OBJECTIVE] = objective
            with http() as client:
                return client.post(url, json={"input": "a sentence"}, headers=headers, timeout=30)

        def served_by_ext_proc() -> bool:
            response = post("sheddable")
            return response.status_code == 200 and response.headers.get("x-inferlb-endpoint") in ids

        # The default SLO (2 s) is far above an idle fleet's predicted completion: sheddable is served.
        wait_for(served_by_ext_proc, 30, "a sheddable request to be served on an idle fleet", procs)
        response = gw.admin("PUT", "/v1/policy", {"pick": {"name": "least_completion_time",
                                                            "params": {"slo_ms": 0.001}}})
        assert response.status_code == 200, response.text
        switched = lambda: sample(ext_proc.metrics(), "inferlb_ext_proc_policy_switches_total",  # noqa: E731
                                  result="switched") == 1
        wait_for(switched, 30, "ext_proc to take the 1 us SLO", procs)

        shed = post("sheddable")
        assert shed.status_code == 429, shed.text
        assert int(shed.headers["retry-after"]) >= 1
        assert shed.headers["content-type"] == "application/json"
        error = shed.json()["error"]
        assert error["code"] == "overloaded" and error["type"] == "server_error" and "SLO" in error["message"]
        assert "x-inferlb-endpoint" not in shed.headers  # no worker saw it
        for objective in ("critical", "standard", None):
            response = post(objective, **{"x-inferlb-timeout-ms": "30000"})
            assert response.status_code == 200, (objective, response.text)
            assert response.headers.get("x-inferlb-endpoint") in ids
        metrics = ext_proc.metrics()
        assert sample(metrics, "inferlb_ext_proc_admit_replies_total", code="overloaded") == 1
        # no quota, cache or subset needs its body: judged at its request headers, Envoy never buffered it
        assert {at: sample(metrics, "inferlb_ext_proc_sheds_total", at=at)
                for at in ("request_headers", "screen", "fair_queue", "decision")} == {
            "request_headers": 1, "screen": 0, "fair_queue": 0, "decision": 0}
        assert sample(metrics, "inferlb_ext_proc_deadline_predictions_total", predicted="met") == 3

        bad = post("urgent")
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert error["code"] == "invalid_header" and OBJECTIVE in error["message"]
        assert sample(ext_proc.metrics(), "inferlb_ext_proc_parse_failures_total", what="request_headers") == 1
