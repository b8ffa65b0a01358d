"""Tracing end to end (issue 17): real Envoy, control plane, ext_proc and a real MiniLM worker, each told by
the standard OTEL_* variables to export to a real OTLP/gRPC receiver in this process. One request through
Envoy is one trace: Envoy's spans, ext_proc's decision and the worker's request, joined by W3C traceparent,
with the pick, the tokens, the predicted and actual time and the batch on them; the log lines written for
the request carry its x-request-id. Without the variables, nothing is exported."""

from __future__ import annotations

import json
import sys
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import pytest

from .conftest import free_port
from .otlp_receiver import OtlpReceiver, ReceivedSpan, running_otlp_receiver
from .stack import (
    ControlPlane,
    Envoy,
    ExtProc,
    Proc,
    _http_ok,
    http,
    launch,
    running_control_plane,
    running_envoy,
    running_ext_proc,
    supervised,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy, pytest.mark.model]

INT8 = "all-MiniLM-L6-v2-int8"
ENVOY, EXT_PROC, WORKER = "inferlb-envoy", "inferlb-ext-proc", "inferlb-worker"


def otel_env(receiver: OtlpReceiver) -> dict[str, str]:
    # The standard variables only; a short batch delay keeps the wait short (Envoy flushes every 5 s).
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}


def json_lines(proc: Proc) -> list[dict]:
    """The JSON log lines a process wrote so far (its stderr goes to its log file)."""
    lines = []
    for line in proc.log().splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except ValueError:
                pass
    return lines


@contextmanager
def running_worker_process(data_dir: Path, log_dir: Path, env: Mapping[str, str], *args: str) -> Iterator[Proc]:
    """``python -m workers`` with this environment added; ready when /readyz says 200."""
    port = free_port()
    proc = launch(f"worker-{port}", [sys.executable, "-m", "workers", "--port", str(port), *args], log_dir,
                  {"INFERLB_DATA_DIR": str(data_dir), **env})
    with supervised(proc, stop_timeout=30):
        wait_for(lambda: _http_ok(f"http://127.0.0.1:{port}/readyz"), 120, "the worker to become ready", [proc])
        yield proc


@dataclass
class Stack:
    receiver: OtlpReceiver
    worker: Proc
    worker_id: str
    cp: ControlPlane
    ext_proc: ExtProc
    envoy: Envoy

    @property
    def procs(self) -> list[Proc]:
        return [self.worker, self.cp.proc, self.ext_proc.proc, self.envoy.proc]


