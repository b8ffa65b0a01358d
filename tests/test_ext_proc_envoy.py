"""ext_proc in the real data path: Envoy 1.40 + ``python -m control_plane`` + ``python -m ext_proc`` + workers.

The acceptance list of the ext_proc issue. Every process is real and on free
ports (``tests/stack.py``); the control plane's LDS names the ext_proc port
that ``python -m ext_proc`` listens on. Where each request went is read from
the ``x-inferlb-endpoint`` response header ext_proc adds (its primary pick;
no retries happen here) and from the workers' own ``inputs_total``.

Nothing waits a fixed time and no assertion is about timing: every wait polls
a condition against a deadline, every load loop is bounded by a request count.
"""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from .conftest import WorkerProcess, free_port
from .stack import (
    BackgroundLoad,
    ControlPlane,
    Envoy,
    ExtProc,
    Proc,
    SimWorker,
    http,
    prometheus_samples,
    running_control_plane,
    running_envoy,
    running_ext_proc,
    running_sim_workers,
    sample,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy, pytest.mark.model]

# 256+ words of plain ASCII: one input the model truncates at 256 tokens.
LONG_TEXT = " ".join(["load balancing"] * 150)
ENDPOINT_HEADER = "x-inferlb-endpoint"
COUNTED_HEADER = "x-inferlb-counted-tokens"


def url(port: int, path: str = "/v1/embeddings") -> str:
    return f"http://127.0.0.1:{port}{path}"


def post(port: int, body: dict, timeout: float = 30) -> httpx.Response:
    with http() as client:
        return client.post(url(port), json=body, timeout=timeout)


def ext_metric(ext_proc: ExtProc, name: str, **labels: str) -> float:
    return sample(ext_proc.metrics(), name, **labels) or 0.0


def outstanding_by_endpoint(ext_proc: ExtProc) -> dict[str, float]:
    return {dict(labels)["endpoint"]: value for (name, labels), value in ext_proc.metrics().items()
            if name == "inferlb_ext_proc_outstanding_requests"}


def worker_metric(worker: SimWorker, name: str) -> float:
    with http() as client:
        response = client.get(f"{worker.url}/metrics")
        response.raise_for_status()
    return sample(prometheus_samples(response.text), name) or 0.0


def decisions(ext_proc: ExtProc) -> float:
    return sum(v for (name, _), v in ext_proc.metrics().items() if name == "inferlb_ext_proc_decisions_total")


def picked(response: httpx.Response) -> str | None:
    """ext_proc's pick as it told the client; None when the request went without one."""
    return response.headers.get(ENDPOINT_HEADER)


def ready_through_ext_proc(cp: ControlPlane, envoy: Envoy, ext_proc: ExtProc, ids: set[str],
                           procs: list[Proc]) -> None:
    """Envoy knows every worker healthy, ext_proc sees them routable, and a request gets ext_proc's pick."""
    wait_for(lambda: envoy.healthy_hosts() == ids, 30, "Envoy to see every worker healthy", procs)
    wait_for(lambda: ext_metric(ext_proc, "inferlb_ext_proc_routable_endpoints") == len(ids), 30,
             "ext_proc to see every worker routable", procs)
    wait_for(lambda: (r := post(cp.listener_port, {"input": "warm up"})).status_code == 200 and picked(r) in ids,
             30, "a first 200 picked by ext_proc", procs)


# --- the shared stack: two simulated workers --------------------------------------------------------


@dataclass
class Stack:
    workers: list[SimWorker]
    cp: ControlPlane
    ext_proc: ExtProc
    envoy: Envoy
    ext_proc_port: int
    log_dir: Path
    exits: ExitStack
    front: str

    @property
    def port(self) -> int:
        return self.cp.listener_port

    @property
    def ids(self) -> set[str]:
        return {w.id for w in self.workers}

    @property
    def procs(self) -> list[Proc]:
        return [self.cp.proc, self.ext_proc.proc, self.envoy.proc, *(w.proc for w in self.workers)]

    def wait_idle(self) -> None:
        """No request in flight anywhere (work a previous test abandoned has finished)."""
        wait_for(lambda: all(worker_metric(w, "inferlb_worker_inflight_requests") == 0 for w in self.workers)
                 and self.ext_proc.outstanding() == 0, 30, "every worker and ext_proc to be idle", self.procs)


@pytest.fixture(scope="module", params=[pytest.param("native", marks=pytest.mark.native), "grpcio"])
def stack(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Stack]:
    """The stack, once on each of ext_proc's gRPC fronts: every test here holds for both."""
    log_dir = tmp_path_factory.mktemp(f"ext-proc-envoy-{request.param}")
    ext_proc_port = free_port()
    with ExitStack() as exits:
        workers = exits.enter_context(running_sim_workers(log_dir, 2))
        cp = exits.enter_context(running_control_plane(log_dir, endpoints=[w.id for w in workers],
                                                       ext_proc_port=ext_proc_port))
        ext_proc = exits.enter_context(running_ext_proc(log_dir, xds_port=cp.xds_port, port=ext_proc_port,
                                                        env={"INFERLB_EXT_PROC_GRPC_FRONT": request.param}))
        envoy = exits.enter_context(running_envoy(log_dir, xds_port=cp.xds_port, node_id="envoy-ext-proc"))
        s = Stack(workers, cp, ext_proc, envoy, ext_proc_port, log_dir, exits, request.param)
        ready_through_ext_proc(cp, envoy, ext_proc, s.ids, s.procs)
        yield s


