"""The worker's scheduling, cancellation, deadlines and classes through the real wire: Envoy, the control
plane and ext_proc in front of one worker (a real int8 one; a simulated one where a slot makes the order
plain), so every request lands on that worker.

No assertion is about time. Orders are read from who had answered when another answered; the worker
runs with ``--aging 3600`` so a waiting request never climbs a class during a test, and a deadline
is shown missed by a request that cannot start before a whole large request of a better class ends.
ext_proc's shedding is switched off (``slo_ms`` 0 through the admin API) so that sheddable requests
reach the worker whatever ext_proc predicts.
"""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from inferlb_runtime.pick_chain import DEFAULT_PICK_POLICY

from .conftest import free_port, running_worker
from .stack import (
    ControlPlane,
    ExtProc,
    Proc,
    http,
    prometheus_samples,
    running_control_plane,
    running_envoy,
    running_ext_proc,
    running_sim_workers,
    sample,
    wait_for,
)
from .test_ext_proc_envoy import ready_through_ext_proc
from .test_pick_plugins_envoy import admin

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy, pytest.mark.model]

OBJECTIVE = "x-gateway-inference-objective"
LONG_TEXT = " ".join(["load balancing"] * 150)  # one input the model truncates at 256 tokens
HOG = {"input": [LONG_TEXT] * 64}  # the largest request a worker accepts (16,384 tokens)
# The hogs repeat one text: without the worker cache (and its coalescing) the model computes every copy.
NO_AGING = ("--aging", "3600", "--cache-max-bytes", "0")


@dataclass
class Stack:
    worker_url: str
    port: int  # Envoy's listener
    procs: list[Proc]

    def post(self, body: dict, headers: dict[str, str] | None = None, timeout: float = 120) -> httpx.Response:
        with http() as client:
            # no-store: neither ext_proc's cache nor the worker's may answer a repeated hog (the module's
            # worker also runs without a cache: a hog repeats one text within itself)
            headers = {"Cache-Control": "no-store", **(headers or {})}
            return client.post(f"http://127.0.0.1:{self.port}/v1/embeddings", json=body, headers=headers,
                               timeout=timeout)

    def metric(self, name: str, **labels: str) -> float:
        with http() as client:
            text = client.get(f"{self.worker_url}/metrics").text
        return sample(prometheus_samples(text), name, **labels) or 0.0

    def idle(self) -> None:
        wait_for(lambda: self.metric("inferlb_worker_queue_depth") == 0
                 and self.metric("inferlb_worker_inflight_requests") == 0, 120, "the worker to be idle", self.procs)


def without_shedding(cp: ControlPlane, ext_proc: ExtProc, procs: list[Proc]) -> None:
    """The pick policy's slo_ms set to 0 through the admin API, waited until ext_proc took it."""
    response = admin(cp, "PUT", "/v1/policy", {"pick": {"name": DEFAULT_PICK_POLICY, "params": {"slo_ms": 0}}})
    assert response.status_code == 200, response.text
    wait_for(lambda: sample(ext_proc.metrics(), "inferlb_ext_proc_policy_switches_total", result="switched") == 1,
             30, "ext_proc to take slo_ms 0", procs)


def stack_around(exits: ExitStack, log_dir: Path, worker_id: str, worker_proc: Proc | None) -> Stack:
    """Control plane, ext_proc and Envoy in front of the one worker ``worker_id``, shedding off."""
    ext_proc_port = free_port()
    cp = exits.enter_context(running_control_plane(log_dir, endpoints=[worker_id], ext_proc_port=ext_proc_port))
    # The workers' queues are under test: ext_proc's door lets requests through by count, as before
    # size-aware admission (which would hold them at the door: tests/test_admission_order_envoy.py).
    ext_proc = exits.enter_context(running_ext_proc(log_dir, xds_port=cp.xds_port, port=ext_proc_port, env={
        "INFERLB_EXT_PROC_ADMISSION_ROOM": "requests", "INFERLB_EXT_PROC_EARLY_REFUSAL": "false"}))
    envoy = exits.enter_context(running_envoy(log_dir, xds_port=cp.xds_port, node_id="envoy-worker-classes"))
    procs = [cp.proc, ext_proc.proc, envoy.proc, *([worker_proc] if worker_proc else [])]
    ready_through_ext_proc(cp, envoy, ext_proc, {worker_id}, procs)
    without_shedding(cp, ext_proc, procs)
    return Stack(f"http://{worker_id}", cp.listener_port, procs)


