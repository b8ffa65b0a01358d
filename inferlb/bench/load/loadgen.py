"""The open-loop load generator: send each request of a trace at its scheduled time.

Open loop (the wrk2 lesson): a request is sent when the trace says, whether
or not earlier ones have returned, and its latency runs from its *scheduled*
send time, not from when the client got round to sending it. A closed-loop
client that waits for answers sends less exactly when the system is slow and
hides the queueing it caused (coordinated omission); this one cannot.

Client choice: aiohttp with one keep-alive connection pool (HTTP/1.1), on
uvloop where installed. It runs on the same cores as the fleet it measures,
so CPU per request matters. Measured here (2 cores, 300 req/s open loop for
8 s against one simulated worker, the default mix): aiohttp about 1,500
requests per client CPU-second, ``httpx.AsyncClient`` (same pool size) about
80, as its pool degrades with many requests in flight. The generator reports its own CPU
time and how late it sent (``extra``: ``client_cpu_s``, ``send_lag_*``) so a
saturated client is visible instead of silently skewing the figures.

Which worker served a request: the first of ``worker_headers`` present in the
response (workers set ``x-inferlb-worker: host:port``; Envoy with ext_proc
adds ``x-inferlb-endpoint``). Answers without one count as ``"?"``.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..report.histogram import LatencyHistogram
from ..report.results import RunResult
from .trace import Trace

if TYPE_CHECKING:
    import aiohttp

WORKER_HEADERS = ("x-inferlb-worker", "x-inferlb-endpoint")
UNKNOWN_WORKER = "?"
DEFAULT_MAX_CONNECTIONS = 1024


@dataclass(frozen=True)
class Answer:
    """One request's end, for an observer that needs the timeline (a fault harness), not just the totals.

    Times are seconds from the start of the trace; ``status`` is None when no answer came (``error`` says
    why: an exception's class name, or "timeout"); ``headers``: those of ``worker_headers`` present."""

    send_at_s: float
    done_at_s: float
    status: int | None
    error: str | None
    headers: Mapping[str, str]


@dataclass
class LoadOutcome:
    """What one run of ``run_load`` measured. Only requests scheduled at or after ``warmup_s`` count.

    ``sent``/``completed``/``errors``/``timeouts`` and the histogram cover the
    measured requests; ``warmup_sent`` the ones before. ``completed`` is 2xx
    answers; ``errors`` non-2xx answers and connection errors; ``timeouts``
    requests with no answer ``timeout_s`` after their scheduled time.
    """

    offered_rps: float
    measured_s: float  # the measured window: trace duration minus warm-up
    slo_s: float
    histogram: LatencyHistogram = field(default_factory=LatencyHistogram)  # 2xx answers only
    # 2xx answers, from when the request's headers went out on a connection (not from its scheduled
    # time): the service time alone, without the wait behind a late send or for a free connection
    service: LatencyHistogram = field(default_factory=LatencyHistogram)
    sent: int = 0
    completed: int = 0
    within_slo: int = 0
    errors: int = 0
    timeouts: int = 0
    warmup_sent: int = 0
    statuses: Counter[int] = field(default_factory=Counter)  # HTTP status -> answers (measured)
    refused: LatencyHistogram = field(default_factory=LatencyHistogram)  # non-2xx answers: how fast they came
    error_kinds: Counter[str] = field(default_factory=Counter)  # exception class -> count (measured)
    spread: Counter[str] = field(default_factory=Counter)  # worker id -> 2xx answers (measured)
    send_lag_p50_s: float = 0.0
    send_lag_p99_s: float = 0.0  # how late the client sent, vs the schedule
    send_lag_max_s: float = 0.0
    client_cpu_s: float = 0.0  # CPU seconds the generator process used during the run
    max_inflight: int = 0  # requests sent and not yet answered, at most (all of them, warm-up included)
    wall_s: float = 0.0

    @property
    def goodput_rps(self) -> float:
        """Completions within the SLO per second of the measured window."""
        return self.within_slo / self.measured_s if self.measured_s > 0 else 0.0

    def to_result(self, configuration: str, *, load: float = 0.0, run: str = "steady",
                  extra: Mapping[str, Any] | None = None) -> RunResult:
        """The ``RunResult`` of this run (the shape shared with the simulator)."""
        s = self.histogram.summary()
        return RunResult(
            configuration=configuration, load=load, offered_rps=self.offered_rps, duration_s=self.measured_s,
            sent=self.sent, completed=self.completed, errors=self.errors, timeouts=self.timeouts,
            p50_s=s.p50_s, p90_s=s.p90_s, p99_s=s.p99_s, p999_s=s.p999_s, mean_s=s.mean_s,
            goodput_rps=self.goodput_rps, slo_s=self.slo_s, run=run, source="live",
            spread=dict(sorted(self.spread.items())), cdf=self.histogram.cdf_points(),
            extra={
                "max_s": s.max_s,
                "warmup_sent": self.warmup_sent,
                "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "error_kinds": dict(self.error_kinds),
                "send_lag_p50_s": self.send_lag_p50_s,
                "send_lag_p99_s": self.send_lag_p99_s,
                "service_p50_s": self.service.percentile(50) if self.service.count else None,
                "service_p99_s": self.service.percentile(99) if self.service.count else None,
                "max_inflight": self.max_inflight,
                "send_lag_max_s": self.send_lag_max_s,
                "client_cpu_s": self.client_cpu_s,
                "wall_s": self.wall_s,
                "clamped": self.histogram.clamped,
                **(extra or {}),
            },
        )


async def run_load(
    url: str,
    trace: Trace,
    bodies: Sequence[bytes],
    *,
    slo_s: float,
    timeout_s: float,
    warmup_s: float = 0.0,
    progress: bool = True,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    headers: Mapping[str, str] | None = None,
    worker_headers: Sequence[str] = WORKER_HEADERS,
    on_answer: Callable[[Answer], None] | None = None,
    stop: asyncio.Event | None = None,
) -> LoadOutcome:
    """POST ``bodies[i]`` to ``url`` at ``trace.send_at_s[i]`` seconds from now, for every ``i``.

    Returns when every request has answered, or ``timeout_s`` after the last
    scheduled send at the latest: stragglers are cancelled and count as
    timeouts. ``progress`` shows a tqdm bar on stderr (only on a terminal). ``on_answer`` sees every
    request's end (warm-up included), in the order they end. Once ``stop`` is set, nothing more is sent
    (the trace is cut short: a run that ends on a condition); the requests in flight are still awaited.
    Raises ``ValueError`` for arguments that cannot make a run.
    """
    import aiohttp

    _check(url, trace, bodies, slo_s=slo_s, timeout_s=timeout_s, warmup_s=warmup_s, max_connections=max_connections)
    run = _LoadRun(url, trace, bodies, slo_s=slo_s, timeout_s=timeout_s, warmup_s=warmup_s, headers=headers,
                   worker_headers=worker_headers, on_answer=on_answer, progress=progress)
    cpu0 = time.process_time()
    connector = aiohttp.TCPConnector(limit=max_connections, force_close=False, ttl_dns_cache=None)
    timeout = aiohttp.ClientTimeout(total=None)  # each request has its own deadline (see ``_LoadRun.one``)
    tracing = aiohttp.TraceConfig()
    tracing.on_request_headers_sent.append(run.on_headers_sent)
    started_wall = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                     skip_auto_headers=("User-Agent",), trace_configs=[tracing]) as session:
        try:
            await run.send_all(session, stop)
        finally:
            await run.cancel_stragglers()
    outcome = run.outcome
    outcome.wall_s = time.perf_counter() - started_wall
    outcome.client_cpu_s = time.process_time() - cpu0
    if run.lags.size:
        outcome.send_lag_p50_s = float(np.percentile(run.lags, 50))
        outcome.send_lag_p99_s = float(np.percentile(run.lags, 99))
        outcome.send_lag_max_s = float(run.lags.max())
    return outcome


