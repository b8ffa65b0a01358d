"""One error shape through real Envoy 1.40: Envoy's own local replies (413 over the body limit, 503 no
healthy upstream, 504 upstream timeout, 400 malformed) reach the client in OpenAI's shape,
``{"error": {"message", "type", "param": null, "code"}}`` as application/json; ext_proc's own replies
(its 413 over its body cap) and the workers' own errors pass unchanged.

Real processes on free ports (``tests/stack.py``): simulated workers, ``python -m control_plane``,
``python -m ext_proc`` and Envoy on the control plane's LDS. Every wait polls a condition.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from .conftest import free_port
from .stack import (
    ControlPlane,
    Envoy,
    ExtProc,
    Proc,
    SimWorker,
    http,
    running_control_plane,
    running_envoy,
    running_ext_proc,
    running_gateway,
    running_sim_workers,
    sample,
    wait_for,
)
from .test_admin_api import Admin
from .test_ext_proc_envoy import ready_through_ext_proc

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy]

ENVOY_LIMIT = 2 * 1024 * 1024  # the route's request_body_buffer_limit
EXT_PROC_LIMIT = 1024 * 1024  # ext_proc's own cap, below Envoy's here so that ext_proc's 413 can be seen


def post_bytes(port: int, body: bytes) -> httpx.Response:
    with http() as client:
        return client.post(f"http://127.0.0.1:{port}/v1/embeddings", content=body,
                           headers={"content-type": "application/json"}, timeout=60)


def openai_error(response: httpx.Response, status: int) -> dict:
    """The response is ``status`` with exactly OpenAI's error object as JSON; its ``error``."""
    assert response.status_code == status, (response.status_code, response.headers, response.text)
    assert response.headers["content-type"] == "application/json", response.headers
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["param"] is None and body["error"]["message"], body
    return body["error"]


def oversized(size: int) -> bytes:
    """A JSON body of ``size`` bytes."""
    head = b'{"input": "'
    return head + b"x" * (size - len(head) - 2) + b'"}'


@dataclass
class Stack:
    worker: SimWorker
    cp: ControlPlane
    ext_proc: ExtProc
    envoy: Envoy

    @property
    def procs(self) -> list[Proc]:
        return [self.cp.proc, self.ext_proc.proc, self.envoy.proc, self.worker.proc]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("error-shape")
    ext_proc_port = free_port()
    with ExitStack() as exits:
        (worker,) = exits.enter_context(running_sim_workers(log_dir, 1))
        cp = exits.enter_context(running_control_plane(
            log_dir, endpoints=[worker.id], ext_proc_port=ext_proc_port,
            env={"INFERLB_CP_DATA_PLANE__MAX_REQUEST_BODY_BYTES": str(ENVOY_LIMIT)}))
        ext_proc = exits.enter_context(running_ext_proc(log_dir, xds_port=cp.xds_port, port=ext_proc_port,
                                                        env={"INFERLB_EXT_PROC_MAX_BODY_BYTES": str(EXT_PROC_LIMIT)}))
        envoy = exits.enter_context(running_envoy(log_dir, xds_port=cp.xds_port, node_id="envoy-error-shape"))
        s = Stack(worker, cp, ext_proc, envoy)
        ready_through_ext_proc(cp, envoy, ext_proc, {worker.id}, s.procs)
        yield s


def test_a_6_mb_body_gets_envoys_413_as_json(stack: Stack) -> None:
    """Before: a plain-text "Payload Too Large"."""
    error = openai_error(post_bytes(stack.cp.listener_port, oversized(6 * 1000 * 1000)), 413)
    assert error == {"message": f"request body is over the limit of {ENVOY_LIMIT} bytes",
                     "type": "invalid_request_error", "param": None, "code": "request_too_large"}


