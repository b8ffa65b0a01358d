"""The scraper's bounds on real sockets: a total deadline a slow-dripping /metrics cannot stretch, a body cap,
rounds that never wait for the slow one, parsing off the event loop, and NaN/Inf refused without poisoning."""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import threading
from typing import AsyncIterator, Mapping

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

import control_plane.telemetry.scraper as scraper_module
from control_plane.model import Endpoint
from control_plane.telemetry.scraper import ScrapeFailed, ScrapeOk, Scraper, ScraperConfig, ScrapeResult

from .conftest import free_port
from .test_scraper import DEADLINE_S, metrics_app, run, serving, until
from .test_telemetry import FakeWorkerMetrics

pytestmark = pytest.mark.servers


class DripServer:
    """An HTTP/1.1 server that answers 200 with a valid worker /metrics body, ``chunk`` bytes every ``gap_s``:
    each read is quick, so httpx's per-read timeout never trips, yet the whole answer takes long."""

    def __init__(self, body: bytes, chunk: int, gap_s: float) -> None:
        self.body, self.chunk, self.gap_s = body, chunk, gap_s
        self.connections = 0
        self.finished = 0  # answers sent to the end
        self._handlers: set[asyncio.Task[None]] = set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._handlers.add(asyncio.current_task())  # type: ignore[arg-type]
        self.connections += 1
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(self.body))
            for i in range(0, len(self.body), self.chunk):
                writer.write(self.body[i:i + self.chunk])
                await writer.drain()
                await asyncio.sleep(self.gap_s)
            self.finished += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[int]:
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        try:
            yield server.sockets[0].getsockname()[1]
        finally:
            server.close()
            for task in list(self._handlers):
                task.cancel()
            await asyncio.gather(*self._handlers, return_exceptions=True)
            await server.wait_closed()


def _worker_body() -> bytes:
    m = FakeWorkerMetrics()
    m.request(tokens=10)
    return m.text().encode()


def test_a_slow_dripping_metrics_fails_at_the_total_deadline() -> None:
    """Before: only httpx's per-read timeout applied; 50 bytes every 20 ms never trip it, so the scrape lasted
    as long as the server liked (here ~2 s, then it succeeded). Now the whole answer has one deadline."""
    async def main() -> None:
        drip = DripServer(_worker_body(), chunk=50, gap_s=0.02)
        async with drip.serving() as port:
            scraper = Scraper(ScraperConfig(interval_s=0.5, timeout_s=0.3))
            async with scraper.make_client() as client:
                results = await scraper.scrape_once(client, (Endpoint("127.0.0.1", port),))
        result = results[f"127.0.0.1:{port}"]
        assert isinstance(result, ScrapeFailed), result
        assert "deadline" in result.error and drip.finished == 0

    run(main)


