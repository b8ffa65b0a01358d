"""A worker bounds a request cheaply before any per-token work, and parses a large body off its event loop
(issue 41).

A real worker app (the simulated engine: no ONNX model needed) on a real
uvicorn server in this process, so the per-token check and the parser can be
watched: a hostile body (2,048 arrays of 1,022 ids, just under the 4 MiB body
limit) is refused 400 ``too_many_tokens`` from its arrays' lengths, with no
token id read; and while such a body's parse is held in its thread, a small
request and the probes are answered. No assertion is about time: the held
parse is released only after the small request has its answer, which could
not happen if the parse ran on the event loop.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import orjson
import pytest
import uvicorn

import workers.service
from workers.__main__ import build_simulated_service
from workers.app import create_app
from workers.config import WorkerConfig
from workers.simulated import Simulation

from .conftest import free_port, wait_until

pytestmark = [pytest.mark.servers]

# 2,048 arrays of 1,022 one-digit ids: 3.99 MiB, under the worker's 4 MiB body limit (the body).
HOSTILE = orjson.dumps({"input": [[7] * 1022] * 2048})


class _ThreadServer(uvicorn.Server):
    """uvicorn in a thread of its own, leaving the test runner's signal handlers alone."""

    def capture_signals(self):  # type: ignore[no-untyped-def, override]
        return contextlib.nullcontext()


class _Worker:
    def __init__(self, url: str, server: _ThreadServer, thread: threading.Thread) -> None:
        self.url = url
        self.server = server
        self.thread = thread

    def post(self, body: bytes) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/embeddings", content=body, timeout=60,
                          headers={"content-type": "application/json"})


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[_Worker]:
    config = WorkerConfig(data_dir=tmp_path, port=free_port())
    service = build_simulated_service(config, Simulation(fixed_s=0.0, per_token_s=0.0))
    server = _ThreadServer(uvicorn.Config(create_app(service), host="127.0.0.1", port=config.port,
                                          log_config=None, lifespan="on"))
    thread = threading.Thread(target=server.run, name="worker-loop", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{config.port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(ready, 60, "the in-process worker to be ready")
        yield _Worker(url, server, thread)
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "the in-process worker did not stop"


def _spy(monkeypatch: pytest.MonkeyPatch, name: str, before: Callable[[tuple[Any, ...]], None] | None = None
         ) -> list[str]:
    """Wrap ``workers.service.<name>``; return the list of thread names it was called on."""
    real = getattr(workers.service, name)
    calls: list[str] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(threading.current_thread().name)
        if before is not None:
            before(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(workers.service, name, spy)
    return calls


def test_a_hostile_body_is_refused_from_its_lengths_before_any_token_id_is_read(
        worker: _Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    id_checks = _spy(monkeypatch, "check_token_ids")
    response = worker.post(HOSTILE)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "too_many_tokens", "input")
    assert "16384" in error["message"] and "split" in error["message"]
    assert id_checks == []  # refused with no per-token pass
    # The check is live: a request within the budget has its ids checked, and a bad one is named.
    assert worker.post(orjson.dumps({"input": [[1, 2, 3]]})).status_code == 200
    bad = worker.post(orjson.dumps({"input": [[1, 2], [3, -4]]}))
    assert bad.status_code == 400 and "input[1][1] = -4" in bad.json()["error"]["message"]
    assert len(id_checks) == 2


def test_an_array_too_long_without_truncation_is_refused_before_its_ids_are_read(
        worker: _Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    id_checks = _spy(monkeypatch, "check_token_ids")
    response = worker.post(orjson.dumps({"input": [[1] * 5000], "truncate": False}))
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert id_checks == []


def test_ids_past_the_models_limit_are_cut_unread(worker: _Worker) -> None:
    """Truncation comes before the per-token check: what the model never sees is never read."""
    response = worker.post(orjson.dumps({"input": [[5] * 300 + ["not an id"]]}))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 256


def test_small_requests_and_probes_are_answered_while_a_hostile_body_is_parsed(
        worker: _Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hostile bodies' parses are held in their threads until a small request and the probes have been
    answered: if parsing ran on the event loop, nothing else would be answered while one is held."""
    held = threading.Event()
    release = threading.Event()
    senders = 4

    def hold_large(args: tuple[Any, ...]) -> None:
        if args[0] == HOSTILE:
            held.set()
            assert release.wait(60), "the test never released the held parse"

    parses = _spy(monkeypatch, "parse_request_shape", hold_large)
    hostile: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: hostile.append(worker.post(HOSTILE))) for _ in range(senders)]
    for thread in threads:
        thread.start()
    try:
        assert held.wait(60), "no hostile body reached the parser"
        small = worker.post(orjson.dumps({"input": "one short sentence"}))
        health = httpx.get(f"{worker.url}/healthz", timeout=60)
        ready = httpx.get(f"{worker.url}/readyz", timeout=60)
        answered_while_held = not release.is_set()
    finally:
        release.set()
        for thread in threads:
            thread.join(60)
    assert answered_while_held
    assert small.status_code == 200, small.text
    assert (health.status_code, ready.status_code) == (200, 200)
    assert len(hostile) == senders
    assert all(r.status_code == 400 and r.json()["error"]["code"] == "too_many_tokens" for r in hostile)
    # Large bodies were parsed off the loop's thread, the small one on it.
    assert parses.count("worker-loop") == 1
    assert len(parses) == senders + 1