def test_ext_proc_serves_on_the_front_it_was_given_and_says_which(stack: Stack) -> None:
    assert sample(stack.ext_proc.metrics(), "inferlb_ext_proc_grpc_front", front=stack.front) == 1


# --- (a) size-aware: a short request does not queue behind a long one -------------------------------


def test_a_short_request_sent_with_a_long_one_lands_on_the_other_worker(stack: Stack) -> None:
    """While one worker is busy with a long request (64 inputs of 256 tokens, seconds of simulated
    compute), short requests sent at the same time, three at once, all go to the other worker:
    a count-based balancer would put one of every three behind the long request (1-1 in flight)."""
    stack.wait_idle()
    with ThreadPoolExecutor(4) as pool:
        long_request = pool.submit(post, stack.port, {"input": [LONG_TEXT] * 64}, 60)
        busy = wait_for(lambda: next((e for e, n in outstanding_by_endpoint(stack.ext_proc).items() if n == 1), None),
                        15, "ext_proc to account for the long request", stack.procs)
        shorts: list[httpx.Response] = []
        for _ in range(5):  # bounded: rounds that end while the long request is still running count
            round_ = [pool.submit(post, stack.port, {"input": "a short one"}) for _ in range(3)]
            responses = [f.result() for f in round_]
            if long_request.done():
                break
            shorts.extend(responses)
        long_response = long_request.result()
    assert long_response.status_code == 200, long_response.text
    assert picked(long_response) == busy
    assert long_response.json()["usage"]["prompt_tokens"] == 64 * 256
    assert shorts, "the long request finished before any short one was answered"
    for response in shorts:
        assert response.status_code == 200, response.text
        assert picked(response) in stack.ids - {busy}, response.headers


# --- (f) a client that goes away releases its outstanding work -------------------------------------


def test_a_client_that_disconnects_early_releases_its_outstanding_work(stack: Stack) -> None:
    stack.wait_idle()
    early = ext_metric(stack.ext_proc, "inferlb_ext_proc_released_total", how="early")
    body = json.dumps({"input": [LONG_TEXT] * 32}).encode()
    head = (f"POST /v1/embeddings HTTP/1.1\r\nHost: inferlb\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", stack.port), timeout=10) as sock:
        sock.sendall(head + body)
        wait_for(lambda: stack.ext_proc.outstanding() == 1, 15, "ext_proc to count the request as outstanding",
                 stack.procs)
    # The socket is closed before any answer: Envoy resets the request and its ext_proc stream.
    wait_for(lambda: stack.ext_proc.outstanding() == 0, 15, "the outstanding work to be released", stack.procs)
    assert ext_metric(stack.ext_proc, "inferlb_ext_proc_released_total", how="early") == early + 1
    assert ext_metric(stack.ext_proc, "inferlb_ext_proc_outstanding_leaked") == 0


# --- (g) an oversized body is a clear 413 ----------------------------------------------------------


def test_an_oversized_body_gets_413_not_a_hang(stack: Stack) -> None:
    before = decisions(stack.ext_proc)
    oversized = json.dumps({"input": "x" * (4 * 1024 * 1024 + 1024)}).encode()
    with http() as client:
        response = client.post(url(stack.port), content=oversized, headers={"content-type": "application/json"},
                               timeout=30)
    assert response.status_code == 413, response.text
    assert decisions(stack.ext_proc) == before  # never reached a decision
    assert stack.ext_proc.outstanding() == 0
    # Just under the limit still goes through ext_proc: one gRPC message of ~4 MiB, over gRPC's default
    # 4 MiB receive limit with its framing. (JSON whitespace: cheap for the worker to parse.)
    near = b'{"input": "near the limit"' + b" " * (4 * 1024 * 1024 - 64) + b"}"
    with http() as client:
        response = client.post(url(stack.port), content=near, headers={"content-type": "application/json"},
                               timeout=30)
    assert response.status_code == 200, response.text
    assert picked(response) in stack.ids
    assert response.headers[COUNTED_HEADER] == response.headers["x-inferlb-tokens"]


# --- (b) a slow worker gets fewer requests --------------------------------------------------------


def test_a_slow_worker_gets_fewer_requests_than_a_fast_one(stack: Stack) -> None:
    stack.wait_idle()
    slow, fast = stack.workers
    before = {w.id: worker_metric(w, "inferlb_worker_inputs_total") for w in stack.workers}
    slow.set_speed(0.25)
    try:
        total = 160
        body = {"input": " ".join(["the quick brown fox jumps over the lazy dog"] * 6)}  # ~60 tokens
        with BackgroundLoad(url(stack.port), body, concurrency=4, max_requests=total, max_seconds=120) as load:
            wait_for(lambda: load.snapshot().sent >= total, 120, lambda: f"{total} requests: {load.snapshot()}",
                     stack.procs, interval=0.2)
        result = load.snapshot()
    finally:
        slow.set_speed(1.0)
    served = {w.id: worker_metric(w, "inferlb_worker_inputs_total") - before[w.id] for w in stack.workers}
    assert not result.errors and set(result.codes) == {200}, result
    assert sum(served.values()) == result.sent  # (the load may overshoot its bound by a request per thread)
    assert served[slow.id] < served[fast.id], served