class _LoadRun:
    """One run of ``run_load``: the trace's schedule, the requests in flight and what they measured. Its
    methods are the run's steps: sending on schedule, one request's life, cutting off the stragglers."""

    def __init__(self, url: str, trace: Trace, bodies: Sequence[bytes], *, slo_s: float, timeout_s: float,
                 warmup_s: float, headers: Mapping[str, str] | None, worker_headers: Sequence[str],
                 on_answer: Callable[[Answer], None] | None, progress: bool) -> None:
        import aiohttp

        self.client_error = aiohttp.ClientError
        self.url, self.bodies, self.timeout_s, self.warmup_s = url, bodies, timeout_s, warmup_s
        self.on_answer = on_answer
        self.outcome = LoadOutcome(offered_rps=trace.rate_rps, measured_s=trace.duration_s - warmup_s, slo_s=slo_s)
        self.send_at = trace.send_at_s.tolist()  # Python floats: cheaper to index in the hot loop than numpy's
        self.lags = np.zeros(len(self.send_at), dtype=np.float64)  # how late each request was sent
        self.request_headers = {"content-type": "application/json", **(headers or {})}
        self.names = tuple(h.lower() for h in worker_headers)
        self.bar = _progress_bar(len(self.send_at), progress)
        self.loop = asyncio.get_running_loop()
        self.pending: set[asyncio.Task[None]] = set()
        self.t0 = 0.0  # the loop's time at the trace's zero, set when sending starts

    async def send_all(self, session: aiohttp.ClientSession, stop: asyncio.Event | None) -> None:
        """Send each request when the trace says (everything due at once when the client is late), then
        wait for the answers. Nothing more is sent once ``stop`` is set."""
        loop, send_at, warmup_s, outcome, lags, pending = (self.loop, self.send_at, self.warmup_s, self.outcome,
                                                           self.lags, self.pending)
        t0 = self.t0 = loop.time()
        i, n = 0, len(send_at)
        while i < n and not (stop is not None and stop.is_set()):
            now = loop.time()
            due = t0 + send_at[i]
            if due > now:
                await asyncio.sleep(due - now)
                continue
            while i < n and t0 + send_at[i] <= now:  # everything due by now, in order
                scheduled = t0 + send_at[i]
                lags[i] = now - scheduled
                if send_at[i] < warmup_s:
                    outcome.warmup_sent += 1
                else:
                    outcome.sent += 1
                task = loop.create_task(self.one(i, scheduled, session))
                pending.add(task)
                task.add_done_callback(pending.discard)
                outcome.max_inflight = max(outcome.max_inflight, len(pending))
                i += 1
        if pending:  # each has its own deadline; this bound only guards against a bug
            await asyncio.wait(set(pending), timeout=self.timeout_s + 1.0)

    async def one(self, i: int, scheduled: float, session: aiohttp.ClientSession) -> None:
        """Request ``i``, sent now (``scheduled`` on the loop's clock), to its answer or its deadline."""
        measured = self.send_at[i] >= self.warmup_s
        sent: dict[str, float] = {}  # ``on_headers_sent`` stamps "at" when the headers are out
        status: int | None = None
        worker = UNKNOWN_WORKER
        found: dict[str, str] = {}
        error: str | None = None
        try:
            async with asyncio.timeout_at(scheduled + self.timeout_s):
                async with session.post(self.url, data=self.bodies[i], headers=self.request_headers,
                                        trace_request_ctx=sent) as response:
                    await response.read()
                    status = response.status
                    for name in self.names:
                        value = response.headers.get(name)
                        if value:
                            found[name] = value
                    worker = next(iter(found.values()), UNKNOWN_WORKER)
        except TimeoutError:
            error = "timeout"
        except asyncio.CancelledError:  # a straggler cut off at the end of the run
            if measured:
                self.outcome.timeouts += 1
            if self.on_answer is not None:
                self.on_answer(Answer(self.send_at[i], self.loop.time() - self.t0, None, "timeout", found))
            raise
        except (self.client_error, OSError) as exc:
            error = type(exc).__name__
        finished = self.loop.time()
        if self.bar is not None:
            self.bar.update()
        if self.on_answer is not None:
            self.on_answer(Answer(self.send_at[i], finished - self.t0, status, error, found))
        if measured:
            _record(self.outcome, status, error, worker, finished - scheduled, finished - sent.get("at", scheduled))

    async def on_headers_sent(self, session: aiohttp.ClientSession, context: Any, params: Any) -> None:
        """aiohttp's trace hook: when the request's headers went out (the start of its service time)."""
        context.trace_request_ctx["at"] = self.loop.time()

    async def cancel_stragglers(self) -> None:
        """Cancel what is still in flight (they count as timeouts) and close the progress bar."""
        stragglers = list(self.pending)
        for task in stragglers:
            task.cancel()
        await asyncio.gather(*stragglers, return_exceptions=True)
        if self.bar is not None:
            self.bar.close()


