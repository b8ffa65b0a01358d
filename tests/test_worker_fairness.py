"""A real int8 worker over real HTTP: a short request never waits for a whole large one, a client that
leaves frees the queue, and the per-request token budget, deadlines and priority header.

No assertion is about time: the short request is shown to finish while the
large one is still running (the large one has 32 batches to go through, the
short one needs one), and every wait polls a condition with a deadline.
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from .conftest import WorkerProcess, running_worker
from .stack import prometheus_samples, sample, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.model]

# One input the model truncates at 256 tokens; 64 of them are the largest request the worker accepts.
LONG_TEXT = " ".join(["load balancing"] * 150)
LARGE = {"input": [LONG_TEXT] * 64}


@pytest.fixture(scope="module")
def worker(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    # No worker cache: LARGE repeats one text, and the model must compute every copy to be busy.
    with running_worker(data_dir, tmp_path_factory.mktemp("fair-worker"), "--cache-max-bytes", "0") as w:
        yield w


def metric(worker: WorkerProcess, name: str, **labels: str) -> float:
    return sample(prometheus_samples(httpx.get(f"{worker.url}/metrics", timeout=10).text), name, **labels) or 0.0


def post(worker: WorkerProcess, body: dict, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{worker.url}/v1/embeddings", json=body, headers=headers, timeout=120)


def idle(worker: WorkerProcess) -> bool:
    return metric(worker, "inferlb_worker_queue_depth") == 0 and metric(worker, "inferlb_worker_inflight_requests") == 0


def test_a_one_sentence_request_finishes_while_a_full_size_one_still_runs(worker: WorkerProcess) -> None:
    """Before: batches were built around the oldest queued input, so the sentence waited for all 64."""
    wait_for(lambda: idle(worker), 60, "the worker to be idle")
    large: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: large.update(response=post(worker, LARGE)), daemon=True)
    thread.start()
    try:
        wait_for(lambda: metric(worker, "inferlb_worker_queue_depth") > 0, 60, "the large request to queue")
        short = post(worker, {"input": "one short sentence"})
        large_done_when_short_returned = "response" in large
    finally:
        thread.join(120)
    assert short.status_code == 200, short.text
    assert not large_done_when_short_returned
    assert large["response"].status_code == 200 and len(large["response"].json()["data"]) == 64


def test_a_client_that_leaves_takes_its_queued_inputs_with_it(worker: WorkerProcess) -> None:
    wait_for(lambda: idle(worker), 60, "the worker to be idle")
    cancelled = metric(worker, "inferlb_worker_cancelled_inputs_total")
    host, port = worker.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(LARGE).encode()
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: worker\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        wait_for(lambda: metric(worker, "inferlb_worker_queue_depth") >= 10, 60, "the request to queue")
    # The connection is closed: the worker drops what it had queued for it and counts it.
    wait_for(lambda: metric(worker, "inferlb_worker_queue_depth") == 0
             and metric(worker, "inferlb_worker_cancelled_inputs_total") > cancelled, 30,
             "the queue to be freed and the inputs counted as cancelled")
    assert metric(worker, "inferlb_worker_requests_total", code="499") >= 1
    wait_for(lambda: idle(worker), 60, "the worker to be idle")
    assert post(worker, {"input": "still serving"}).status_code == 200


def test_a_request_over_the_token_budget_is_told_how_to_split(worker: WorkerProcess) -> None:
    response = post(worker, {"input": [LONG_TEXT] * 65})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "too_many_tokens" and error["param"] == "input"
    assert "16384" in error["message"] and "split" in error["message"]


def test_a_request_whose_deadline_has_passed_gets_504(worker: WorkerProcess) -> None:
    missed = metric(worker, "inferlb_worker_deadline_misses_total")
    response = post(worker, {"input": "too late"}, {"x-inferlb-timeout-ms": "0.001"})
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "deadline_exceeded"
    assert metric(worker, "inferlb_worker_deadline_misses_total") == missed + 1
    # A budget large enough is served.
    assert post(worker, {"input": "in time"}, {"x-inferlb-timeout-ms": "60000"}).status_code == 200


@pytest.mark.parametrize("header, value", [("x-gateway-inference-objective", "urgent"),
                                           ("x-inferlb-timeout-ms", "soon"),
                                           ("x-envoy-expected-rq-timeout-ms", "-5")])
def test_a_bad_priority_or_deadline_header_is_a_400_naming_it(worker: WorkerProcess, header: str,
                                                               value: str) -> None:
    response = post(worker, {"input": "x"}, {header: value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_header" and error["param"] == header and value in error["message"]


def test_every_class_is_served(worker: WorkerProcess) -> None:
    for objective in ("critical", "standard", "sheddable", "Critical"):
        response = post(worker, {"input": "x"}, {"x-gateway-inference-objective": objective})
        assert response.status_code == 200, (objective, response.text)
