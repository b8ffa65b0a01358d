"""Readiness only after warm-up, a failed warm-up never turns ready, and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from pathlib import Path

import httpx
import pytest
import uvicorn

from workers.app import create_app
from workers.config import WorkerConfig
from workers.engine import Engine
from workers.model_store import prepare_models
from workers.model_catalog import KNOWN_VERSIONS
from workers.service import EmbeddingService
from workers.tokenization import load_tokenizer

from .conftest import free_port, running_worker, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.model]


class _InProcessServer(uvicorn.Server):
    """A real HTTP server in the test's loop, leaving the test runner's signal handlers alone."""

    def capture_signals(self):  # type: ignore[no-untyped-def, override]
        return contextlib.nullcontext()


async def _serve_in_process(service: EmbeddingService, port: int):  # type: ignore[no-untyped-def]
    config = uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_config=None, lifespan="on")
    server = _InProcessServer(config)
    task = asyncio.ensure_future(server.serve())
    return server, task


async def _poll(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (result := await predicate()):
        if loop.time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
    return result


async def _readyz_saying(http: httpx.AsyncClient, url: str, reason: str) -> httpx.Response:
    """The first ``/readyz`` answer whose reason contains ``reason`` (polled: the server may not listen yet)."""

    async def saying() -> httpx.Response | None:
        try:
            r = await http.get(f"{url}/readyz")
        except httpx.TransportError:
            return None
        return r if reason in r.json().get("reason", "") else None

    return await _poll(saying, 60, f"/readyz to say {reason!r}")


def _service(data_dir: Path, engine_factory, models: tuple[str, ...] = ("all-MiniLM-L6-v2-int8",)):  # type: ignore[no-untyped-def]
    artifacts = prepare_models(data_dir)
    return EmbeddingService(WorkerConfig(data_dir=data_dir, models=models), [KNOWN_VERSIONS[m].info for m in models],
                            load_tokenizer(artifacts.tokenizer), engine_factory)


class _CountingEngine:
    """A real engine that counts the batches it ran."""

    def __init__(self, path: Path) -> None:
        self.engine = Engine(path)
        self.batches = 0

    @property
    def dimensions(self) -> int:
        return self.engine.dimensions

    def embed(self, batch):  # type: ignore[no-untyped-def]
        self.batches += 1
        return self.engine.embed(batch)


@pytest.mark.parametrize("models", [("all-MiniLM-L6-v2-int8",), ("all-MiniLM-L6-v2-int8", "all-MiniLM-L6-v2-fp32")])
def test_ready_only_once_every_model_is_loaded_and_warmed_up(data_dir: Path, models: tuple[str, ...]) -> None:
    """While the last version's engine is held back the worker stays unready, though the versions before it are
    loaded and warmed up; ready means every version ran a warm-up inference."""
    gate = threading.Event()
    artifacts = prepare_models(data_dir)
    engines: dict[str, _CountingEngine] = {}

    def engine_factory(model) -> _CountingEngine:  # type: ignore[no-untyped-def]
        if model.name == models[-1]:
            assert gate.wait(60), "test never opened the gate"
        engines[model.name] = _CountingEngine(artifacts.fp32 if model.name.endswith("fp32") else artifacts.int8)
        return engines[model.name]

    async def main() -> None:
        service = _service(data_dir, engine_factory, models)
        port = free_port()
        server, task = await _serve_in_process(service, port)
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                not_ready = await _readyz_saying(http, url, f"warming up {models[-1]}")
                assert not_ready.status_code == 503
                assert all(engines[m].batches >= 1 for m in models[:-1])  # warmed up, and still not ready
                early = await http.post(f"{url}/v1/embeddings", json={"input": "too early"})
                assert early.status_code == 503 and early.json()["error"]["code"] == "not_ready"

                gate.set()

                async def ready() -> bool:
                    return (await http.get(f"{url}/readyz")).status_code == 200

                await _poll(ready, 60, "readiness after every warm-up")
                assert all(engines[m].batches >= 1 for m in models)  # the warm-up batches really ran
                assert (await http.get(f"{url}/readyz")).json()["models"] == list(models)
                ok = await http.post(f"{url}/v1/embeddings", json={"input": "now"})
                assert ok.status_code == 200
        finally:
            gate.set()
            server.should_exit = True
            await asyncio.wait_for(task, 60)

    asyncio.run(main())


def test_a_failed_warm_up_keeps_the_worker_unready(data_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not an onnx model")

    async def main() -> None:
        service = _service(data_dir, lambda model: Engine(broken))
        port = free_port()
        server, task = await _serve_in_process(service, port)
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                response = await _readyz_saying(http, url, "failed")
                assert response.status_code == 503
                assert "warm-up failed" in response.json()["reason"]
                assert (await http.get(f"{url}/healthz")).status_code == 200
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 60)

    asyncio.run(main())


def test_sigterm_finishes_in_flight_requests_and_refuses_new_ones(data_dir: Path, tmp_path: Path) -> None:
    long_text = "graceful shutdown keeps every accepted request " * 40
    body = {"input": [long_text] * 48}
    with running_worker(data_dir, tmp_path, "--cache-max-bytes", "0") as worker:  # every copy computed
        results: list[httpx.Response | BaseException] = []

        def send() -> None:
            try:
                results.append(httpx.post(f"{worker.url}/v1/embeddings", json=body, timeout=120))
            except BaseException as exc:  # recorded, asserted below
                results.append(exc)

        clients = [threading.Thread(target=send) for _ in range(6)]
        for t in clients:
            t.start()

        def all_in_flight() -> bool:
            text = httpx.get(f"{worker.url}/metrics", timeout=10).text
            line = next(l for l in text.splitlines() if l.startswith("inferlb_worker_inflight_requests "))
            return float(line.split()[1]) == 6

        wait_until(all_in_flight, 60, "six requests in flight")
        worker.process.send_signal(signal.SIGTERM)
        try:
            refused = httpx.post(f"{worker.url}/v1/embeddings", json={"input": "late"}, timeout=30)
            assert refused.status_code == 503
        except httpx.TransportError:
            pass  # the listener is already closed: refused as well
        for t in clients:
            t.join(120)
        assert worker.process.wait(60) == 0, worker.log()
        assert len(results) == 6
        for r in results:
            assert isinstance(r, httpx.Response), r
            assert r.status_code == 200
            assert len(r.json()["data"]) == 48
        assert '"draining"' in worker.log()
