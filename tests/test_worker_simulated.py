"""Emulated workers (``python -m workers --simulate``): k slots with a FIFO queue, through real HTTP.

Service times are made long (hundreds of ms) so that the structure (who
overlapped, who queued) cannot be confused by scheduling noise on a busy
host; no assertion is a latency threshold. ``compute`` has a hard lower
bound: a job never ends before its service time.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from .stack import (
    ROOT,
    SimWorker,
    http,
    prometheus_samples,
    running_sim_workers,
    sample,
    wait_for,
)

# 5 ms fixed x 60 = 300 ms per request whatever its length: the slot tests count service times.
SLOW = ("--sim-fixed-ms", "5", "--sim-per-token-us", "0", "--sim-cost-scale", "60")
JOB_MS = 300.0


def timing(response: httpx.Response) -> dict[str, float]:
    """``server-timing: queue;dur=1.0, compute;dur=2.0, total;dur=3.1`` → {"queue": 1.0, ...} (ms)."""
    return {m[0]: float(m[1]) for m in re.findall(r"(\w+);dur=([\d.]+)", response.headers["server-timing"])}


def post(worker: SimWorker, text: str = "hello world") -> httpx.Response:
    with httpx.Client(timeout=30, trust_env=False) as client:
        response = client.post(f"{worker.url}/v1/embeddings", json={"input": text})
    assert response.status_code == 200, response.text
    return response


def concurrent_posts(worker: SimWorker, n: int) -> list[httpx.Response]:
    barrier = threading.Barrier(n)

    def one(_: int) -> httpx.Response:
        with httpx.Client(timeout=30, trust_env=False) as client:
            client.get(f"{worker.url}/healthz")  # connect first: the POSTs then leave together
            barrier.wait()
            response = client.post(f"{worker.url}/v1/embeddings", json={"input": "hello world"})
        assert response.status_code == 200, response.text
        return response

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def queue_depth(worker: SimWorker) -> float:
    with http() as client:
        text = client.get(f"{worker.url}/metrics").text
    return sample(prometheus_samples(text), "inferlb_worker_queue_depth") or 0.0


@pytest.fixture(scope="module")
def two_slot_worker(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    with running_sim_workers(tmp_path_factory.mktemp("sim2"), 1, args=(*SLOW, "--sim-slots", "2")) as (w,):
        yield w


@pytest.fixture(scope="module")
def one_slot_worker(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    with running_sim_workers(tmp_path_factory.mktemp("sim1"), 1, args=SLOW) as (w,):
        yield w


@pytest.mark.slow
@pytest.mark.servers
def test_two_slots_serve_two_at_once_and_queue_the_third(two_slot_worker: SimWorker) -> None:
    seen_queued = []

    def watch() -> None:  # the worker's own queue gauge, polled while the three run
        seen_queued.append(wait_for(lambda: queue_depth(two_slot_worker) >= 1, 10, "a request to queue"))

    watcher = threading.Thread(target=watch)
    watcher.start()
    responses = concurrent_posts(two_slot_worker, 3)
    watcher.join()
    assert seen_queued == [True]
    timings = sorted((timing(r) for r in responses), key=lambda t: t["queue"])
    for t in timings:
        assert t["compute"] >= JOB_MS  # each job took its full service time
    # two overlapped (no wait), the third waited for a slot: for most of a service time
    assert timings[0]["queue"] < JOB_MS / 2 and timings[1]["queue"] < JOB_MS / 2
    assert timings[2]["queue"] > JOB_MS / 2
    assert all(r.headers["x-inferlb-worker"] == two_slot_worker.id for r in responses)


@pytest.mark.slow
@pytest.mark.servers
def test_one_slot_serves_them_one_after_another(one_slot_worker: SimWorker) -> None:
    timings = sorted((timing(r) for r in concurrent_posts(one_slot_worker, 3)), key=lambda t: t["queue"])
    assert timings[0]["queue"] < JOB_MS / 2
    assert JOB_MS / 2 < timings[1]["queue"] < timings[2]["queue"]  # the 2nd waited one job, the 3rd two
    assert timings[2]["queue"] > 1.5 * JOB_MS


@pytest.mark.slow
@pytest.mark.servers
def test_the_orca_header_reports_the_queue_while_requests_wait(one_slot_worker: SimWorker) -> None:
    responses = concurrent_posts(one_slot_worker, 3)
    # the first to finish answered while the other two were waiting or running: one of them still queued
    queues = [int(re.search(r"named_metrics\.queue=(\d+)", r.headers["endpoint-load-metrics"]).group(1))
              for r in responses]
    assert max(queues) >= 1 and min(queues) == 0


@pytest.mark.slow
@pytest.mark.servers
def test_speed_changes_at_run_time_change_the_compute(one_slot_worker: SimWorker) -> None:
    base = timing(post(one_slot_worker))["compute"]
    one_slot_worker.set_speed(4.0)
    try:
        faster = timing(post(one_slot_worker))["compute"]
        with http() as client:
            state = client.get(f"{one_slot_worker.url}/v1/simulation").json()
        assert state["speed"] == 4.0
        assert state["fixed_s"] == pytest.approx(JOB_MS / 1000)  # --sim-cost-scale applied to the cost
    finally:
        one_slot_worker.set_speed(1.0)
    assert base >= JOB_MS and faster >= JOB_MS / 4
    assert faster < base


@pytest.mark.slow
@pytest.mark.servers
def test_service_time_grows_with_tokens(tmp_path: Path) -> None:
    # per-token only: 1 ms per token, so a 100-token request needs >= 100 ms and a 3-token one >= 3 ms
    args = ("--sim-fixed-ms", "0", "--sim-per-token-us", "1000")
    with running_sim_workers(tmp_path, 1, args=args) as (w,):
        short = post(w, "hello")
        long = post(w, " ".join(["hello"] * 98))
    assert short.headers["x-inferlb-tokens"] == "3" and long.headers["x-inferlb-tokens"] == "100"
    assert timing(long)["compute"] >= 100.0 and timing(short)["compute"] >= 3.0
    assert timing(long)["compute"] > timing(short)["compute"]


@pytest.mark.subprocess
@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--sim-slots", "0", "--sim-slots must be >= 1"),
    ("--sim-cost-scale", "0", "--sim-cost-scale must be > 0"),
])
def test_bad_simulation_flags_exit_2_with_a_message(flag: str, value: str, message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "workers", "--simulate", flag, value, "--port", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr


@pytest.mark.subprocess
def test_help_documents_the_slot_flags() -> None:
    done = subprocess.run([sys.executable, "-m", "workers", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "--sim-slots" in done.stdout and "--sim-cost-scale" in done.stdout


@pytest.mark.slow
@pytest.mark.servers
def test_a_simulated_worker_serves_versions_at_their_own_cost(tmp_path: Path) -> None:
    """Two versions on one slot: fp32 costs 3x (--model-cost), each names itself, their vectors differ, an
    unknown model is a 404 and the per-version metrics count."""
    int8, fp32 = "all-MiniLM-L6-v2-int8", "all-MiniLM-L6-v2-fp32"
    args = ("--sim-fixed-ms", "100", "--sim-per-token-us", "0", "--models", f"{int8},{fp32}",
            "--model-cost", f"{fp32}=3", "--pool", "sim")
    with running_sim_workers(tmp_path, 1, args=args) as (w,), httpx.Client(timeout=30, trust_env=False) as client:
        answers = {}
        for model, headers in ((None, {}), (fp32, {}), (int8, {"x-inferlb-model": fp32})):
            body = {"input": "hello world"} if model is None else {"input": "hello world", "model": model}
            response = client.post(f"{w.url}/v1/embeddings", json=body, headers=headers)
            assert response.status_code == 200, response.text
            answers[(model, headers.get("x-inferlb-model"))] = response
        default, by_body, by_header = answers.values()
        assert [(r.json()["model"], r.headers["x-inferlb-model"]) for r in (default, by_body, by_header)] == [
            (int8, int8), (fp32, fp32), (fp32, fp32)]
        assert timing(default)["compute"] >= 100.0 and timing(by_body)["compute"] >= 300.0  # hard lower bounds
        assert by_body.json()["data"] == by_header.json()["data"] != default.json()["data"]
        missing = client.post(f"{w.url}/v1/embeddings", json={"input": "x", "model": "gpt-4"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert [m["id"] for m in client.get(f"{w.url}/v1/models").json()["data"]] == [int8, fp32]
        samples = w.metrics()
    assert sample(samples, "inferlb_worker_model_requests_total", model=fp32, code="200") == 2
    assert sample(samples, "inferlb_worker_model_requests_total", model=int8, code="200") == 1
    assert sample(samples, "inferlb_worker_pool_info", pool="sim") == 1


@pytest.mark.subprocess
@pytest.mark.parametrize(("args", "message"), [
    (("--simulate", "--model-cost", "all-MiniLM-L6-v2-fp32=2"), "names 'all-MiniLM-L6-v2-fp32', which this worker does not serve"),
    (("--simulate", "--model-cost", "all-MiniLM-L6-v2-int8=0"), "is not VERSION=SCALE with SCALE > 0"),
    (("--simulate", "--model-cost", "two"), "is not VERSION=SCALE"),
    (("--model-cost", "all-MiniLM-L6-v2-int8=2"), "--model-cost needs --simulate"),
])
def test_bad_model_costs_exit_2_with_a_message(args: tuple[str, ...], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "workers", *args, "--port", "1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr


@pytest.mark.slow
@pytest.mark.servers
def test_the_simulated_fault_answers_500_at_once_and_counts_it(one_slot_worker: SimWorker) -> None:
    with http() as client:
        url = f"{one_slot_worker.url}/v1/simulation"
        assert client.put(url, json={"fail_rate": 1.5}).status_code == 400
        assert client.put(url, json={"fail_rate": 1.0}).json()["fail_rate"] == 1.0
        try:
            failed = client.post(f"{one_slot_worker.url}/v1/embeddings", json={"input": "hello"})
            metrics = client.get(f"{one_slot_worker.url}/metrics").text
        finally:
            assert client.put(url, json={"fail_rate": 0.0}).json()["fail_rate"] == 0.0
    assert failed.status_code == 500
    assert failed.json()["error"]["code"] == "simulated_failure"
    assert 'inferlb_worker_requests_total{code="500"}' in metrics  # the control plane sees the errors
    post(one_slot_worker)  # asserts 200: the fault is off again
