"""Operator request stages added by configuration, through Envoy, ext_proc and simulated workers.

ext_proc runs two stages from its configuration (``INFERLB_EXT_PROC_STAGES``, the environment form of
``[[ext_proc.stages]]``): the documented example ``examples.stages.max_inputs:MaxInputs`` and a stage that
always raises. The example refuses what it should in OpenAI's error shape; the broken one is skipped and
counted, and every other request is served as if it were not there.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from typing import Iterator

import httpx
import pytest

from .conftest import free_port
from .stack import (
    http,
    running_control_plane,
    running_envoy,
    running_ext_proc,
    running_sim_workers,
    sample,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy]

BROKEN = "operator:tests.stage_fakes:AlwaysRaisesFake"
STAGES = [{"plugin": "examples.stages.max_inputs:MaxInputs", "params": {"max_inputs": 2}, "before": "cache"},
          {"plugin": "tests.stage_fakes:AlwaysRaisesFake"}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, object, list]]:
    log_dir = tmp_path_factory.mktemp("operator-stages")
    ext_proc_port = free_port()
    with ExitStack() as stack:
        workers = stack.enter_context(running_sim_workers(log_dir, 2))
        cp = stack.enter_context(running_control_plane(log_dir, endpoints=[w.id for w in workers],
                                                       ext_proc_port=ext_proc_port))
        ext_proc = stack.enter_context(running_ext_proc(
            log_dir, xds_port=cp.xds_port, port=ext_proc_port, node_id="ext-proc-stages",
            env={"INFERLB_EXT_PROC_STAGES": json.dumps(STAGES),
                 "INFERLB_EXT_PROC_ALLOWED_POLICY_MODULES": "examples.stages,tests.stage_fakes"}))
        envoy = stack.enter_context(running_envoy(log_dir, xds_port=cp.xds_port, node_id="envoy-stages"))
        procs = [cp.proc, ext_proc.proc, envoy.proc, *(w.proc for w in workers)]
        ids = {w.id for w in workers}
        wait_for(lambda: envoy.healthy_hosts() == ids, 30, "Envoy to see every worker healthy", procs)
        wait_for(lambda: sample(ext_proc.metrics(), "inferlb_ext_proc_routable_endpoints") == len(ids), 30,
                 "ext_proc to see every worker routable", procs)
        yield cp.listener_port, ext_proc, procs


def post(port: int, body: dict) -> httpx.Response:
    with http() as client:
        return client.post(f"http://127.0.0.1:{port}/v1/embeddings", json=body, timeout=30)


def test_a_configured_stage_refuses_what_it_should_in_openais_shape(gateway: tuple[int, object, list]) -> None:
    port, _, _ = gateway
    response = post(port, {"model": "all-MiniLM-L6-v2", "input": ["one", "two", "three"]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["type"], error["param"]) == ("too_many_inputs", "invalid_request_error", "input")
    assert "at most 2" in error["message"]


def test_a_failing_stage_is_skipped_and_counted_and_the_request_is_served(gateway: tuple[int, object, list]) -> None:
    port, ext_proc, _ = gateway
    failures = sample(ext_proc.metrics(), "inferlb_ext_proc_stage_failures_total", stage=BROKEN) or 0.0
    for i in range(3):
        response = post(port, {"model": "all-MiniLM-L6-v2", "input": [f"served despite a broken stage {i}"]})
        assert response.status_code == 200, response.text
        assert len(response.json()["data"]) == 1
    after = sample(ext_proc.metrics(), "inferlb_ext_proc_stage_failures_total", stage=BROKEN)
    assert after == failures + 3
