"""The gateway cache end to end (issue 16): a real worker serving two MiniLM versions, the control plane,
ext_proc and Envoy. Envoy really sends a miss's response body when ext_proc asks for it (mode_override), and
the hit is ext_proc's ImmediateResponse: the same bytes (vectors and usage), and the worker never sees it. The
shared level: a real redis-server between two ext_proc replicas."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from inferlb_runtime.model_routing import MODEL_HEADER

from .conftest import WorkerProcess, free_port, running_worker
from .stack import (
    ControlPlane,
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
pytest_plugins = ("tests.redis_server",)  # the redis_url fixture (a real redis-server)

FAMILY = "all-MiniLM-L6-v2"
INT8, FP32 = f"{FAMILY}-int8", f"{FAMILY}-fp32"


class Stack:
    def __init__(self, worker: WorkerProcess, cp: ControlPlane, ext_proc: ExtProc) -> None:
        self.worker, self.cp, self.ext_proc = worker, cp, ext_proc

    def embed(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
        with http() as client:
            return client.post(f"http://127.0.0.1:{self.cp.listener_port}/v1/embeddings", json=body,
                               headers=headers or {}, timeout=30)

    def worker_requests(self) -> float:
        with http() as client:
            samples = prometheus_samples(client.get(f"{self.worker.url}/metrics").text)
        return sum(v for (name, _), v in samples.items() if name == "inferlb_worker_model_requests_total")


@pytest.fixture(scope="module")
def stack(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("cache")
    ext_proc_port = free_port()
    with ExitStack() as es:
        worker = es.enter_context(running_worker(data_dir, log_dir, "--models", f"{INT8},{FP32}"))
        wid = worker.url.removeprefix("http://")
        cp = es.enter_context(running_control_plane(log_dir, endpoints=[wid], ext_proc_port=ext_proc_port))
        ext_proc = es.enter_context(running_ext_proc(log_dir, xds_port=cp.xds_port, port=ext_proc_port,
                                                     node_id="ext-proc-cache",
                                                     env={"INFERLB_EXT_PROC_CACHE_MAX_BYTES": str(64 << 20)}))
        envoy = es.enter_context(running_envoy(log_dir, xds_port=cp.xds_port, node_id="envoy-cache"))
        s = Stack(worker, cp, ext_proc)
        wait_for(lambda: envoy.healthy_hosts() == {wid}, 30, "Envoy to see the worker healthy",
                 [cp.proc, ext_proc.proc, envoy.proc])

        def versions_known() -> bool:  # ext_proc resolves versions once the control plane scraped the worker
            with http() as client:
                response = client.get(f"http://127.0.0.1:{cp.listener_port}/v1/models")
            return response.status_code == 200 and FP32 in {m["id"] for m in response.json().get("data", [])}

        wait_for(versions_known, 30, "the catalogue through Envoy", [cp.proc, ext_proc.proc, envoy.proc])
        yield s


def test_a_repeated_question_is_answered_by_the_gateway_with_the_workers_own_answer(stack: Stack) -> None:
    body = {"model": INT8, "input": ["the cache remembers", "what it was told"]}
    first = stack.embed(body)
    assert first.status_code == 200, first.text
    assert first.headers["x-inferlb-cache"] == "miss" and first.headers[MODEL_HEADER] == INT8
    before = stack.worker_requests()

    again = stack.embed({"input": body["input"], "model": INT8})  # the same question, keys in another order
    assert again.status_code == 200, again.text
    assert again.headers["x-inferlb-cache"] == "hit" and again.headers[MODEL_HEADER] == INT8
    assert again.headers["content-type"] == first.headers["content-type"]
    assert again.content == first.content  # the same vectors and the same usage, byte for byte
    assert again.json()["usage"] == first.json()["usage"] and again.json()["model"] == INT8
    assert stack.worker_requests() == before  # the worker never saw it

    bypass = stack.embed(body, {"cache-control": "no-cache"})
    assert bypass.status_code == 200 and bypass.headers["x-inferlb-cache"] == "miss"
    assert bypass.json()["data"] == first.json()["data"]
    assert stack.worker_requests() == before + 1

    other = stack.embed({"model": FP32, "input": body["input"]})  # another version: its own answer
    assert other.status_code == 200 and other.headers["x-inferlb-cache"] == "miss"
    assert other.headers[MODEL_HEADER] == FP32 and other.json()["model"] == FP32
    assert stack.worker_requests() == before + 2

    samples = stack.ext_proc.metrics()
    assert sample(samples, "inferlb_ext_proc_cache_requests_total", level="memory", result="hit") == 1
    assert sample(samples, "inferlb_ext_proc_cache_requests_total", level="memory", result="bypass") == 1
    assert sample(samples, "inferlb_ext_proc_cache_requests_total", level="memory", result="miss") == 2
    assert sample(samples, "inferlb_ext_proc_cache_bytes", level="memory") > len(first.content)


def test_errors_and_no_store_answers_are_never_served_from_the_cache(stack: Stack) -> None:
    bad = {"model": INT8, "input": "", "encoding_format": "no-such-format"}
    for _ in range(2):
        response = stack.embed(bad)
        assert response.status_code == 400 and response.headers["x-inferlb-cache"] == "miss"
    body = {"model": INT8, "input": "never kept"}
    before = stack.worker_requests()
    for _ in range(2):
        response = stack.embed(body, {"cache-control": "no-store"})
        assert response.status_code == 200 and response.headers["x-inferlb-cache"] == "miss"
    assert stack.worker_requests() == before + 2


def test_the_shared_level_answers_what_another_replica_stored(data_dir: Path, redis_url: str,
                                                             tmp_path: Path) -> None:
    """Replica one stores a miss in Redis; replica two, started afresh on the same port (its own level empty),
    answers the same question from Redis: through real Envoy, and the worker never sees it."""
    ext_proc_port = free_port()
    env = {"INFERLB_EXT_PROC_CACHE_MAX_BYTES": str(64 << 20), "INFERLB_EXT_PROC_CACHE_STORE": redis_url,
           "INFERLB_EXT_PROC_CACHE_STORE_TIMEOUT_MS": "1000"}
    with ExitStack() as es:
        worker = es.enter_context(running_worker(data_dir, tmp_path, "--models", INT8))
        wid = worker.url.removeprefix("http://")
        cp = es.enter_context(running_control_plane(tmp_path, endpoints=[wid], ext_proc_port=ext_proc_port))
        envoy = es.enter_context(running_envoy(tmp_path, xds_port=cp.xds_port, node_id="envoy-shared-cache"))
        body = {"model": INT8, "input": "one replica tells another"}
        with running_ext_proc(tmp_path, xds_port=cp.xds_port, port=ext_proc_port, node_id="ext-proc-one",
                              env=env) as one:
            s = Stack(worker, cp, one)
            wait_for(lambda: envoy.healthy_hosts() == {wid}, 30, "Envoy to see the worker healthy",
                     [cp.proc, one.proc, envoy.proc])
            first = wait_for(lambda: (r := s.embed(body)).status_code == 200 and r.headers.get(MODEL_HEADER) == INT8
                             and r, 30, "a first answer from the int8 version", [cp.proc, one.proc, envoy.proc])
            assert first.headers["x-inferlb-cache"] == "miss"
            wait_for(lambda: sample(one.metrics(), "inferlb_ext_proc_cache_bytes", level="redis"), 15,
                     "the answer stored in Redis", [one.proc])
        before = s.worker_requests()
        with running_ext_proc(tmp_path, xds_port=cp.xds_port, port=ext_proc_port, node_id="ext-proc-two",
                              env=env) as two:
            hit = s.embed(body)
            assert hit.status_code == 200 and hit.headers["x-inferlb-cache"] == "hit", hit.text
            assert hit.content == first.content
            assert s.worker_requests() == before
            samples = two.metrics()
            assert sample(samples, "inferlb_ext_proc_cache_requests_total", level="redis", result="hit") == 1
            assert sample(samples, "inferlb_ext_proc_cache_requests_total", level="memory", result="miss") == 1