# --- (c) fail-open: ext_proc dies under traffic ---------------------------------------------------


def test_traffic_flows_when_ext_proc_is_killed_and_picks_resume_when_it_returns(stack: Stack) -> None:
    stack.wait_idle()
    routed = decisions(stack.ext_proc)
    with BackgroundLoad(url(stack.port), {"input": "fail open"}, concurrency=4, max_requests=400,
                        max_seconds=120) as load:
        wait_for(lambda: load.snapshot().sent >= 60 and decisions(stack.ext_proc) > routed, 60,
                 "traffic picked by ext_proc", stack.procs)
        stack.ext_proc.proc.kill()  # SIGKILL: no goodbye on its streams
        at_kill = load.snapshot().sent
        wait_for(lambda: load.snapshot().sent >= min(400, at_kill + 150), 60, "traffic after the kill",
                 [stack.cp.proc, stack.envoy.proc], interval=0.2)
    result = load.snapshot()
    assert not result.errors, result.errors
    assert set(result.codes) == {200}, result.codes

    # A new ext_proc on the same port: Envoy reconnects and requests get picks again.
    stack.ext_proc = stack.exits.enter_context(running_ext_proc(stack.log_dir, xds_port=stack.cp.xds_port,
                                                                port=stack.ext_proc_port, node_id="ext-proc-2"))
    wait_for(lambda: picked(post(stack.port, {"input": "back"})) in stack.ids, 30,
             "requests picked by the new ext_proc", stack.procs)


# --- (d) no endpoint: 503 with a clear body --------------------------------------------------------


def test_no_endpoints_is_a_503_with_a_clear_body(tmp_path: Path) -> None:
    ext_proc_port = free_port()
    with running_control_plane(tmp_path, endpoints=[], ext_proc_port=ext_proc_port) as cp, \
            running_ext_proc(tmp_path, xds_port=cp.xds_port, port=ext_proc_port) as ext_proc, \
            running_envoy(tmp_path, xds_port=cp.xds_port, node_id="envoy-empty") as envoy:
        procs = [cp.proc, ext_proc.proc, envoy.proc]
        assert ext_metric(ext_proc, "inferlb_ext_proc_endpoints") == 0
        response = wait_for(lambda: (r := post(cp.listener_port, {"input": "anyone?"})).status_code == 503
                            and r.headers.get("content-type") == "application/json" and r, 30,
                            "ext_proc's 503", procs)
        error = response.json()["error"]
        assert error["code"] == "no_endpoint_ready", error
        assert "No inference endpoint is ready" in error["message"] and error["type"] == "server_error"
        with http() as client:  # a request without a body is refused the same way
            models = client.get(url(cp.listener_port, "/v1/models"))
        assert models.status_code == 503 and models.json()["error"]["code"] == "no_endpoint_ready"
        assert ext_metric(ext_proc, "inferlb_ext_proc_fallbacks_total", reason="no_endpoint") >= 2


# --- (e) ext_proc's token count is the worker's usage ------------------------------------------------


def test_tokens_counted_by_ext_proc_equal_the_workers_usage(worker: WorkerProcess, reference: dict,
                                                            tmp_path: Path) -> None:
    worker_id = worker.url.removeprefix("http://")
    ext_proc_port = free_port()
    texts = [item["text"] for item in reference["items"]]
    bodies = [
        {"input": texts[0]},
        {"model": "all-MiniLM-L6-v2", "input": texts},
        {"input": [LONG_TEXT, "Ünïcödé — 東京 🙂 naïve café"]},  # truncation and non-ASCII
        {"input": [[101, 7592, 2088, 102], list(range(1000, 1300))]},  # token arrays, one cut at 256
        {"model": "sentence-transformers/all-MiniLM-L6-v2", "input": "alias of the model", "encoding_format": "base64"},
    ]
    with running_control_plane(tmp_path, endpoints=[worker_id], ext_proc_port=ext_proc_port) as cp, \
            running_ext_proc(tmp_path, xds_port=cp.xds_port, port=ext_proc_port) as ext_proc, \
            running_envoy(tmp_path, xds_port=cp.xds_port, node_id="envoy-tokens") as envoy:
        ready_through_ext_proc(cp, envoy, ext_proc, {worker_id}, [cp.proc, ext_proc.proc, envoy.proc])
        for body in bodies:
            response = post(cp.listener_port, body)
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]["prompt_tokens"]
            assert int(response.headers[COUNTED_HEADER]) == usage, body
            assert int(response.headers["x-inferlb-tokens"]) == usage  # the worker's own header agrees
        assert ext_metric(ext_proc, "inferlb_ext_proc_fallbacks_total", reason="estimated_tokens") == 0