@pytest.fixture(scope="module")
def stack(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("tracing")
    ext_proc_port = free_port()
    with ExitStack() as es:
        receiver = es.enter_context(running_otlp_receiver())
        env = otel_env(receiver)
        worker = es.enter_context(running_worker_process(data_dir, log_dir, env, "--models", INT8, "--access-log"))
        wid = f"127.0.0.1:{worker.name.removeprefix('worker-')}"
        cp = es.enter_context(running_control_plane(log_dir, endpoints=[wid], ext_proc_port=ext_proc_port, env=env))
        ext_proc = es.enter_context(running_ext_proc(
            log_dir, xds_port=cp.xds_port, port=ext_proc_port, node_id="ext-proc-tracing",
            env={**env, "INFERLB_EXT_PROC_CACHE_MAX_BYTES": str(16 << 20), "INFERLB_EXT_PROC_LOG_LEVEL": "debug"}))
        envoy = es.enter_context(running_envoy(log_dir, xds_port=cp.xds_port, node_id="envoy-tracing"))
        s = Stack(receiver, worker, wid, cp, ext_proc, envoy)
        wait_for(lambda: envoy.healthy_hosts() == {wid}, 30, "Envoy to see the worker healthy", s.procs)
        yield s


def _one_trace(receiver: OtlpReceiver, request_id: str) -> dict[str, list[ReceivedSpan]] | None:
    """The spans of the trace ext_proc's span for ``request_id`` is in, by service, once all three sent theirs."""
    mine = [span for span in receiver.spans() if span.attributes.get("inferlb.request_id") == request_id
            and span.service == EXT_PROC]
    if not mine:
        return None
    by_service: dict[str, list[ReceivedSpan]] = {}
    for span in receiver.trace(mine[0].trace_id):
        by_service.setdefault(span.service, []).append(span)
    return by_service if {ENVOY, EXT_PROC, WORKER} <= by_service.keys() else None


def test_one_request_through_envoy_is_one_trace_across_envoy_ext_proc_and_the_worker(stack: Stack) -> None:
    request_id = f"trace-{uuid.uuid4()}"
    with http() as client:
        response = client.post(f"http://127.0.0.1:{stack.cp.listener_port}/v1/embeddings",
                               json={"model": INT8, "input": ["one request, one trace", "two inputs"]},
                               headers={"x-request-id": request_id}, timeout=30)
    assert response.status_code == 200, response.text

    spans = wait_for(lambda: _one_trace(stack.receiver, request_id), 30,
                     lambda: f"one trace with spans of Envoy, ext_proc and the worker; received "
                             f"{[(s.service, s.name, s.trace_id) for s in stack.receiver.spans()]}", stack.procs)
    envoy_ids = {span.span_id for span in spans[ENVOY]}
    roots = [span for span in spans[ENVOY] if not span.parent_id]
    assert len(roots) == 1, spans[ENVOY]  # Envoy's request span starts the trace (the client sent none)
    assert all(span.parent_id in envoy_ids or not span.parent_id for span in spans[ENVOY])

    (decision,) = spans[EXT_PROC]
    assert decision.parent_id in envoy_ids  # a child of Envoy's call to ext_proc
    attributes = decision.attributes
    assert attributes["inferlb.pick.endpoint"] == stack.worker_id
    assert attributes["inferlb.pick.policy"] == "least_completion_time"
    assert attributes["inferlb.tokens"] > 0 and attributes["inferlb.model.version"] == INT8
    assert attributes["inferlb.predicted_ms"] >= 0 and attributes["inferlb.actual_ms"] > 0
    assert attributes["inferlb.cache"] == "miss"
    assert attributes["http.response.status_code"] == 200 and attributes["inferlb.outcome"] == "served"

    (served,) = [span for span in spans[WORKER] if span.attributes.get("url.path") == "/v1/embeddings"]
    assert served.parent_id in envoy_ids  # a child of Envoy's upstream call, the one that reached the worker
    assert served.attributes["inferlb.request_id"] == request_id
    assert served.attributes["inferlb.model.version"] == INT8
    assert served.attributes["inferlb.tokens"] == attributes["inferlb.tokens"]
    assert served.attributes["inferlb.inputs"] == 2
    assert served.attributes["inferlb.batch.ids"] and sum(served.attributes["inferlb.batch.sizes"]) >= 2
    assert served.attributes["inferlb.queue_ms"] >= 0 and served.attributes["inferlb.compute_ms"] > 0
    assert served.attributes["http.response.status_code"] == 200


def test_the_log_lines_written_for_a_request_carry_its_request_id(stack: Stack) -> None:
    request_id = f"logs-{uuid.uuid4()}"
    with http() as client:
        response = client.post(f"http://127.0.0.1:{stack.cp.listener_port}/v1/embeddings",
                               json={"model": INT8, "input": "a request to find in the logs"},
                               headers={"x-request-id": request_id}, timeout=30)
        assert response.status_code == 200, response.text
        admin = client.get(f"{stack.cp.admin_url}/v1/endpoints", headers={"x-request-id": request_id})
        assert admin.headers["x-request-id"] == request_id  # the admin API echoes the id it was given
        fresh = client.get(f"{stack.cp.admin_url}/v1/endpoints")
        assert len(fresh.headers["x-request-id"]) == 36  # or makes one up (a UUID)

    def lines_for(proc: Proc) -> list[dict]:
        return [line for line in json_lines(proc) if line.get("request_id") == request_id]

    # ext_proc at debug level logs each decision; the worker's access log line for the request
    decisions = wait_for(lambda: [line for line in lines_for(stack.ext_proc.proc) if line["msg"] == "decision"],
                         10, "ext_proc's decision line with the request id", stack.procs)
    assert decisions[0]["pick"] == stack.worker_id and len(decisions[0]["trace_id"]) == 32
    accessed = wait_for(lambda: lines_for(stack.worker), 10, "the worker's log line with the request id", stack.procs)
    assert accessed[0]["logger"] == "uvicorn.access" and len(accessed[0]["trace_id"]) == 32
    assert accessed[0]["trace_id"] == decisions[0]["trace_id"]  # one trace, named in both logs
    # Envoy's access log line for it: how it ended at the edge, the upstream that served, the same trace
    edge = wait_for(lambda: lines_for(stack.envoy.proc), 10, "Envoy's access log line with the request id",
                    stack.procs)  # Envoy flushes its access log every second or so
    assert edge[0]["component"] == "envoy" and edge[0]["status"] == 200 and edge[0]["path"] == "/v1/embeddings"
    assert edge[0]["upstream"] == stack.worker_id and edge[0]["trace_id"] == decisions[0]["trace_id"]
    # lines not written for a request carry none
    assert not any("request_id" in line for line in json_lines(stack.ext_proc.proc) if line["msg"] == "ext_proc started")


def test_without_otel_variables_nothing_is_traced_and_no_exporter_exists(data_dir: Path, tmp_path: Path) -> None:
    """Two simulated workers told where the receiver is: OTEL_TRACES_EXPORTER=none keeps one off (no
    provider, no exporter), the other exports; a request to each, and only the second's span arrives."""
    with ExitStack() as es:
        receiver = es.enter_context(running_otlp_receiver())
        off = es.enter_context(running_worker_process(data_dir, tmp_path, {**otel_env(receiver),
                                                                          "OTEL_TRACES_EXPORTER": "none"},
                                                      "--simulate"))
        on = es.enter_context(running_worker_process(data_dir, tmp_path, otel_env(receiver), "--simulate"))
        ids = {}
        with http() as client:
            for proc in (off, on):
                ids[proc.name] = request_id = f"{proc.name}-{uuid.uuid4()}"
                url = f"http://127.0.0.1:{proc.name.removeprefix('worker-')}/v1/embeddings"
                response = client.post(url, json={"input": "traced or not"}, headers={"x-request-id": request_id})
                assert response.status_code == 200, response.text
        wait_for(lambda: any(span.attributes.get("inferlb.request_id") == ids[on.name]
                             for span in receiver.spans()), 20, "the traced worker's span", [off, on])
    # the off worker's process stopped (its exit would have flushed any span it had): none came
    assert not any(span.attributes.get("inferlb.request_id") == ids[off.name] for span in receiver.spans())
    assert not any(line["msg"] == "tracing on" for line in json_lines(off))
    assert any(line["msg"] == "tracing on" for line in json_lines(on))