def run_load_blocking(*args: Any, **kwargs: Any) -> LoadOutcome:
    """``run_load`` from synchronous code, on uvloop when it is installed (a fresh event loop per call)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        return asyncio.run(run_load(*args, **kwargs))
    return uvloop.run(run_load(*args, **kwargs))


def _record(outcome: LoadOutcome, status: int | None, error: str | None, worker: str, latency_s: float,
            service_s: float) -> None:
    if error == "timeout":
        outcome.timeouts += 1
        return
    if status is None:
        outcome.errors += 1
        outcome.error_kinds[error or "unknown"] += 1
        return
    outcome.statuses[status] += 1
    if not 200 <= status < 300:
        outcome.errors += 1
        outcome.refused.record(latency_s)
        return
    outcome.completed += 1
    outcome.spread[worker] += 1
    outcome.histogram.record(latency_s)
    outcome.service.record(service_s)
    if latency_s <= outcome.slo_s:
        outcome.within_slo += 1


def _check(url: str, trace: Trace, bodies: Sequence[bytes], *, slo_s: float, timeout_s: float, warmup_s: float,
           max_connections: int) -> None:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"url must start with http:// or https://, got {url!r}")
    if len(bodies) != len(trace):
        raise ValueError(f"need one body per request: the trace has {len(trace)} requests, got {len(bodies)} bodies")
    if not slo_s > 0 or not timeout_s > 0:
        raise ValueError(f"slo_s and timeout_s must be > 0, got {slo_s} and {timeout_s}")
    if not 0 <= warmup_s < trace.duration_s:
        raise ValueError(f"warmup_s must be in [0, duration {trace.duration_s:g}), got {warmup_s}")
    if max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")


def _progress_bar(total: int, enabled: bool):  # type: ignore[no-untyped-def]
    """A tqdm bar on stderr, or None: off when not asked for, and when stderr is not a terminal."""
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", file=sys.stderr, mininterval=0.5, smoothing=0.1, leave=False)