@pytest.fixture(scope="module")
def real(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One real int8 worker (least attained service, no aging) behind the whole stack."""
    log_dir = tmp_path_factory.mktemp("worker-classes-envoy")
    with ExitStack() as exits:
        worker = exits.enter_context(running_worker(data_dir, log_dir, *NO_AGING))
        yield stack_around(exits, log_dir, worker.url.removeprefix("http://"), None)


class Background:
    """Requests sent from threads; ``answered`` lists their names in the order their answers came."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.pool = ThreadPoolExecutor(8)
        self.answered: list[str] = []
        self.responses: dict[str, httpx.Response] = {}
        self._lock = threading.Lock()

    def send(self, name: str, body: dict, headers: dict[str, str] | None = None) -> None:
        def one() -> None:
            response = self.stack.post(body, headers)
            with self._lock:
                self.answered.append(name)
                self.responses[name] = response

        self.pool.submit(one)

    def __enter__(self) -> "Background":
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(wait=True)


# --- (a) a one-sentence request does not wait for the hogs ---------------------------------------------


def test_a_sentence_through_envoy_finishes_before_the_hogs_queued_ahead_of_it(real: Stack) -> None:
    """Before (batches built around the oldest input) the sentence waited for both hogs, 64 batches."""
    real.idle()
    with Background(real) as hogs:
        for i in range(2):
            hogs.send(f"hog{i}", HOG)
        wait_for(lambda: real.metric("inferlb_worker_inflight_requests") == 2, 60, "both hogs to reach the worker",
                 real.procs)
        sentence = real.post({"input": "one short sentence"})
        hogs_answered_first = list(hogs.answered)
    assert sentence.status_code == 200, sentence.text
    assert hogs_answered_first == []
    assert all(r.status_code == 200 for r in hogs.responses.values()) and len(hogs.responses) == 2


# --- (b) a client that leaves through Envoy frees the worker's queue -----------------------------------


def test_a_client_that_disconnects_through_envoy_frees_the_workers_queue(real: Stack) -> None:
    real.idle()
    cancelled = real.metric("inferlb_worker_cancelled_inputs_total")
    body = json.dumps(HOG).encode()
    head = (f"POST /v1/embeddings HTTP/1.1\r\nHost: inferlb\r\nContent-Type: application/json\r\n"
            f"Cache-Control: no-store\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", real.port), timeout=30) as sock:
        sock.sendall(head + body)
        wait_for(lambda: real.metric("inferlb_worker_queue_depth") >= 10, 60, "the hog to queue on the worker",
                 real.procs)
    # closed before any answer: Envoy resets the upstream request, the worker drops the hog's queued inputs
    wait_for(lambda: real.metric("inferlb_worker_queue_depth") == 0
             and real.metric("inferlb_worker_cancelled_inputs_total") > cancelled, 30,
             "the worker's queue to be freed and the inputs counted as cancelled", real.procs)
    assert real.metric("inferlb_worker_requests_total", code="499") >= 1
    real.idle()


# --- (c) a deadline that passes in the queue is a 504 ----------------------------------------------------


def test_a_budget_through_envoy_that_passes_in_a_busy_workers_queue_is_a_504(real: Stack) -> None:
    """The sheddable request cannot start before the standard hog's last batch (strict classes, no aging);
    its 200 ms budget is gone long before that, and the worker never starts it."""
    real.idle()
    missed = real.metric("inferlb_worker_deadline_misses_total")
    with Background(real) as hogs:
        hogs.send("hog", HOG)
        wait_for(lambda: real.metric("inferlb_worker_queue_depth") >= 32, 60, "the hog to queue", real.procs)
        late = real.post({"input": "in a hurry"}, {OBJECTIVE: "sheddable", "x-inferlb-timeout-ms": "200"})
    assert late.status_code == 504, late.text
    assert late.headers["content-type"] == "application/json"
    error = late.json()["error"]
    assert error["code"] == "deadline_exceeded" and error["type"] == "server_error" and error["message"]
    # once: Envoy's route does not retry a 504 (control_plane/resources/routes.py); a retry would come with
    # a fresh budget and stretch the client's deadline
    assert real.metric("inferlb_worker_deadline_misses_total") == missed + 1
    assert hogs.responses["hog"].status_code == 200


# --- (d) a critical request overtakes queued sheddable ones (simulated worker) --------------------------


def test_a_critical_request_overtakes_queued_sheddable_ones_on_a_simulated_worker(tmp_path: Path) -> None:
    """One slot, 10 ms a token: the blocker (256 tokens) holds it for about 2.6 s, time for the others (a few
    tokens each) to queue behind it through Envoy and ext_proc even on a loaded machine (300 ms, as it
    was, often was not). Before: the slot served its queue in arrival order, so the critical request,
    queued last, answered last."""
    slow = ("--sim-fixed-ms", "5", "--sim-per-token-us", "10000", *NO_AGING)
    with ExitStack() as exits:
        (worker,) = exits.enter_context(running_sim_workers(tmp_path, 1, args=slow))
        stack = stack_around(exits, tmp_path, worker.id, worker.proc)
        with Background(stack) as requests:
            requests.send("blocker", {"input": LONG_TEXT})  # standard, holds the slot
            wait_for(lambda: stack.metric("inferlb_worker_inflight_requests") == 1, 30, "the slot to be taken",
                     stack.procs)
            for i in range(3):
                requests.send(f"sheddable{i}", {"input": f"sheddable {i}"}, {OBJECTIVE: "sheddable"})
            wait_for(lambda: stack.metric("inferlb_worker_queue_depth") == 3 or "blocker" in requests.answered, 30,
                     "three sheddable requests to queue", stack.procs)
            assert "blocker" not in requests.answered, "the blocker ended before the sheddable ones queued"
            critical = stack.post({"input": "critical"}, {OBJECTIVE: "critical"})
            sheddable_answered_first = [name for name in requests.answered if name.startswith("sheddable")]
        assert critical.status_code == 200, critical.text
        assert sheddable_answered_first == []
        assert all(r.status_code == 200 for r in requests.responses.values()) and len(requests.responses) == 4
        queued = stack.metric("inferlb_worker_queue_wait_by_class_seconds_count", priority="sheddable")
        assert queued == 3
