"""Scrape every worker's ``/metrics`` on a timer: the control plane's only I/O toward workers.

The scraper owns just what it needs to compute windows (the previous
``Sample`` per endpoint); the endpoints, their health and telemetry belong to
the controller. Each round it hands the controller a mapping of results, and
the controller folds them into its state with the pure
``apply_scrape_results``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping, Protocol, Sequence

import httpx

from .model import Endpoint, Health, Telemetry
from .telemetry import Sample, parse_sample, smooth, window

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScraperConfig:
    """How often and how patiently to scrape."""

    interval_s: float = 0.5
    # None: min(interval_s, 1.0) -- a scrape must never outlive its round by much
    timeout_s: float | None = None
    unhealthy_after: int = 3
    alpha: float = 0.3  # EWMA weight of the newest window
    metrics_path: str = "/metrics"
    # concurrent scrapes (kept-alive connections); beyond it, scrapes queue within their timeout
    max_connections: int = 256

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.unhealthy_after < 1:
            raise ValueError(f"unhealthy_after must be >= 1, got {self.unhealthy_after}")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")

    @property
    def effective_timeout_s(self) -> float:
        return self.timeout_s if self.timeout_s is not None else min(self.interval_s, 1.0)


@dataclass(frozen=True)
class ScrapeOk:
    """A successful scrape. ``telemetry`` is None on the first one: a window needs two samples."""

    at: float
    duration_s: float
    telemetry: Telemetry | None


@dataclass(frozen=True)
class ScrapeFailed:
    """A failed scrape: unreachable, timed out, not 200, or not an inferlb worker's metrics."""

    at: float
    duration_s: float
    error: str


ScrapeResult = ScrapeOk | ScrapeFailed


class ScrapeObserver(Protocol):
    """Where the control plane's own metrics learn about scrapes (e.g. Prometheus counters)."""

    def scrape_done(self, endpoint_id: str, ok: bool, duration_s: float) -> None: ...


class _NoObserver:
    def scrape_done(self, endpoint_id: str, ok: bool, duration_s: float) -> None:
        pass


def metrics_url(endpoint: Endpoint, path: str = "/metrics") -> str:
    host = f"[{endpoint.address}]" if ":" in endpoint.address else endpoint.address  # IPv6 literal
    return f"http://{host}:{endpoint.port}{path}"


def apply_scrape_results(
    endpoints: tuple[Endpoint, ...], results: Mapping[str, ScrapeResult], *, unhealthy_after: int = 3
) -> tuple[Endpoint, ...]:
    """Fold one round of results into the endpoints (pure).

    A success makes the endpoint HEALTHY, resets its failure count and takes
    the new telemetry (if the scrape produced one). A failure counts up;
    ``unhealthy_after`` in a row make it UNHEALTHY; fewer leave its health as
    it was. Endpoints without a result (added mid-round) are unchanged;
    results for endpoints no longer present are ignored.
    """
    updated = []
    for e in endpoints:
        result = results.get(e.id)
        if isinstance(result, ScrapeOk):
            e = dataclasses.replace(
                e,
                health=Health.HEALTHY,
                consecutive_scrape_failures=0,
                telemetry=result.telemetry if result.telemetry is not None else e.telemetry,
            )
        elif isinstance(result, ScrapeFailed):
            failures = e.consecutive_scrape_failures + 1
            health = Health.UNHEALTHY if failures >= unhealthy_after else e.health
            e = dataclasses.replace(e, health=health, consecutive_scrape_failures=failures)
        updated.append(e)
    return tuple(updated)


OnResults = Callable[[Mapping[str, ScrapeResult]], Awaitable[None] | None]


class Scraper:
    """Scrapes endpoints concurrently with one shared ``httpx.AsyncClient``.

    ``run`` loops every ``interval_s`` until cancelled; ``scrape_once`` does
    one round (the controller or a test may drive it directly).
    """

    def __init__(
        self,
        config: ScraperConfig | None = None,
        observer: ScrapeObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config or ScraperConfig()
        self._observer = observer or _NoObserver()
        self._clock = clock
        self._samples: dict[str, Sample] = {}

    def make_client(self) -> httpx.AsyncClient:
        # trust_env=False: a proxy from the environment must not sit between us and workers.
        n = self.config.max_connections
        return httpx.AsyncClient(
            timeout=self.config.effective_timeout_s,
            limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
            trust_env=False,
        )

    async def _scrape(self, client: httpx.AsyncClient, endpoint: Endpoint) -> ScrapeResult:
        started = self._clock()
        try:
            response = await client.get(metrics_url(endpoint, self.config.metrics_path))
            at = self._clock()
            if response.status_code != 200:
                raise ValueError(f"HTTP {response.status_code}")
            sample = parse_sample(response.text, at)
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
            at = self._clock()
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return ScrapeFailed(at=at, duration_s=at - started, error=error)
        except Exception as exc:  # a bug here must cost one scrape, not the loop
            log.exception("scrape crashed", extra={"endpoint": endpoint.id})
            at = self._clock()
            return ScrapeFailed(at=at, duration_s=at - started, error=f"{type(exc).__name__}: {exc}")
        prev = self._samples.get(endpoint.id)
        self._samples[endpoint.id] = sample
        telemetry = None
        if prev is not None and sample.at > prev.at:
            telemetry = smooth(endpoint.telemetry, window(prev, sample), sample.at, self.config.alpha)
        return ScrapeOk(at=at, duration_s=at - started, telemetry=telemetry)

    async def scrape_once(self, client: httpx.AsyncClient, endpoints: Sequence[Endpoint]) -> dict[str, ScrapeResult]:
        """Scrape all ``endpoints`` concurrently; smoothing starts from each endpoint's current telemetry."""
        live = {e.id for e in endpoints}
        for gone in set(self._samples) - live:  # removed endpoints: forget, so a re-add starts fresh
            del self._samples[gone]
        results = await asyncio.gather(*(self._scrape(client, e) for e in endpoints))
        by_id = {e.id: r for e, r in zip(endpoints, results)}
        for endpoint_id, result in by_id.items():
            self._observer.scrape_done(endpoint_id, isinstance(result, ScrapeOk), result.duration_s)
            if isinstance(result, ScrapeFailed):
                log.debug("scrape failed", extra={"endpoint": endpoint_id, "error": result.error})
        return by_id

    async def run(self, get_endpoints: Callable[[], Sequence[Endpoint]], on_results: OnResults) -> None:
        """Scrape every ``interval_s`` and hand each round to ``on_results`` until cancelled.

        Rounds never overlap: ``on_results`` (sync or async) finishes before
        the next round reads ``get_endpoints()``, so each round smooths from
        the state the previous one produced. A failing callback is logged,
        not fatal; cancel the task to stop (the client is closed on the way out).
        """
        loop = asyncio.get_running_loop()
        async with self.make_client() as client:
            next_round = loop.time()
            while True:
                try:
                    results = await self.scrape_once(client, tuple(get_endpoints()))
                    outcome = on_results(results)
                    if inspect.isawaitable(outcome):
                        await outcome
                except Exception:  # the controller's callbacks: log, keep scraping
                    log.exception("scrape round failed")
                next_round += self.config.interval_s
                now = loop.time()
                if next_round < now:  # fell behind (slow round): skip, do not burst
                    next_round = now
                await asyncio.sleep(next_round - now)
