"""Routing by model end to end (issue 15): real Envoy, control plane, ext_proc and simulated workers.

Two workers say what they serve in their /metrics (one serves both versions, int8 first; the other int8
only); the control plane scrapes that into ext_proc's rich EDS, and a rollout set on its admin API reaches
ext_proc on the same EDS. Through Envoy: ``GET /v1/models`` is ext_proc's answer (the whole fleet, the
rollout's split); an unknown model is ext_proc's 404 and no worker counts a request; a rollout alias that
the first worker would serve with int8 is served with fp32, which only the x-inferlb-model header ext_proc
sets can make it do.

No fixed sleeps: every wait polls a condition against a deadline.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Iterator

import httpx
import pytest

from .conftest import free_port
from .stack import (
    Gateway,
    SimWorker,
    http,
    running_control_plane,
    running_envoy,
    running_ext_proc,
    running_sim_workers,
    sample,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy]

INT8, FP32 = "all-MiniLM-L6-v2-int8", "all-MiniLM-L6-v2-fp32"
FAMILY, ST = "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"
MODEL_HEADER = "x-inferlb-model"
ENDPOINT_HEADER = "x-inferlb-endpoint"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    log_dir = tmp_path_factory.mktemp("models-envoy")
    ext_proc_port = free_port()
    with ExitStack() as stack:
        both = stack.enter_context(running_sim_workers(log_dir, 1, args=["--models", f"{INT8},{FP32}"]))
        int8 = stack.enter_context(running_sim_workers(log_dir, 1, args=["--models", INT8]))
        workers = [*both, *int8]
        cp = stack.enter_context(running_control_plane(log_dir, endpoints=[w.id for w in workers],
                                                       ext_proc_port=ext_proc_port))
        ext_proc = stack.enter_context(running_ext_proc(log_dir, xds_port=cp.xds_port, port=ext_proc_port,
                                                        node_id="ext-proc-models"))
        envoy = stack.enter_context(running_envoy(log_dir, xds_port=cp.xds_port, node_id="envoy-models"))
        g = Gateway(workers, cp, ext_proc, envoy)
        wait_for(lambda: envoy.healthy_hosts() == g.ids, 30, "Envoy to see every worker healthy", g.procs)
        wait_for(lambda: {INT8, FP32} <= listed(g), 30, "ext_proc to list what the workers serve", g.procs)
        yield g


def listed(g: Gateway) -> set[str]:
    """The model ids GET /v1/models answers through Envoy (empty until ext_proc answers it itself)."""
    with http() as client:
        response = client.get(g.url("/v1/models"))
    if response.status_code != 200 or ENDPOINT_HEADER in response.headers:  # a worker's own list
        return set()
    return {m["id"] for m in response.json()["data"]}


def post(g: Gateway, body: dict) -> httpx.Response:
    with http() as client:
        return client.post(g.url(), json=body, timeout=30)


def worker_requests(worker: SimWorker) -> float:
    """Every embeddings request the worker answered, whatever its status."""
    return sum(v for (name, _), v in worker.metrics().items() if name == "inferlb_worker_requests_total")


def test_get_v1_models_through_envoy_is_the_whole_fleets_list(gateway: Gateway) -> None:
    with http() as client:
        response = client.get(gateway.url("/v1/models"))
    assert response.status_code == 200, response.text
    assert ENDPOINT_HEADER not in response.headers  # ext_proc answered: no worker was picked
    models = {m["id"]: m for m in response.json()["data"]}
    assert {INT8, FP32, FAMILY, ST} <= set(models)
    assert models[INT8]["inferlb"] == {"kind": "version", "routable_endpoints": 2}
    assert models[FP32]["inferlb"] == {"kind": "version", "routable_endpoints": 1}
    assert all(m["object"] == "model" for m in models.values())


def test_an_unknown_model_is_ext_procs_404_and_no_worker_sees_it(gateway: Gateway) -> None:
    before = [worker_requests(w) for w in gateway.workers]
    response = post(gateway, {"model": "text-embedding-3-small", "input": "hello"})
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert (error["code"], error["type"], error["param"]) == ("model_not_found", "invalid_request_error", "model")
    assert "text-embedding-3-small" in error["message"] and FP32 in error["message"]
    assert [worker_requests(w) for w in gateway.workers] == before
    assert (sample(gateway.ext_proc.metrics(), "inferlb_ext_proc_model_requests_total", model="other",
                   code_class="4xx") or 0) >= 1


def test_the_version_ext_proc_chooses_reaches_the_worker_in_its_header(gateway: Gateway) -> None:
    both = gateway.workers[0]
    # Without a rollout the alias goes to either worker, served by its first version with it: int8.
    response = post(gateway, {"model": FAMILY, "input": "hello"})
    assert response.status_code == 200 and response.json()["model"] == INT8, response.text
    put = gateway.admin("PUT", f"/v1/rollouts/{FAMILY}", {"versions": {FP32: 100}, "sticky": "none"})
    assert put.status_code == 200, put.text
    try:
        wait_for(lambda: post(gateway, {"model": FAMILY, "input": "switch"}).json().get("model") == FP32, 30,
                 "the blue-green switch to reach ext_proc", gateway.procs)
        served_before = sample(both.metrics(), "inferlb_worker_model_requests_total", model=FP32, code="200") or 0
        for _ in range(5):
            response = post(gateway, {"model": FAMILY, "input": "blue-green"})
            assert response.status_code == 200, response.text
            # The worker serving both would answer the alias with int8: only ext_proc's header makes it fp32.
            assert response.json()["model"] == FP32
            assert response.headers[MODEL_HEADER] == FP32
            assert response.headers[ENDPOINT_HEADER] == both.id
        assert sample(both.metrics(), "inferlb_worker_model_requests_total", model=FP32, code="200") == \
            served_before + 5
        metrics = gateway.ext_proc.metrics()
        assert (sample(metrics, "inferlb_ext_proc_model_requests_total", model=FP32, code_class="2xx") or 0) >= 5
        assert (sample(metrics, "inferlb_ext_proc_model_response_seconds_count", model=FP32) or 0) >= 5
        assert (sample(metrics, "inferlb_ext_proc_model_decisions_total", model=FP32) or 0) >= 5
    finally:
        gateway.admin("DELETE", f"/v1/rollouts/{FAMILY}")


def test_a_post_to_a_path_the_fleet_does_not_serve_is_404_not_found_whatever_its_model(gateway: Gateway) -> None:
    """The route is checked before the model: a chat request for a served model and for an unknown one get
    the same 404 ``not_found`` (it was the worker's not_found for one, the gateway's model_not_found for the
    other), and no worker sees either."""
    before = sum(worker_requests(w) for w in gateway.workers)
    with http() as client:
        answers = [client.post(gateway.url("/v1/chat/completions"), json={"model": model, "messages": []}, timeout=30)
                   for model in (INT8, "no-such-model")]
    for response in answers:
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "not_found"
        assert "/v1/chat/completions" in response.json()["error"]["message"]
    assert sum(worker_requests(w) for w in gateway.workers) == before
