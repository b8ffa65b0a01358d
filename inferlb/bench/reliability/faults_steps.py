"""The steps every fault's run shares: its state, polling for a condition, the answers so far, Envoy's view.

``FaultSteps`` is the base of the faults' own steps (``faults_processes.py``, ``faults_stores.py``); the run
that strings them together is ``Fault`` (``faults_live.py``). Each fault's steps are methods named after it
(``inject_<fault>``, ``reacted_<fault>``, ``hold_<fault>``, ``restore_<fault>``, ``back_<fault>``,
``figures_<fault>``), found by name."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ..load.loadgen import Answer
from ..processes import ProcessGroup
from ..stack.dataplanes import DataPlanePlan
from ..stack.dataplanes.envoy_admin import envoy_stat, envoy_stat_sum, healthy_hosts, host_flags, host_requests
from .faults_plan import FaultPlan
from .faults_postgres import PostgresProcess
from .faults_proxy import DelayProxy
from .faults_redis import RedisProcess

POLL_S = 0.1
ENDPOINT_HEADER = "x-inferlb-endpoint"  # set by ext_proc's pick: absent when Envoy failed open
WORKER_HEADER = "x-inferlb-worker"  # set by the worker that served
CACHE_HEADER = "x-inferlb-cache"  # "hit": answered by ext_proc's gateway cache, no worker


@dataclass
class Timeline:
    """Every answer of one run, as it comes (the load generator's ``on_answer``)."""

    answers: list[Answer] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, answer: Answer) -> None:
        self.answers.append(answer)
        self.changed.set()

    def since(self, t: float) -> list[Answer]:
        return [a for a in self.answers if a.send_at_s >= t]

    def ok(self, answer: Answer) -> bool:
        return answer.status is not None and 200 <= answer.status < 300

    def succeeded_since(self, t: float) -> list[Answer]:
        return [a for a in self.answers if a.send_at_s >= t and self.ok(a)]

    def failed(self) -> list[Answer]:
        return [a for a in self.answers if not self.ok(a)]


@dataclass
class FaultSetup:
    """What a fault adds to the stack: a delaying proxy in front of the target worker (its endpoint is then
    the proxy's address), a Redis for ext_proc's quotas and cache (behind a proxy for ``redis_slow``)."""

    proxy: DelayProxy | None = None
    redis: RedisProcess | None = None
    redis_proxy: DelayProxy | None = None
    ext_proc_env: dict[str, str] = field(default_factory=dict)
    nack_flag: Path | None = None  # config_nack: the control plane sends Envoy a bad endpoint while it exists
    postgres: PostgresProcess | None = None  # postgres_down: the store the two control-plane replicas share
    replica_b_url: str | None = None  # postgres_down: the second replica's admin API


class FaultSteps:
    """One fault's run so far, and the steps every fault uses: the time since the load started, waiting for a
    condition, the answers, Envoy's counters and hosts."""

    def __init__(self, name: str, plan: FaultPlan, setup: FaultSetup, group: ProcessGroup,
                 client: httpx.AsyncClient, dp: DataPlanePlan, *, worker_ids: Sequence[str], target: str,
                 report: Callable[[str], None]) -> None:
        self.name, self.plan, self.setup, self.group, self.client, self.dp = name, plan, setup, group, client, dp
        self.worker_ids = tuple(worker_ids)
        self.report = report
        self.timeline = Timeline()
        self.target_worker = self.worker_ids[0]  # the faulty worker, for the worker faults (x-inferlb-worker)
        self.target = target  # the same as Envoy's host (its proxy for worker_delay)
        self.headers: dict[str, str] = {}  # on every request of the load (the API key of the Redis faults)
        self.killed_envoy: dict[str, int] | None = None  # Envoy's counters when it was killed (they restart at 0)
        self.counts_back: dict[str, int] = {}  # the Redis faults: ext_proc's counts when Redis was back
        self.hosts_start: dict[str, int] = {}  # Envoy's requests per host when the load started
        self.hosts_injected: dict[str, int] = {}  # ... and when the fault was injected
        self.loop = asyncio.get_running_loop()
        self.t0 = 0.0

    def now(self) -> float:
        return self.loop.time() - self.t0

    async def wait(self, check: Callable[[], Awaitable[bool]], timeout_s: float, what: str,
                   alive: bool = True) -> float | None:
        """Poll ``check`` until true: the time it first held, or None after ``timeout_s``."""
        deadline = self.loop.time() + timeout_s
        while self.loop.time() < deadline:
            if alive:
                self.group.check_alive()
            try:
                if await check():
                    return self.now()
            except httpx.TransportError:
                pass
            await asyncio.sleep(POLL_S)
        self.report(f"    {self.name}: no {what} within {timeout_s:g} s")
        return None

    async def answered(self, n: int, since: float) -> bool:
        return len(self.timeline.succeeded_since(since)) >= n


    async def _any_answered(self, n: int, since: float) -> bool:
        return len(self.timeline.since(since)) >= n

    # --- Envoy's admin API ------------------------------------------------------------------------

    async def envoy_counters(self) -> dict[str, int]:
        try:
            text = (await self.client.get(f"{self.dp.envoy_admin_url}/stats")).text
        except httpx.TransportError:
            return {"retries": 0, "fail_open": 0, "ext_proc_timeouts": 0}
        return {"retries": envoy_stat(text, "cluster.workers.upstream_rq_retry"),
                "fail_open": envoy_stat_sum(text, "failure_mode_allowed"),
                # of those, ext_proc answers Envoy stopped waiting for (message timeout, 200 ms): a stalled host
                "ext_proc_timeouts": envoy_stat_sum(text, ".ext_proc.message_timeouts")}

    async def clusters(self) -> str:
        return (await self.client.get(f"{self.dp.envoy_admin_url}/clusters")).text

    async def hosts(self) -> dict[str, int]:
        try:
            return host_requests(await self.clusters())
        except httpx.TransportError:
            return {}

    async def target_flags(self) -> str | None:
        return host_flags(await self.clusters(), self.target)

    async def target_serves(self, since: float) -> bool:
        """Envoy shows the target healthy and it served a client request sent after ``since``."""
        if await self.target_flags() != "healthy":
            return False
        return any(a.headers.get(WORKER_HEADER) == self.target_worker for a in self.timeline.succeeded_since(since))

    async def every_worker_healthy(self) -> bool:
        return set(self.worker_ids) <= healthy_hosts(await self.clusters())


def rounded_since(t: float | None, origin: float) -> float | None:
    """Seconds from ``origin`` to ``t`` (ms precision); None when ``t`` never came."""
    return None if t is None else round(t - origin, 3)


def host_share(before: dict[str, int], after: dict[str, int], host: str) -> float | None:
    """``host``'s share of the requests Envoy sent to the workers between the two samples (retries included)."""
    total = sum(after.get(h, 0) - before.get(h, 0) for h in after)
    return round((after.get(host, 0) - before.get(host, 0)) / total, 4) if total > 0 else None


