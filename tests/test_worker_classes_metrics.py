"""Queue wait by class, deadline misses and the control plane's reading of the worker's /metrics, on a
simulated worker over real HTTP (the simulated worker reports through the same WorkerMetrics as the real
one; tests/test_worker_fairness.py covers the real worker's cancelled inputs and deadline misses)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import pytest

from control_plane.telemetry.parse import parse_sample

from .stack import SimWorker, http, prometheus_samples, running_sim_workers, sample

pytestmark = [pytest.mark.slow, pytest.mark.servers]

OBJECTIVE = "x-gateway-inference-objective"


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimWorker]:
    with running_sim_workers(tmp_path_factory.mktemp("class-metrics"), 1) as (w,):
        yield w


def metrics_text(worker: SimWorker) -> str:
    with http() as client:
        response = client.get(f"{worker.url}/metrics")
    response.raise_for_status()
    return response.text


def post(worker: SimWorker, headers: dict[str, str]) -> httpx.Response:
    with http() as client:
        return client.post(f"{worker.url}/v1/embeddings", json={"input": "a sentence"}, headers=headers,
                           timeout=30)


def test_queue_wait_is_counted_by_class_and_the_old_histogram_stays_one_series(worker: SimWorker) -> None:
    before = prometheus_samples(metrics_text(worker))
    for objective, n in (("critical", 2), ("sheddable", 1), (None, 3)):
        for _ in range(n):
            assert post(worker, {OBJECTIVE: objective} if objective else {}).status_code == 200
    after = prometheus_samples(metrics_text(worker))

    def grew(priority: str) -> float:
        name = "inferlb_worker_queue_wait_by_class_seconds_count"
        return (sample(after, name, priority=priority) or 0) - (sample(before, name, priority=priority) or 0)

    assert (grew("critical"), grew("sheddable"), grew("standard")) == (2, 1, 3)
    # every class is exposed from the start, so a dashboard's rate() has a series before the first request
    assert {dict(labels)["priority"] for (name, labels) in after
            if name == "inferlb_worker_queue_wait_by_class_seconds_count"} == {"critical", "standard", "sheddable"}
    # the control plane reads the unlabelled histogram as before: one series, every class in it
    old = "inferlb_worker_queue_wait_seconds_count"
    assert sample(after, old) - (sample(before, old) or 0) == 6
    parsed = parse_sample(metrics_text(worker), at=0.0)
    assert parsed.queue_wait_count == sample(after, old) and parsed.refused == 0


def test_a_simulated_worker_counts_deadline_misses(worker: SimWorker) -> None:
    missed = sample(prometheus_samples(metrics_text(worker)), "inferlb_worker_deadline_misses_total") or 0
    response = post(worker, {"x-inferlb-timeout-ms": "0.001"})
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "deadline_exceeded"
    text = metrics_text(worker)
    assert sample(prometheus_samples(text), "inferlb_worker_deadline_misses_total") == missed + 1
    assert sample(prometheus_samples(text), "inferlb_worker_cancelled_inputs_total") is not None
