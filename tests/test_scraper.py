"""The real Scraper against real HTTP servers on 127.0.0.1 serving a worker-like /metrics."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Awaitable, Callable, Mapping

import pytest
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from control_plane.model import Endpoint, Health, Telemetry
from control_plane.telemetry.scraper import (
    ScrapeFailed,
    ScrapeOk,
    Scraper,
    ScraperConfig,
    ScrapeResult,
    apply_scrape_results,
    metrics_url,
)

from .conftest import free_port
from .test_telemetry import FakeWorkerMetrics

DEADLINE_S = 15.0


def metrics_app(metrics: FakeWorkerMetrics) -> Starlette:
    """A test backend: a worker's /metrics (values the test controls) and nothing else."""

    async def serve(request: Request) -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[Route("/metrics", serve)])


class _InProcessServer(uvicorn.Server):
    """A real HTTP server in the test's loop, leaving the test runner's signal handlers alone."""

    def capture_signals(self):  # type: ignore[no-untyped-def, override]
        return contextlib.nullcontext()


@contextlib.asynccontextmanager
async def serving(app: Starlette, port: int) -> AsyncIterator[None]:
    """Serve ``app`` on 127.0.0.1:``port`` until the block exits (then stop it, whatever happened)."""
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=1)
    server = _InProcessServer(config)
    task = asyncio.ensure_future(server.serve())
    try:
        await until(lambda: server.started or task.done(), "the test server to listen")
        if task.done():
            task.result()  # raise its startup error
        yield
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, DEADLINE_S)


