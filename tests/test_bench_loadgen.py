"""The open-loop load generator and ``inferlb bench load``, against real simulated workers over HTTP.

Smoke runs of a few seconds; the assertions are about counts, structure and
orderings (every request answered, the spread names the worker, percentiles
ordered), plus lower bounds that the worker's own service time guarantees.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from inferlb.bench.load.loadgen import run_load_blocking
from inferlb.bench.report.plots import plot_cdfs, plot_load_latency
from inferlb.bench.report.results import RunResult
from inferlb.bench.load.scenario import Workload
from inferlb.bench.load.texts import bodies_for
from inferlb.bench.load.trace import Trace, build_trace

from .conftest import free_port
from .stack import (
    ROOT,
    SimWorker,
    http,
    prometheus_samples,
    running_sim_workers,
    sample,
    wait_for,
)

TINY = ("--sim-cost-scale", "0.1")  # ~0.1-3 ms per request: the worker is never the bottleneck
SLOW = ("--sim-fixed-ms", "5", "--sim-per-token-us", "0", "--sim-cost-scale", "60")  # 300 ms per request
JOB_S = 0.3
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
INFERLB = (sys.executable, "-m", "inferlb.cli")  # what the inferlb console script runs


@pytest.fixture(scope="module")
def fast_workers(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    with running_sim_workers(tmp_path_factory.mktemp("fast"), 2, args=TINY) as workers:
        yield workers


@pytest.fixture(scope="module")
def slow_worker(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    with running_sim_workers(tmp_path_factory.mktemp("slow"), 1, args=SLOW) as (w,):
        yield w


def embeddings_url(worker: SimWorker) -> str:
    return f"{worker.url}/v1/embeddings"


def fixed_trace(n: int, gap_s: float, tokens: int = 8) -> Trace:
    send_at = np.arange(n, dtype=np.float64) * gap_s
    return Trace(send_at, np.full(n, tokens, dtype=np.int64), np.zeros(n, dtype=np.int64), 1 / gap_s,
                 n * gap_s, 0)


@pytest.mark.slow
@pytest.mark.servers
def test_a_short_run_completes_every_request(fast_workers: list[SimWorker]) -> None:
    worker = fast_workers[0]
    trace = build_trace(Workload(), 50, 2.0, seed=11)
    warmup = 0.5
    outcome = run_load_blocking(embeddings_url(worker), trace, bodies_for(trace.tokens), slo_s=1.0, timeout_s=10,
                                warmup_s=warmup, progress=False)
    measured = int(trace.window(warmup).sum())
    assert outcome.sent == measured and outcome.warmup_sent == len(trace) - measured
    assert outcome.completed == measured and outcome.errors == 0 and outcome.timeouts == 0
    assert dict(outcome.spread) == {worker.id: measured}
    assert outcome.histogram.count == measured and outcome.statuses == {200: measured}
    s = outcome.histogram.summary()
    assert 0 < s.p50_s <= s.p90_s <= s.p99_s <= s.p999_s <= s.max_s
    assert outcome.client_cpu_s > 0 and outcome.send_lag_max_s >= 0

    result = outcome.to_result("direct", load=0.5)
    assert result.offered_rps == 50 and result.duration_s == pytest.approx(2.0 - warmup)
    assert result.goodput_rps == pytest.approx(outcome.within_slo / (2.0 - warmup))
    assert result.cdf and result.cdf[-1][1] == 1.0
    doc = json.loads(json.dumps(result.to_json()))
    assert RunResult.from_json(doc) == result


@pytest.mark.slow
@pytest.mark.servers
def test_open_loop_sends_on_schedule_and_measures_from_it(slow_worker: SimWorker) -> None:
    """Ten requests 50 ms apart at a worker that serves one per 300 ms: an open-loop client sends them all
    anyway (the worker's queue fills up), and the last one's latency, from its scheduled time, includes
    the nine service times before it."""
    trace = fixed_trace(10, 0.05)
    deep_queue = []

    def watch() -> None:
        deep_queue.append(wait_for(lambda: queue_depth(slow_worker) >= 5, 20, "the queue to fill"))

    watcher = threading.Thread(target=watch)
    watcher.start()
    outcome = run_load_blocking(embeddings_url(slow_worker), trace, bodies_for(trace.tokens), slo_s=0.5,
                                timeout_s=20, progress=False)
    watcher.join()
    assert deep_queue == [True]  # a closed-loop client would never have more than one waiting
    assert outcome.completed == 10
    assert outcome.histogram.max() >= 10 * JOB_S - 9 * 0.05  # the server cannot have done better
    assert outcome.histogram.percentile(0) >= JOB_S
    assert outcome.within_slo <= 1  # only the first can answer within 0.5 s


@pytest.mark.slow
@pytest.mark.servers
def test_latency_counts_from_the_scheduled_time_not_the_actual_send(slow_worker: SimWorker) -> None:
    """With one connection the client itself must hold requests back; that wait is latency too (no
    coordinated omission): the tenth answer comes nine service times after it was due, though each request
    spent only one service time on the wire."""
    trace = fixed_trace(10, 0.05)
    outcome = run_load_blocking(embeddings_url(slow_worker), trace, bodies_for(trace.tokens), slo_s=0.5,
                                timeout_s=20, progress=False, max_connections=1)
    assert outcome.completed == 10
    assert outcome.histogram.max() >= 10 * JOB_S - 9 * 0.05


@pytest.mark.slow
@pytest.mark.servers
def test_stragglers_become_timeouts_and_the_run_stays_bounded(slow_worker: SimWorker) -> None:
    trace = fixed_trace(5, 0.001)  # 5 at once; one slot of 300 ms; 0.5 s to answer
    outcome = run_load_blocking(embeddings_url(slow_worker), trace, bodies_for(trace.tokens), slo_s=1.0,
                                timeout_s=0.5, progress=False)
    assert outcome.sent == 5 and outcome.completed + outcome.timeouts == 5
    assert outcome.timeouts >= 3 and outcome.completed >= 1
    assert outcome.wall_s < 0.5 + 1.0 + 5 * JOB_S  # returned without waiting for every straggler
    wait_for(lambda: queue_depth(slow_worker) == 0, 10, "the worker to drain the cancelled requests")


@pytest.mark.slow
@pytest.mark.servers
def test_refused_connections_and_error_statuses_are_errors(fast_workers: list[SimWorker]) -> None:
    trace = fixed_trace(5, 0.01)
    closed = run_load_blocking(f"http://127.0.0.1:{free_port()}/v1/embeddings", trace, bodies_for(trace.tokens),
                               slo_s=1, timeout_s=5, progress=False)
    assert closed.errors == 5 and closed.completed == 0 and sum(closed.error_kinds.values()) == 5
    missing = run_load_blocking(f"{fast_workers[1].url}/v1/nothing", trace, bodies_for(trace.tokens), slo_s=1,
                                timeout_s=5, progress=False)
    assert missing.errors == 5 and missing.statuses == {404: 5} and missing.histogram.count == 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"url": "127.0.0.1:1/v1/embeddings"}, "url"),
    ({"slo_s": 0}, "slo_s"),
    ({"warmup_s": 99}, "warmup_s"),
    ({"bodies": [b"{}"]}, "one body per request"),
])
def test_bad_arguments_are_refused(kwargs: dict, message: str) -> None:
    trace = fixed_trace(3, 0.1)
    args = {"url": "http://127.0.0.1:1/v1/embeddings", "trace": trace, "bodies": bodies_for(trace.tokens),
            "slo_s": 1.0, "timeout_s": 1.0, "progress": False, **kwargs}
    with pytest.raises(ValueError, match=message):
        run_load_blocking(**args)


@pytest.mark.slow
@pytest.mark.servers
@pytest.mark.subprocess
def test_the_cli_prints_the_figures_and_writes_json(fast_workers: list[SimWorker], tmp_path: Path) -> None:
    worker = fast_workers[1]
    out = tmp_path / "result.json"
    done = subprocess.run(
        [*INFERLB, "bench", "load", "--url", embeddings_url(worker), "--rate", "50",
         "--duration", "2", "--warmup", "0.2", "--arrival", "bursty", "--burst-on", "0.5", "--burst-off", "0.5",
         "--mix", "0.8:8-32,0.2:64-64", "--seed", "3", "--repeat-rate", "0.3", "--json", str(out),
         "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "p99" in done.stdout and worker.id in done.stdout
    doc = json.loads(out.read_text())
    result = RunResult.from_json(doc)
    assert result.completed == result.sent > 0 and result.errors == 0 and result.timeouts == 0
    assert dict(result.spread) == {worker.id: result.completed}
    assert 0 < result.p50_s <= result.p90_s <= result.p99_s <= result.p999_s
    assert result.extra["arrival"] == "bursty" and result.extra["mix"] == "0.8:8-32,0.2:64-64"
    assert result.extra["repeat_rate"] == 0.3


@pytest.mark.subprocess
@pytest.mark.parametrize(("argv", "message"), [
    (["--rate", "0"], "--rate"),
    (["--rate", "10", "--mix", "0.5:8-32"], "add up to 0.5"),
    (["--rate", "10", "--mix", "1:8-999"], "MAX <= 256"),
    (["--rate", "10", "--duration", "2", "--warmup", "3"], "--warmup"),
    (["--rate", "10", "--arrival", "steady"], "--arrival"),
    (["--rate", "10", "--repeat-rate", "1.5"], "repeat_rate must be in [0, 1]"),
    (["--rate", "10", "--repeat-pool", "0"], "--repeat-pool"),
])
def test_the_cli_refuses_bad_flags_with_exit_2(argv: list[str], message: str) -> None:
    done = subprocess.run([*INFERLB, "bench", "load", "--url",
                           "http://127.0.0.1:1/v1/embeddings", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and message in done.stderr


@pytest.mark.subprocess
def test_the_cli_help_explains_the_flags() -> None:
    done = subprocess.run([*INFERLB, "bench", "load", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for flag in ("--url", "--rate", "--arrival", "--mix", "--slo-ms", "--warmup", "--json", "--no-progress",
                 "--repeat-rate"):
        assert flag in done.stdout


def queue_depth(worker: SimWorker) -> float:
    with http() as client:
        text = client.get(f"{worker.url}/metrics").text
    return sample(prometheus_samples(text), "inferlb_worker_queue_depth") or 0.0


# --- plots ------------------------------------------------------------------------------------------------


def synthetic(configuration: str, load: float, scale: float) -> RunResult:
    cdf = tuple((scale * (1 + 10 * f ** 8), f) for f in np.linspace(0.01, 1.0, 50).tolist())
    return RunResult(configuration=configuration, load=load, offered_rps=100 * load, duration_s=20, sent=2000,
                     completed=2000, errors=0, timeouts=0, p50_s=scale, p90_s=2 * scale, p99_s=8 * scale,
                     p999_s=10 * scale, mean_s=1.5 * scale, goodput_rps=100 * load, slo_s=0.25, cdf=cdf)


def test_plots_are_png_files(tmp_path: Path) -> None:
    results = [synthetic(c, load, base * (1 + load))
               for c, base in (("envoy_round_robin", 0.02), ("inferlb_ext_proc", 0.01))
               for load in (0.5, 0.7, 0.9)]
    cdfs = plot_cdfs([r for r in results if r.load == 0.9], tmp_path / "cdf.png")
    curve = plot_load_latency(results, tmp_path / "load.png")
    for path in (cdfs, curve):
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_plots_refuse_nothing_to_draw(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="CDF"):
        plot_cdfs([RunResult.from_json({**synthetic("x", 0.5, 0.01).to_json(), "cdf": []})], tmp_path / "a.png")
    with pytest.raises(ValueError, match="no results"):
        plot_load_latency([], tmp_path / "b.png")


@pytest.mark.slow
@pytest.mark.servers
def test_service_time_runs_from_the_actual_send(slow_worker: SimWorker) -> None:
    """The same held-back requests: their service time (from when the headers went out) is one service
    time each, while their latency keeps the wait for the one connection; the send lag and the most
    requests in flight are reported too."""
    trace = fixed_trace(10, 0.05)
    outcome = run_load_blocking(embeddings_url(slow_worker), trace, bodies_for(trace.tokens), slo_s=0.5,
                                timeout_s=20, progress=False, max_connections=1)
    assert outcome.service.count == outcome.completed == 10
    assert outcome.service.max() < outcome.histogram.max() - 5 * JOB_S
    assert outcome.max_inflight >= 2 and 0 <= outcome.send_lag_p50_s <= outcome.send_lag_p99_s
    extra = outcome.to_result("x").extra
    assert extra["service_p99_s"] == outcome.service.percentile(99) and extra["max_inflight"] == outcome.max_inflight
