"""Issue 15 end to end: two real workers serving two real model versions, the control plane, ext_proc and Envoy.

Worker A serves MiniLM int8 only; worker B serves int8 and fp32. Every request goes through Envoy, so
what is checked is what a client sees: the catalogue (GET /v1/models), routing by model and alias,
the gateway's 404 for an unknown model (no worker touched), a sticky canary whose every decision is
known in advance (``sticky_bucket`` is deterministic), a blue-green switch and its rollback, and the
per-version metrics an operator compares them with.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from inferlb_runtime.model_routing import MODEL_HEADER, Rollout, sticky_bucket

from .conftest import WorkerProcess, free_port, running_worker
from .stack import (
    ControlPlane,
    Envoy,
    ExtProc,
    http,
    prometheus_samples,
    running_control_plane,
    running_envoy,
    running_ext_proc,
    sample,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy, pytest.mark.model]

FAMILY = "all-MiniLM-L6-v2"
INT8, FP32 = f"{FAMILY}-int8", f"{FAMILY}-fp32"
EXT_PROC_NODE = "ext-proc-models"


class Stack:
    def __init__(self, a: WorkerProcess, b: WorkerProcess, cp: ControlPlane, ext_proc: ExtProc, envoy: Envoy) -> None:
        self.a, self.b, self.cp, self.ext_proc, self.envoy = a, b, cp, ext_proc, envoy

    def url(self, path: str = "/v1/embeddings") -> str:
        return f"http://127.0.0.1:{self.cp.listener_port}{path}"

    def embed(self, model: str | None, **extra: Any) -> httpx.Response:
        body: dict[str, Any] = {"input": "the canary sings at dawn", **extra}
        if model is not None:
            body["model"] = model
        with http() as client:
            return client.post(self.url(), json=body, timeout=30)

    def admin(self, method: str, path: str, body: Any = None) -> httpx.Response:
        with http() as client:
            return client.request(method, f"{self.cp.admin_url}{path}", json=body,
                                  headers={"authorization": f"Bearer {self.cp.admin_token()}"})

    def rollout(self, versions: dict[str, float], sticky: str = "none") -> None:
        response = self.admin("PUT", f"/v1/rollouts/{FAMILY}", {"versions": versions, "sticky": sticky})
        assert response.status_code == 200, response.text
        self.wait_applied()

    def wait_applied(self) -> None:
        """Until ext_proc has ACKed the EDS the control plane serves now (a rollout change is published
        before its admin call returns, so that EDS carries it)."""
        def in_sync() -> bool:
            clients = self.admin("GET", "/v1/xds/clients").json()["clients"]
            eds = [c["types"].get("eds", {}) for c in clients if c["node_id"] == EXT_PROC_NODE]
            return bool(eds) and all(t.get("in_sync") for t in eds)

        wait_for(in_sync, 15, "ext_proc to ACK the change", [self.cp.proc, self.ext_proc.proc])

    def served_by(self, model: str | None, **extra: Any) -> str:
        response = self.embed(model, **extra)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == response.headers[MODEL_HEADER]  # body and header agree
        return response.headers[MODEL_HEADER]

    def worker_requests(self, worker: WorkerProcess) -> float:
        """Every request the worker has answered, over its models (its own /metrics)."""
        with http() as client:
            samples = prometheus_samples(client.get(f"{worker.url}/metrics").text)
        return sum(v for (name, _), v in samples.items() if name == "inferlb_worker_model_requests_total")


@pytest.fixture(scope="module")
def stack(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("model-pools")
    ext_proc_port = free_port()
    with ExitStack() as es:
        a = es.enter_context(running_worker(data_dir, log_dir, "--models", INT8))
        b = es.enter_context(running_worker(data_dir, log_dir, "--models", f"{INT8},{FP32}"))
        ids = [w.url.removeprefix("http://") for w in (a, b)]
        cp = es.enter_context(running_control_plane(log_dir, endpoints=ids, ext_proc_port=ext_proc_port))
        ext_proc = es.enter_context(running_ext_proc(log_dir, xds_port=cp.xds_port, port=ext_proc_port,
                                                     node_id=EXT_PROC_NODE))
        envoy = es.enter_context(running_envoy(log_dir, xds_port=cp.xds_port, node_id="envoy-models"))
        s = Stack(a, b, cp, ext_proc, envoy)
        wait_for(lambda: envoy.healthy_hosts() == set(ids), 30, "Envoy to see both workers healthy",
                 [cp.proc, ext_proc.proc, envoy.proc])

        def catalogue() -> dict | None:
            with http() as client:
                response = client.get(s.url("/v1/models"))
            ids = {m["id"] for m in response.json().get("data", [])} if response.status_code == 200 else set()
            return response.json() if {INT8, FP32, FAMILY} <= ids else None

        wait_for(catalogue, 30, "GET /v1/models through Envoy to list both versions",
                 [cp.proc, ext_proc.proc, envoy.proc])
        yield s


def test_the_fleet_lists_what_it_serves_through_envoy(stack: Stack) -> None:
    with http() as client:
        body = client.get(stack.url("/v1/models")).json()
    ids = {m["id"] for m in body["data"]}
    assert body["object"] == "list"
    assert {INT8, FP32, FAMILY, f"sentence-transformers/{FAMILY}"} <= ids
    # The operator's view (admin API) names who serves what.
    versions = {m["id"]: m for m in stack.admin("GET", "/v1/models").json()["models"]}
    a, b = (w.url.removeprefix("http://") for w in (stack.a, stack.b))
    assert {e["id"] for e in versions[INT8]["endpoints"]} == {a, b}
    assert [e["id"] for e in versions[FP32]["endpoints"]] == [b]
    assert FAMILY in versions[FP32]["aliases"] and versions[FP32]["routable"]


def test_a_version_is_served_only_where_it_is_loaded(stack: Stack) -> None:
    before_a = stack.worker_requests(stack.a)
    for _ in range(6):
        assert stack.served_by(FP32) == FP32
    assert stack.worker_requests(stack.a) == before_a  # worker A has no fp32: it saw none of them
    assert stack.served_by(INT8) == INT8
    assert stack.served_by(f"sentence-transformers/{FAMILY}") in (INT8, FP32)


def test_fp32_and_int8_are_two_real_models(stack: Stack) -> None:
    int8 = stack.embed(INT8).json()["data"][0]["embedding"]
    fp32 = stack.embed(FP32).json()["data"][0]["embedding"]
    assert len(int8) == len(fp32) == 384
    assert int8 != fp32  # quantisation moves every vector a little
    dot = sum(x * y for x, y in zip(int8, fp32))
    assert dot > 0.9  # ...but they are the same model family (vectors are unit length)


def test_an_unknown_model_gets_404_at_the_gateway_without_touching_a_worker(stack: Stack) -> None:
    before = stack.worker_requests(stack.a) + stack.worker_requests(stack.b)
    response = stack.embed("no-such-model")
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and "no-such-model" in error["message"]
    assert error["param"] == "model"
    assert stack.worker_requests(stack.a) + stack.worker_requests(stack.b) == before


def test_a_sticky_canary_sends_each_user_where_its_bucket_says(stack: Stack) -> None:
    split = {INT8: 70.0, FP32: 30.0}
    stack.rollout(split, sticky="user")
    try:
        expected_rollout = Rollout(FAMILY, tuple(split.items()), "user")
        seen = {}
        for i in range(40):
            user = f"user-{i}"
            want = expected_rollout.choose(sticky_bucket(FAMILY, user))
            got = stack.served_by(FAMILY, user=user)
            assert got == want, user
            assert stack.served_by(FAMILY, user=user) == want  # the same user again: the same version
            seen[user] = got
        assert set(seen.values()) == {INT8, FP32}
        with http() as client:
            metrics = prometheus_samples(client.get(f"{stack.ext_proc.metrics_url}/metrics").text)
        assert any(name == "inferlb_ext_proc_model_requests_total" and dict(labels).get("model") == FP32 and value > 0
                   for (name, labels), value in metrics.items())
    finally:
        stack.admin("DELETE", f"/v1/rollouts/{FAMILY}")
        stack.wait_applied()


def test_blue_green_switch_and_rollback(stack: Stack) -> None:
    stack.rollout({INT8: 100.0})
    try:
        assert {stack.served_by(FAMILY) for _ in range(5)} == {INT8}
        stack.rollout({FP32: 100.0})  # the switch: worker A (int8 only) no longer gets the family's requests
        assert {stack.served_by(FAMILY) for _ in range(8)} == {FP32}
        rolled_back = stack.admin("POST", f"/v1/rollouts/{FAMILY}/rollback")
        assert rolled_back.status_code == 200, rolled_back.text
        assert rolled_back.json()["versions"] == {INT8: 100.0}
        assert rolled_back.json()["previous"]["versions"] == {FP32: 100.0}
        stack.wait_applied()
        assert {stack.served_by(FAMILY) for _ in range(5)} == {INT8}
        with http() as client:
            samples = prometheus_samples(client.get(f"{stack.ext_proc.metrics_url}/metrics").text)
        assert sample(samples, "inferlb_ext_proc_model_requests_total", model=FP32, code_class="2xx")
    finally:
        stack.admin("DELETE", f"/v1/rollouts/{FAMILY}")
        stack.wait_applied()