async def until(predicate: Callable[[], object], what: str) -> None:
    """Poll ``predicate`` (cheap, in-loop) until true; fail after the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not predicate():
        if loop.time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class Controller:
    """The smallest controller: owns the endpoints and folds each scrape round into them."""

    def __init__(self, endpoints: tuple[Endpoint, ...], unhealthy_after: int,
                 before_round: Callable[[], None] = lambda: None) -> None:
        self.endpoints = endpoints
        self.unhealthy_after = unhealthy_after
        self.history: list[tuple[Endpoint, ...]] = []
        self.before_round = before_round
        self._changed = asyncio.Condition()

    async def on_results(self, results: Mapping[str, ScrapeResult]) -> None:
        self.endpoints = apply_scrape_results(self.endpoints, results, unhealthy_after=self.unhealthy_after)
        self.history.append(self.endpoints)
        self.before_round()
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(self, predicate: Callable[[Endpoint], bool], what: str) -> Endpoint:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: predicate(self.endpoints[0])), DEADLINE_S)
        return self.endpoints[0]


@contextlib.asynccontextmanager
async def scraping(scraper: Scraper, controller: Controller) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.ensure_future(scraper.run(lambda: controller.endpoints, controller.on_results))
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def run(coro: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro(), 60))


class RecordingObserver:
    def __init__(self) -> None:
        self.calls: list[tuple[str, bool, float]] = []

    def scrape_done(self, endpoint_id: str, ok: bool, duration_s: float) -> None:
        self.calls.append((endpoint_id, ok, duration_s))


@pytest.mark.servers
def test_telemetry_arrives_then_unhealthy_when_down_and_healthy_when_back() -> None:
    async def main() -> None:
        metrics = FakeWorkerMetrics()
        metrics.cpu.set(0.5)

        def traffic() -> None:  # every round, the worker serves a little more: windows have requests
            for _ in range(5):
                metrics.request(seconds=0.01, tokens=40, queue_s=0.001)

        port = free_port()
        controller = Controller((Endpoint("127.0.0.1", port),), unhealthy_after=3, before_round=traffic)
        observer = RecordingObserver()
        scraper = Scraper(ScraperConfig(interval_s=0.05, unhealthy_after=3), observer=observer)
        async with scraping(scraper, controller):
            async with serving(metrics_app(metrics), port):
                e = await controller.wait_for(
                    lambda e: e.telemetry is not None and e.telemetry.tokens_per_s > 0, "telemetry"
                )
                assert e.health is Health.HEALTHY and e.consecutive_scrape_failures == 0
                t = e.telemetry
                assert t is not None
                assert t.rps > 0 and t.latency_p50_s > 0 and t.cpu_utilization == pytest.approx(0.5)
                assert t.latency_per_token_s == pytest.approx(0.01 / 40)
                assert t.queue_wait_mean_s == pytest.approx(0.001)
                healthy_from = len(controller.history)

            down = await controller.wait_for(lambda e: e.health is Health.UNHEALTHY, "UNHEALTHY")
            assert down.consecutive_scrape_failures == 3
            after_up = controller.history[healthy_from:]
            before = [h[0] for h in after_up if h[0].consecutive_scrape_failures in (1, 2)]
            assert before and all(e.health is Health.HEALTHY for e in before)  # N-1 failures change nothing
            assert down.telemetry is not None  # the last telemetry stays (it goes stale by its age)

            async with serving(metrics_app(metrics), port):
                up = await controller.wait_for(lambda e: e.health is Health.HEALTHY, "HEALTHY again")
                assert up.consecutive_scrape_failures == 0

        oks = [ok for endpoint_id, ok, _ in observer.calls if endpoint_id == f"127.0.0.1:{port}"]
        assert True in oks and False in oks
        assert all(duration >= 0 for _, _, duration in observer.calls)

    run(main)


@pytest.mark.servers
def test_scrape_once_reports_non_worker_targets_and_http_errors() -> None:
    async def main() -> None:
        async def other(request: Request) -> Response:
            return PlainTextResponse("# TYPE http_requests_total counter\nhttp_requests_total 3\n")

        async def broken(request: Request) -> Response:
            return PlainTextResponse("oops", status_code=500)

        app = Starlette(routes=[Route("/metrics", other), Route("/broken/metrics", broken)])
        port, closed = free_port(), free_port()
        async with serving(app, port):
            not_worker = Endpoint("127.0.0.1", port)
            nobody = Endpoint("127.0.0.1", closed)
            async with Scraper().make_client() as client:
                results = await Scraper().scrape_once(client, (not_worker, nobody))
                broken_results = await Scraper(ScraperConfig(metrics_path="/broken/metrics")).scrape_once(
                    client, (not_worker,)
                )
        failed = results[not_worker.id]
        assert isinstance(failed, ScrapeFailed) and "not an inferlb worker" in failed.error
        assert "inferlb_worker_requests" in failed.error
        assert isinstance(results[nobody.id], ScrapeFailed) and "Connect" in results[nobody.id].error
        http_error = broken_results[not_worker.id]
        assert isinstance(http_error, ScrapeFailed) and "HTTP 500" in http_error.error

    run(main)


@pytest.mark.servers
def test_first_scrape_has_no_window_and_a_restart_is_not_negative() -> None:
    async def main() -> None:
        holder = {"metrics": FakeWorkerMetrics()}
        for _ in range(100):
            holder["metrics"].request(tokens=10)

        async def serve(request: Request) -> Response:
            return Response(holder["metrics"].text(), media_type=CONTENT_TYPE_LATEST)

        port = free_port()
        endpoint = Endpoint("127.0.0.1", port)
        scraper = Scraper()
        async with serving(Starlette(routes=[Route("/metrics", serve)]), port):
            async with scraper.make_client() as client:
                first = (await scraper.scrape_once(client, (endpoint,)))[endpoint.id]
                assert isinstance(first, ScrapeOk) and first.telemetry is None
                holder["metrics"] = FakeWorkerMetrics(start_time=1_700_000_500.0)  # the worker restarted
                holder["metrics"].request(tokens=10)
                second = (await scraper.scrape_once(client, (endpoint,)))[endpoint.id]
        assert isinstance(second, ScrapeOk) and second.telemetry is not None
        assert second.telemetry.rps > 0 and second.telemetry.tokens_per_s > 0

    run(main)


def test_apply_scrape_results_is_a_pure_update() -> None:
    telemetry = Telemetry(observed_at=5.0, rps=3.0)
    a, b, c = Endpoint("10.0.0.1", 1), Endpoint("10.0.0.2", 2, consecutive_scrape_failures=2), Endpoint("10.0.0.3", 3)
    endpoints = (a, b, c)
    results: dict[str, ScrapeResult] = {
        a.id: ScrapeOk(at=5.0, duration_s=0.01, telemetry=telemetry),
        b.id: ScrapeFailed(at=5.0, duration_s=0.01, error="ConnectError"),
        "10.0.0.9:9": ScrapeOk(at=5.0, duration_s=0.01, telemetry=None),  # removed meanwhile: ignored
    }
    new = apply_scrape_results(endpoints, results, unhealthy_after=3)
    assert endpoints == (a, b, c)  # inputs untouched
    assert new[0].health is Health.HEALTHY and new[0].telemetry == telemetry
    assert new[1].health is Health.UNHEALTHY and new[1].consecutive_scrape_failures == 3
    assert new[2] == c  # no result this round
    again = apply_scrape_results(new, {a.id: ScrapeOk(at=6.0, duration_s=0.01, telemetry=None)})
    assert again[0].telemetry == telemetry  # a scrape without a window keeps the last telemetry
    one_failure = apply_scrape_results(new, {a.id: ScrapeFailed(at=6.0, duration_s=0.01, error="x")})
    assert one_failure[0].health is Health.HEALTHY and one_failure[0].consecutive_scrape_failures == 1


def test_config_and_urls() -> None:
    assert ScraperConfig().effective_timeout_s == 0.5
    assert ScraperConfig(interval_s=5).effective_timeout_s == 1.0
    assert ScraperConfig(timeout_s=0.2).effective_timeout_s == 0.2
    with pytest.raises(ValueError, match="unhealthy_after"):
        ScraperConfig(unhealthy_after=0)
    with pytest.raises(ValueError, match="interval_s"):
        ScraperConfig(interval_s=0)
    assert metrics_url(Endpoint("127.0.0.1", 8101)) == "http://127.0.0.1:8101/metrics"
    assert metrics_url(Endpoint("::1", 8101)) == "http://[::1]:8101/metrics"
