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

from inferlb_runtime.hostport import authority

from ..model import Endpoint, Health, Telemetry
from .parse import Sample, parse_families, sample_from_families, smooth, window
from .served_models import ServedModels, ServedModelsReading, read_served_models

log = logging.getLogger(__name__)

# per endpoint: a worker exporting NaN (or a bad model name) every scrape logs once a minute
REFUSED_LOG_EVERY_S = 60.0


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
    # A /metrics body larger than this is a failed scrape: read in chunks and dropped at the cap.
    max_body_bytes: int = 4 * 1024 * 1024

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
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")

    @property
    def effective_timeout_s(self) -> float:
        """The whole scrape's deadline: connect, headers and body together (a server dripping one byte
        at a time never trips httpx's per-read timeout, so that alone bounds nothing)."""
        return self.timeout_s if self.timeout_s is not None else min(self.interval_s, 1.0)


@dataclass(frozen=True)
class ScrapeOk:
    """A successful scrape. ``telemetry`` is None on the first one: a window needs two samples.
    ``served``: what the worker says it serves (None: not read, e.g. a result built by hand)."""

    at: float
    duration_s: float
    telemetry: Telemetry | None
    served: ServedModels | None = None


@dataclass(frozen=True)
class ScrapeFailed:
    """A failed scrape: unreachable, past its deadline, over the body cap, not 200, or not an inferlb
    worker's metrics."""

    at: float
    duration_s: float
    error: str


ScrapeResult = ScrapeOk | ScrapeFailed


class ScrapeObserver(Protocol):
    """Where the control plane's own metrics learn about scrapes (e.g. Prometheus counters)."""

    def scrape_done(self, endpoint_id: str, ok: bool, duration_s: float) -> None: ...

    def samples_refused(self, endpoint_id: str, count: int) -> None: ...

    def endpoint_gone(self, endpoint_id: str) -> None:
        """The endpoint left the fleet: drop its labelled series."""


class _NoObserver:
    def scrape_done(self, endpoint_id: str, ok: bool, duration_s: float) -> None:
        pass

    def samples_refused(self, endpoint_id: str, count: int) -> None:
        pass

    def endpoint_gone(self, endpoint_id: str) -> None:
        pass


class Target(Protocol):
    """Anything with an IP address and a port serving /metrics: a worker's ``Endpoint``, an ext_proc replica."""

    @property
    def address(self) -> str: ...

    @property
    def port(self) -> int: ...


class ScrapeError(Exception):
    """Why one scrape produced no usable body: deadline, size cap, HTTP status."""


def metrics_url(target: Target, path: str = "/metrics") -> str:
    return f"http://{authority(target.address, target.port)}{path}"