@pytest.mark.parametrize("streamed", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_cap_is_a_failed_scrape(streamed: bool) -> None:
    async def main() -> None:
        body = _worker_body() + b"# padding\n" * 1000  # valid exposition, ~10 kB over the worker's own

        async def serve(request: Request) -> Response:
            if streamed:  # no Content-Length: the cap must stop the read itself
                return StreamingResponse(iter([body[i:i + 1024] for i in range(0, len(body), 1024)]),
                                         media_type="text/plain")
            return Response(body, media_type="text/plain")

        port = free_port()
        async with serving(Starlette(routes=[Route("/metrics", serve)]), port):
            endpoint = Endpoint("127.0.0.1", port)
            capped = Scraper(ScraperConfig(max_body_bytes=4096))
            roomy = Scraper(ScraperConfig())
            async with capped.make_client() as client:
                over = (await capped.scrape_once(client, (endpoint,)))[endpoint.id]
                fits = (await roomy.scrape_once(client, (endpoint,)))[endpoint.id]
        assert isinstance(over, ScrapeFailed) and "4096-byte cap" in over.error, over
        assert isinstance(fits, ScrapeOk), fits

    run(main)


def test_a_slow_endpoint_does_not_hold_back_the_round() -> None:
    """Before: a round handed over its results when the slowest scrape ended, so every endpoint's telemetry
    waited for the slow one. Now the fast one's results come every tick; the slow one's when it ends (at its
    deadline), and it is never scraped twice at once."""
    async def main() -> None:
        fast_metrics = FakeWorkerMetrics()
        drip = DripServer(_worker_body(), chunk=1, gap_s=0.05)  # minutes to finish: only the deadline ends it
        fast_port = free_port()
        rounds: list[Mapping[str, ScrapeResult]] = []
        async with drip.serving() as slow_port, serving(metrics_app(fast_metrics), fast_port):
            fast, slow = Endpoint("127.0.0.1", fast_port), Endpoint("127.0.0.1", slow_port)
            scraper = Scraper(ScraperConfig(interval_s=0.1, timeout_s=3.0))
            task = asyncio.ensure_future(scraper.run(lambda: (fast, slow), rounds.append))
            try:
                await until(lambda: any(slow.id in r for r in rounds), "the slow scrape's result")
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        first_fast = next(r for r in rounds if fast.id in r)
        assert slow.id not in first_fast  # handed over without waiting for the slow one
        slow_result = next(r[slow.id] for r in rounds if slow.id in r)
        assert isinstance(slow_result, ScrapeFailed) and "deadline" in slow_result.error
        before_slow = rounds[:next(i for i, r in enumerate(rounds) if slow.id in r)]
        assert sum(fast.id in r for r in before_slow) >= 2  # the fast one went on being scraped meanwhile
        assert drip.connections <= sum(slow.id in r for r in rounds) + 1  # one scrape at a time per endpoint

    run(main)


def test_parsing_runs_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[int] = []
    real = scraper_module.parse_scrape

    def recording(text: str, at: float):  # type: ignore[no-untyped-def]
        threads.append(threading.get_ident())
        return real(text, at)

    monkeypatch.setattr(scraper_module, "parse_scrape", recording)

    async def main() -> None:
        port = free_port()
        async with serving(metrics_app(FakeWorkerMetrics()), port):
            scraper = Scraper()
            async with scraper.make_client() as client:
                result = await scraper.scrape_once(client, (Endpoint("127.0.0.1", port),))
        assert isinstance(result[f"127.0.0.1:{port}"], ScrapeOk)
        assert threads and threading.get_ident() not in threads

    run(main)


class RefusalObserver:
    def __init__(self) -> None:
        self.refused: list[tuple[str, int]] = []

    def scrape_done(self, endpoint_id: str, ok: bool, duration_s: float) -> None:
        pass

    def samples_refused(self, endpoint_id: str, count: int) -> None:
        self.refused.append((endpoint_id, count))

    def endpoint_gone(self, endpoint_id: str) -> None:
        pass


def test_a_nan_scrape_is_refused_and_never_enters_the_average() -> None:
    """Before: a NaN counter went into the window and the EWMA, and NaN stays NaN in every later average."""
    async def main() -> None:
        metrics = FakeWorkerMetrics()
        poison = {"on": False}

        async def serve(request: Request) -> Response:
            text = metrics.text()
            if poison["on"]:  # the worker's token counter reads NaN in this scrape
                text = re.sub(r"(?m)^inferlb_worker_tokens_total .*$", "inferlb_worker_tokens_total NaN", text)
            return Response(text, media_type="text/plain")

        port = free_port()
        observer = RefusalObserver()
        async with serving(Starlette(routes=[Route("/metrics", serve)]), port):
            endpoint = Endpoint("127.0.0.1", port)
            scraper = Scraper(ScraperConfig(), observer=observer)
            async with scraper.make_client() as client:
                async def scrape() -> ScrapeResult:
                    nonlocal endpoint
                    result = (await scraper.scrape_once(client, (endpoint,)))[endpoint.id]
                    if isinstance(result, ScrapeOk) and result.telemetry is not None:
                        endpoint = Endpoint(endpoint.address, endpoint.port, telemetry=result.telemetry)
                    return result

                await scrape()
                metrics.request(tokens=10)
                assert isinstance(await scrape(), ScrapeOk) and endpoint.telemetry is not None
                poison["on"] = True
                metrics.request(tokens=10)
                poisoned = await scrape()
                assert isinstance(poisoned, ScrapeOk) and poisoned.telemetry is None  # answered: still healthy
                poison["on"] = False
                metrics.request(tokens=10)
                clean = await scrape()
        assert observer.refused == [(endpoint.id, 1)]
        assert isinstance(clean, ScrapeOk) and clean.telemetry is not None
        for name, value in vars(clean.telemetry).items():
            assert math.isfinite(value), name
        assert clean.telemetry.tokens_per_s > 0

    run(main)