def test_a_body_over_ext_procs_cap_gets_ext_procs_own_413_unchanged(stack: Stack) -> None:
    """Envoy buffers 1.5 MiB (under its limit) and sends it to ext_proc, which is capped at 1 MiB."""
    before = sample(stack.ext_proc.metrics(), "inferlb_ext_proc_fallbacks_total", reason="body_too_large") or 0
    error = openai_error(post_bytes(stack.cp.listener_port, oversized(EXT_PROC_LIMIT + EXT_PROC_LIMIT // 2)), 413)
    assert error == {"message": f"request body is over the limit of {EXT_PROC_LIMIT} bytes",  # ext_proc's words
                     "type": "invalid_request_error", "param": None, "code": "request_too_large"}
    assert sample(stack.ext_proc.metrics(), "inferlb_ext_proc_fallbacks_total", reason="body_too_large") == before + 1
    assert stack.ext_proc.outstanding() == 0


def test_a_workers_own_error_passes_unchanged(stack: Stack) -> None:
    bad = json.dumps({"input": "hello", "encoding_format": "yaml"}).encode()
    with http() as client:
        direct = client.post(f"{stack.worker.url}/v1/embeddings", content=bad,
                             headers={"content-type": "application/json"})
    through = post_bytes(stack.cp.listener_port, bad)
    assert direct.status_code == through.status_code == 400
    assert through.content == direct.content  # byte for byte: not rewritten
    assert through.headers["content-type"] == direct.headers["content-type"]


def _raw_exchange(port: int, request: bytes) -> bytes:
    """Send raw bytes, read until Envoy closes (a malformed request ends the connection)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_envoys_400_503_and_504_are_json(tmp_path: Path) -> None:
    """Without ext_proc (nothing listens on its port: Envoy fails open), so Envoy alone answers."""
    with running_sim_workers(tmp_path, 1) as (worker,), \
            running_control_plane(tmp_path, endpoints=[worker.id], env={
                "INFERLB_CP_DATA_PLANE__REQUEST_TIMEOUT_S": "1", "INFERLB_CP_DATA_PLANE__RETRIES": "0"}) as cp, \
            running_envoy(tmp_path, xds_port=cp.xds_port, node_id="envoy-local-replies") as envoy:
        procs = [cp.proc, envoy.proc, worker.proc]
        wait_for(lambda: envoy.healthy_hosts() == {worker.id}, 30, "Envoy to see the worker healthy", procs)
        wait_for(lambda: post_bytes(cp.listener_port, b'{"input": "hi"}').status_code == 200, 30,
                 "a first 200", procs)

        # 400: HTTP/1.1 without a Host header
        raw = _raw_exchange(cp.listener_port, b"POST /v1/embeddings HTTP/1.1\r\ncontent-length: 2\r\n\r\n{}")
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower(), raw
        assert json.loads(body)["error"] == {"message": "malformed request (missing_host_header)",
                                             "type": "invalid_request_error", "param": None,
                                             "code": "invalid_request"}

        # 504: the worker takes far longer than the 1 s route timeout (about 30 s for this input)
        worker.set_speed(0.00005)
        error = openai_error(post_bytes(cp.listener_port, b'{"input": "hi"}'), 504)
        assert error == {"message": "upstream request timeout", "type": "server_error", "param": None,
                         "code": "upstream_timeout"}

        # 503: the only worker drains: no healthy upstream
        Admin(cp).ok("POST", f"/v1/endpoints/{worker.id}/drain")
        wait_for(lambda: "eds_status_draining" in envoy.hosts().get(worker.id, {}).get("health_flags", ""), 30,
                 "Envoy to see the drain", procs)
        error = openai_error(post_bytes(cp.listener_port, b'{"input": "hi"}'), 503)
        assert error == {"message": "no healthy upstream", "type": "server_error", "param": None,
                         "code": "upstream_unavailable"}


def test_a_silent_ext_proc_behind_a_fail_closed_envoy_gets_a_504_that_says_so(tmp_path: Path) -> None:
    """Fail closed (the control plane's require_api_keys: no request may skip ext_proc), a stopped ext_proc
    leaves Envoy's 200 ms message timeout to answer: 504 with an empty body before, now a message that names
    what did not answer. After SIGCONT the same stack serves again."""
    with running_gateway(tmp_path, name="fail-closed",
                         cp_env={"INFERLB_CP_DATA_PLANE__REQUIRE_API_KEYS": "true"}) as gw:
        port = gw.cp.listener_port
        wait_for(lambda: post_bytes(port, b'{"input": "hi"}').status_code == 200, 30, "a first 200", gw.procs)
        pid = gw.ext_proc.proc.process.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            error = openai_error(post_bytes(port, b'{"input": "hi"}'), 504)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert error == {"message": "the gateway's request processor (ext_proc) did not answer in time; retry "
                                    "later", "type": "server_error", "param": None, "code": "gateway_timeout"}
        assert gw.envoy.stat("http.inferlb_http.ext_proc.message_timeouts") >= 1
        wait_for(lambda: post_bytes(port, b'{"input": "hi"}').status_code == 200, 30, "a 200 again", gw.procs)