async def fetch_metrics(client: httpx.AsyncClient, target: Target, config: ScraperConfig,
                        names: Sequence[str] = ()) -> str:
    """The body of ``target``'s /metrics, bounded in time and size; ``ScrapeError`` says why not.

    The deadline covers the whole exchange; the body is streamed and dropped
    at ``max_body_bytes``, so neither a slow nor a huge answer can hold the
    scraper's memory or time. ``names``: ask for these samples only (``name[]``,
    prometheus_client's convention; a server that ignores it sends everything).
    """
    limit = config.max_body_bytes
    deadline_s = config.effective_timeout_s
    params = {"name[]": list(names)} if names else None
    try:
        async with asyncio.timeout(deadline_s):
            async with client.stream("GET", metrics_url(target, config.metrics_path), params=params) as response:
                if response.status_code != 200:
                    raise ScrapeError(f"HTTP {response.status_code}")
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > limit:
                    raise ScrapeError(f"body of {declared} bytes is over the {limit}-byte cap")
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > limit:
                        raise ScrapeError(f"body over the {limit}-byte cap")
                    chunks.append(chunk)
    except TimeoutError:
        raise ScrapeError(f"no complete answer within the {deadline_s:g} s deadline") from None
    except httpx.HTTPError as exc:
        raise ScrapeError(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from None
    return b"".join(chunks).decode(response.encoding or "utf-8", errors="replace")


def parse_scrape(text: str, at: float) -> tuple[Sample, ServedModelsReading]:
    """One worker's ``/metrics`` body, parsed once: its telemetry sample and what it serves."""
    families = parse_families(text)
    return sample_from_families(families, at), read_served_models(families)


def _served_fields(e: Endpoint, served: ServedModels | None) -> dict[str, object]:
    """The ``Endpoint`` fields ``served`` changes (none when it is None or says what ``e`` already has)."""
    if served is None or (e.models, e.model_aliases, e.pool) == (served.models, served.aliases, served.pool):
        return {}
    return {"models": served.models, "model_aliases": served.aliases, "pool": served.pool}


def apply_scrape_results(
    endpoints: tuple[Endpoint, ...], results: Mapping[str, ScrapeResult], *, unhealthy_after: int = 3
) -> tuple[Endpoint, ...]:
    """Fold one round of results into the endpoints (pure).

    A success makes the endpoint HEALTHY, resets its failure count and takes
    the new telemetry (if the scrape produced one) and what the worker serves
    (kept as it was through failures). A failure counts up;
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
                **_served_fields(e, result.served),
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
        self._samples: dict[str, Sample] = {}  # the last clean sample of each endpoint
        self._refused_logged: dict[str, float] = {}  # endpoint id -> when its refused values were last logged
        self._names_logged: dict[str, float] = {}  # endpoint id -> when its invalid model names were last logged
        self._known: set[str] = set()  # the endpoints of the last round

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
            text = await fetch_metrics(client, endpoint, self.config)
            at = self._clock()
            # Parsing a few MiB of text takes milliseconds of CPU: off the loop, so xDS and ext_proc wait on nothing.
            sample, reading = await asyncio.to_thread(parse_scrape, text, at)
        except ScrapeError as exc:
            at = self._clock()
            return ScrapeFailed(at=at, duration_s=at - started, error=str(exc))
        except ValueError as exc:
            at = self._clock()
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return ScrapeFailed(at=at, duration_s=at - started, error=error)
        except Exception as exc:  # a bug here must cost one scrape, not the loop
            log.exception("scrape crashed", extra={"endpoint": endpoint.id})
            at = self._clock()
            return ScrapeFailed(at=at, duration_s=at - started, error=f"{type(exc).__name__}: {exc}")
        served = reading.served
        if reading.problems:
            self._note_bad_names(endpoint.id, reading.problems, at)
        if sample.refused:  # the worker answered (healthy), but this sample is not averaged in
            self._note_refused(endpoint.id, sample.refused, at)
            return ScrapeOk(at=at, duration_s=at - started, telemetry=None, served=served)
        if endpoint.id not in self._known:  # removed while this scrape ran: remember nothing of it
            return ScrapeOk(at=at, duration_s=at - started, telemetry=None)
        prev = self._samples.get(endpoint.id)
        self._samples[endpoint.id] = sample
        telemetry = None
        if prev is not None and sample.at > prev.at:
            telemetry = smooth(endpoint.telemetry, window(prev, sample), sample.at, self.config.alpha)
        return ScrapeOk(at=at, duration_s=at - started, telemetry=telemetry, served=served)

    def _note_bad_names(self, endpoint_id: str, problems: tuple[str, ...], at: float) -> None:
        last = self._names_logged.get(endpoint_id)
        if last is None or at - last >= REFUSED_LOG_EVERY_S:
            self._names_logged[endpoint_id] = at
            log.warning("invalid model or pool names in /metrics ignored",
                        extra={"endpoint": endpoint_id, "problems": list(problems)})

    def _note_refused(self, endpoint_id: str, count: int, at: float) -> None:
        self._observer.samples_refused(endpoint_id, count)
        last = self._refused_logged.get(endpoint_id)
        if last is None or at - last >= REFUSED_LOG_EVERY_S:
            self._refused_logged[endpoint_id] = at
            log.warning("NaN or infinite values in /metrics refused; telemetry kept from the last clean scrape",
                        extra={"endpoint": endpoint_id, "refused": count})

    def _forget_gone(self, endpoints: Sequence[Endpoint]) -> None:
        """Removed endpoints: forget their samples, so a re-add starts fresh, and drop their metric series."""
        live = {e.id for e in endpoints}
        for gone in self._known - live:
            self._samples.pop(gone, None)
            self._refused_logged.pop(gone, None)
            self._names_logged.pop(gone, None)
            self._observer.endpoint_gone(gone)
        self._known = live

    def _report(self, results: Mapping[str, ScrapeResult]) -> None:
        for endpoint_id, result in results.items():
            self._observer.scrape_done(endpoint_id, isinstance(result, ScrapeOk), result.duration_s)
            if isinstance(result, ScrapeFailed):
                log.debug("scrape failed", extra={"endpoint": endpoint_id, "error": result.error})

    async def scrape_once(self, client: httpx.AsyncClient, endpoints: Sequence[Endpoint]) -> dict[str, ScrapeResult]:
        """Scrape all ``endpoints`` concurrently, each within its deadline; smoothing starts from each
        endpoint's current telemetry. Returns when every scrape has ended (at most one deadline)."""
        self._forget_gone(endpoints)
        results = await asyncio.gather(*(self._scrape(client, e) for e in endpoints))
        by_id = {e.id: r for e, r in zip(endpoints, results)}
        self._report(by_id)
        return by_id

    async def run(self, get_endpoints: Callable[[], Sequence[Endpoint]], on_results: OnResults) -> None:
        """Scrape every ``interval_s`` and hand the results to ``on_results`` until cancelled.

        A round hands over what has finished when every scrape has ended or
        the next tick comes, whichever is first: a slow endpoint never holds
        back the others' results. Its scrape keeps running (within its own
        deadline) and its result comes with a later round; it is not scraped
        again meanwhile, so there is never more than one scrape per endpoint.
        Rounds never overlap: ``on_results`` (sync or async) finishes before
        the next round reads ``get_endpoints()``, so each round smooths from
        the state the previous one produced. A failing callback is logged,
        not fatal; cancel the task to stop (the client and any scrape still
        running are closed on the way out).
        """
        loop = asyncio.get_running_loop()
        inflight: dict[str, asyncio.Task[ScrapeResult]] = {}
        async with self.make_client() as client:
            next_round = loop.time()
            try:
                while True:
                    next_round += self.config.interval_s
                    try:
                        endpoints = tuple(get_endpoints())
                        self._forget_gone(endpoints)
                        for e in endpoints:
                            if e.id not in inflight:
                                inflight[e.id] = asyncio.create_task(self._scrape(client, e), name=f"scrape {e.id}")
                        if inflight:
                            await asyncio.wait(inflight.values(), timeout=max(0.0, next_round - loop.time()))
                        finished = [i for i, t in inflight.items() if t.done()]
                        # An endpoint removed while its scrape ran gets no result: it is not in the fleet.
                        results = {i: inflight.pop(i).result() for i in finished}
                        results = {i: r for i, r in results.items() if i in self._known}
                        self._report(results)
                        outcome = on_results(results)
                        if inspect.isawaitable(outcome):
                            await outcome
                    except Exception:  # the controller's callbacks: log, keep scraping
                        log.exception("scrape round failed")
                    now = loop.time()
                    if next_round < now:  # fell behind (slow callback): skip, do not burst
                        next_round = now
                    await asyncio.sleep(next_round - now)
            finally:
                for task in inflight.values():
                    task.cancel()
                await asyncio.gather(*inflight.values(), return_exceptions=True)
