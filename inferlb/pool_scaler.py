"""Elastic pools: `inferlb up --autoscale MIN..MAX` starts and stops local workers on the control plane's signal.

The signal is the one a Kubernetes HPA consumes, ``inferlb_autoscale_desired_replicas{pool=...}`` on the
control plane's ``/metrics`` (``control_plane/autoscale.py``: scale-up at once, scale-down held for its
``downscale_window_s``), so a laptop and a cluster scale on the same numbers. Each round the scaler reads
it, clamps it to MIN..MAX and reconciles, with its own cooldowns on top so it does not flap:

* scale up: start a worker on a free port and wait for its ``/readyz`` (the worker warms its models up
  before it says ready), only then register it on the admin API (``POST /v1/endpoints``); Envoy's cluster
  and ext_proc slow-start a new endpoint, so it is not flooded while its caches are cold.
* scale down, newest first and never a fixed worker: drain it on the admin API, wait until every xDS
  client (the Envoys and ext_proc) has ACKed an EDS version published after the drain and the worker
  reports nothing in flight or queued, then deregister it (``DELETE``; the control plane's own
  drain-then-remove check runs too, and the scaler waits until it is gone) and only then SIGTERM it (a
  worker finishes in-flight work on SIGTERM). No request is sent to a worker that is about to stop.

The decision (:func:`decide`) is pure, so cooldowns and bounds are tested on an injected clock; the
procedures talk to the admin API through :class:`AdminClient` and to processes through a
:class:`WorkerProcesses`, both injectable. Decisions and each step are structured log lines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

from inferlb_runtime.model_routing import DEFAULT_POOL, POOL_PATTERN
from inferlb_runtime.supervision import Supervised

from .stack_state import PoolStatus
from .supervisor import Component, Supervisor

DESIRED_REPLICAS_METRIC = "inferlb_autoscale_desired_replicas"  # control_plane/autoscale.py's name
WORKER_BUSY_METRICS = ("inferlb_worker_inflight_requests", "inferlb_worker_queue_depth")
BOUNDS = re.compile(r"^\s*(\d+)\s*\.\.\s*(\d+)\s*$")

log = logging.getLogger("inferlb.pool_scaler")


def parse_bounds(text: str) -> tuple[int, int]:
    """``"MIN..MAX"`` -> (MIN, MAX), 1 <= MIN <= MAX; ``ValueError`` saying what is wrong."""
    match = BOUNDS.match(text)
    if match is None:
        raise ValueError(f"--autoscale takes MIN..MAX, e.g. 1..4; got {text!r}")
    low, high = int(match[1]), int(match[2])
    if not 1 <= low <= high:
        raise ValueError(f"--autoscale {text}: need 1 <= MIN <= MAX (MIN workers always run)")
    return low, high


@dataclass(frozen=True)
class ScalerSettings:
    pool: str = DEFAULT_POOL
    min_workers: int = 1
    max_workers: int = 4
    poll_interval_s: float = 1.0
    scale_up_cooldown_s: float = 5.0  # after a scale-up, before the next one: its effect shows first
    scale_down_cooldown_s: float = 30.0  # after any change, before a scale-down
    ready_timeout_s: float = 180.0  # a new worker's warm-up
    drain_timeout_s: float = 60.0  # drain ACKed and worker idle; beyond it the control plane's drain decides

    def __post_init__(self) -> None:
        if not POOL_PATTERN.match(self.pool):
            raise ValueError(f"pool {self.pool!r} must be a Kubernetes name (lower-case letters, digits, '-')")
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(f"need 1 <= min_workers <= max_workers, got {self.min_workers}..{self.max_workers}")
        for name in ("poll_interval_s", "ready_timeout_s", "drain_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("scale_up_cooldown_s", "scale_down_cooldown_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


Action = Literal["up", "down", "hold"]


@dataclass(frozen=True)
class Decision:
    action: Action
    count: int  # workers to add or remove
    target: int | None  # the signal clamped to the bounds; None: no signal
    reason: str


def decide(desired: int | None, size: int, now: float, last_up_at: float | None, last_change_at: float | None,
           settings: ScalerSettings) -> Decision:
    """What to do this round (pure). ``size`` counts every worker of the pool, fixed and added."""
    s = settings
    if size < s.min_workers:
        return Decision("up", s.min_workers - size, s.min_workers, "below MIN")
    if desired is None:
        return Decision("hold", 0, None, "no signal yet")
    target = max(s.min_workers, min(s.max_workers, desired))
    if target > size:
        if last_up_at is not None and now - last_up_at < s.scale_up_cooldown_s:
            return Decision("hold", 0, target, "scale-up cooldown")
        return Decision("up", target - size, target, f"desired {desired}")
    if target < size:
        if last_change_at is not None and now - last_change_at < s.scale_down_cooldown_s:
            return Decision("hold", 0, target, "scale-down cooldown")
        return Decision("down", size - target, target, f"desired {desired}")
    return Decision("hold", 0, target, "at target")


def desired_replicas(metrics_text: str, pool: str) -> int | None:
    """The pool's signal from the control plane's /metrics text; None while it exports none."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == DESIRED_REPLICAS_METRIC:
            for s in family.samples:
                if s.labels.get("pool") == pool:
                    return int(s.value)
    return None


def busy(metrics_text: str) -> float:
    """Requests in flight plus inputs queued, from a worker's /metrics text."""
    return sum(s.value for family in text_string_to_metric_families(metrics_text)
               if family.name in WORKER_BUSY_METRICS for s in family.samples)


async def wait_until(check: Callable[[], Awaitable[bool]], timeout_s: float, poll_s: float = 0.1) -> bool:
    """Poll ``check`` until it holds (True) or ``timeout_s`` passes (False); transport errors count as not yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if await check():
                return True
        except httpx.TransportError:
            pass
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll_s)


class AdminClient:
    """The control plane's admin API and /metrics, as the scaler uses them."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, token: str) -> None:
        self.client = client
        self.base = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"}

    async def desired_replicas(self, pool: str) -> int | None:
        response = await self.client.get(f"{self.base}/metrics")
        response.raise_for_status()
        return desired_replicas(response.text, pool)

    async def register(self, address: str, port: int) -> None:
        response = await self.client.post(f"{self.base}/v1/endpoints", headers=self.headers,
                                          json={"address": address, "port": port})
        response.raise_for_status()

    async def drain(self, endpoint_id: str) -> None:
        (await self.client.post(f"{self.base}/v1/endpoints/{endpoint_id}/drain", headers=self.headers)) \
            .raise_for_status()

    async def deregister(self, endpoint_id: str) -> None:
        response = await self.client.delete(f"{self.base}/v1/endpoints/{endpoint_id}", headers=self.headers)
        if response.status_code != 404:  # already gone is what we want
            response.raise_for_status()

    async def exists(self, endpoint_id: str) -> bool:
        response = await self.client.get(f"{self.base}/v1/endpoints/{endpoint_id}", headers=self.headers)
        if response.status_code == 404:
            return False
        response.raise_for_status()
        return True

    async def eds_versions(self) -> dict[int, tuple[str, str]]:
        """Per xDS stream that takes EDS: (the version it ACKed, the version current for it)."""
        response = await self.client.get(f"{self.base}/v1/xds/clients", headers=self.headers)
        response.raise_for_status()
        return {c["stream_id"]: (c["types"]["eds"]["acked_version"], c["types"]["eds"]["current_version"])
                for c in response.json()["clients"] if "eds" in c["types"]}


def drain_seen(before: dict[int, tuple[str, str]], now: dict[int, tuple[str, str]]) -> bool:
    """Every EDS stream ACKed its current version, and that version is newer than the one before the drain
    (a stream connected since got the drained state whole)."""
    return all(acked == current and (stream not in before or current != before[stream][1])
               for stream, (acked, current) in now.items())


@dataclass
class Member:
    """A worker the scaler started."""

    port: int
    handle: object  # the WorkerProcesses' own
    address: str = "127.0.0.1"
    started_at: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> str:
        return f"{self.address}:{self.port}"


class WorkerProcesses(Protocol):
    """Starting, probing and stopping worker processes (the supervisor's, or a test's)."""

    async def start(self, port: int) -> object: ...
    async def wait_ready(self, handle: object, timeout_s: float) -> None: ...  # raises if it never is
    async def busy(self, handle: object) -> float: ...  # in flight + queued
    def alive(self, handle: object) -> bool: ...
    async def stop(self, handle: object) -> None: ...  # SIGTERM, wait for the exit


Report = Callable[[str], None]


def free_port(start: int, taken: Iterable[int], host: str = "127.0.0.1") -> int:
    """The first port from ``start`` that is not ``taken`` and can be bound on ``host`` now."""
    skip = set(taken)
    for port in range(start, 65536):
        if port in skip:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port from {start}")


class PoolScaler:
    """Reconciles one pool's local workers to the control plane's signal (see the module docstring).

    ``fixed`` workers (started by `inferlb up`, static endpoints of the control plane) count toward the
    size and are never removed; MIN of them always run.
    """

    def __init__(self, settings: ScalerSettings, admin: AdminClient, workers: WorkerProcesses, *, fixed: int,
                 first_port: int, report: Report = lambda line: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.admin = admin
        self.workers = workers
        self.fixed = fixed
        self.first_port = first_port
        self.report = report
        self.clock = clock
        self.members: list[Member] = []  # oldest first
        self.last_up_at: float | None = None
        self.last_change_at: float | None = None
        self.last_decision: Decision | None = None
        self.on_change: Callable[[], None] = lambda: None  # the status file's hook

    @property
    def size(self) -> int:
        return self.fixed + len(self.members)

    def _log(self, event: str, **fields: object) -> None:
        log.info(event, extra={"pool": self.settings.pool, "size": self.size, **fields})

    async def round(self) -> Decision:
        """One reconciliation: forget dead members, read the signal, act."""
        await self._reap()
        desired = await self.admin.desired_replicas(self.settings.pool)
        decision = decide(desired, self.size, self.clock(), self.last_up_at, self.last_change_at, self.settings)
        if decision != self.last_decision:
            self._log("decision", action=decision.action, count=decision.count, target=decision.target,
                      desired=desired, reason=decision.reason)
        self.last_decision = decision
        if decision.action == "up":
            before = self.size
            await asyncio.gather(*(self.add() for _ in range(decision.count)))
            self.last_up_at = self.last_change_at = self.clock()
            self.report(f"[scale] pool {self.settings.pool}: {before} -> {self.size} workers ({decision.reason})")
        elif decision.action == "down":
            before = self.size
            leaving = self.members[-decision.count:]
            await asyncio.gather(*(self.remove(m) for m in leaving))
            self.last_change_at = self.clock()
            self.report(f"[scale] pool {self.settings.pool}: {before} -> {self.size} workers ({decision.reason})")
        return decision

    async def add(self) -> Member | None:
        """Start a worker, wait for its /readyz, then register it; None (and nothing left running) on failure."""
        # The port is taken (the member listed) before the first await: a concurrent add picks another one.
        member = Member(free_port(self.first_port, [m.port for m in self.members]), None)
        self.members.append(member)
        try:
            member.handle = await self.workers.start(member.port)
        except BaseException:
            self.members.remove(member)
            raise
        self._log("worker starting", endpoint=member.id)
        try:
            await self.workers.wait_ready(member.handle, self.settings.ready_timeout_s)
            self._log("worker ready", endpoint=member.id, warmup_s=round(self.clock() - member.started_at, 2))
            await self.admin.register(member.address, member.port)
        except (RuntimeError, httpx.HTTPError) as exc:
            self._log("worker start failed", endpoint=member.id, error=repr(exc))
            await self.workers.stop(member.handle)
            self.members.remove(member)
            self.on_change()
            return None
        self._log("worker registered", endpoint=member.id)
        self.on_change()
        return member

    async def remove(self, member: Member) -> None:
        """Drain, wait for the ACKs and for the worker to be idle, deregister, wait until gone, SIGTERM."""
        s = self.settings
        before = await self.admin.eds_versions()
        await self.admin.drain(member.id)
        self._log("worker draining", endpoint=member.id)

        async def acked() -> bool:
            return drain_seen(before, await self.admin.eds_versions())

        async def idle() -> bool:
            return await self.workers.busy(member.handle) == 0

        deadline = self.clock() + s.drain_timeout_s
        if not await wait_until(acked, s.drain_timeout_s):
            self._log("drain not ACKed by every xDS client in time; the control plane's drain decides",
                      endpoint=member.id)
        if not await wait_until(idle, max(0.1, deadline - self.clock())):
            self._log("worker not idle in time; the control plane's drain decides", endpoint=member.id)
        await self.admin.deregister(member.id)
        self._log("worker deregistered", endpoint=member.id)

        async def gone() -> bool:
            return not await self.admin.exists(member.id)

        if not await wait_until(gone, s.drain_timeout_s):
            self._log("endpoint still listed after the drain timeout; stopping the worker", endpoint=member.id)
        await self.workers.stop(member.handle)
        self.members.remove(member)
        self._log("worker stopped", endpoint=member.id)
        self.on_change()

    async def _reap(self) -> None:
        """A member that exited on its own is deregistered and forgotten; the reconciliation replaces it."""
        for member in [m for m in self.members if not self.workers.alive(m.handle)]:
            self._log("worker exited unexpectedly: deregistering it", endpoint=member.id)
            self.members.remove(member)
            await self.admin.deregister(member.id)
            await self.workers.stop(member.handle)  # reaps it
            self.on_change()

    async def run(self, stop: asyncio.Event) -> None:
        """Rounds every ``poll_interval_s`` until ``stop``; a failing round is logged, counted and retried."""
        supervised = Supervised("pool-scaler", logger=log)
        self._log("pool scaler started", min=self.settings.min_workers, max=self.settings.max_workers)
        while not stop.is_set():
            await supervised.run(self.round, {"pool": self.settings.pool})
            self.on_change()
            try:
                await asyncio.wait_for(stop.wait(), self.settings.poll_interval_s)
            except TimeoutError:
                pass


class SupervisorWorkers:
    """:class:`WorkerProcesses` through the stack's supervisor: the workers show in `inferlb status`, log
    to the data dir like the fixed ones, and are stopped with the stack."""

    def __init__(self, supervisor: Supervisor, component: Callable[[int], Component],
                 client: httpx.AsyncClient) -> None:
        self.supervisor = supervisor
        self.component = component
        self.client = client

    async def start(self, port: int) -> object:
        spec = self.component(port)
        await self.supervisor.start_component(spec)
        return spec

    async def wait_ready(self, handle: object, timeout_s: float) -> None:
        assert isinstance(handle, Component)
        await self.supervisor.component_ready(dataclasses.replace(handle, ready_timeout_s=timeout_s))

    async def busy(self, handle: object) -> float:
        assert isinstance(handle, Component)
        response = await self.client.get(handle.ready_url.rsplit("/", 1)[0] + "/metrics")
        response.raise_for_status()
        return busy(response.text)

    def alive(self, handle: object) -> bool:
        assert isinstance(handle, Component)
        entry = self.supervisor.running.get(handle.name)
        return entry is not None and entry.process.returncode is None

    async def stop(self, handle: object) -> None:
        assert isinstance(handle, Component)
        await self.supervisor.stop_component(handle.name)


def admin_token(data_dir: Path, environ: Mapping[str, str]) -> str:
    """The admin API's token as the control plane resolves it without a config file's admin_token:
    INFERLB_ADMIN_TOKEN, INFERLB_CP_ADMIN_TOKEN, else the file it generated in the data dir."""
    for name in ("INFERLB_ADMIN_TOKEN", "INFERLB_CP_ADMIN_TOKEN"):
        if environ.get(name):
            return environ[name]
    path = data_dir / "admin-token"
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise RuntimeError(f"the pool scaler needs the admin token: {path} is unreadable ({exc}); with admin_token "
                           "in the config file, set INFERLB_ADMIN_TOKEN too") from None


def elastic_pool(supervisor: Supervisor, settings: ScalerSettings, *, admin_url: str, data_dir: Path, fixed: int,
                 first_port: int, component: Callable[[int], Component],
                 environ: Mapping[str, str]) -> Callable[[asyncio.Event], Awaitable[None]]:
    """The supervisor's background task for one pool: a :class:`PoolScaler` on the supervisor's workers,
    its state in the status file."""

    async def run(stop: asyncio.Event) -> None:
        token = admin_token(data_dir, environ)
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            scaler = PoolScaler(settings, AdminClient(client, admin_url, token),
                                SupervisorWorkers(supervisor, component, client), fixed=fixed,
                                first_port=first_port, report=supervisor.report)

            def publish() -> None:
                d = scaler.last_decision
                supervisor.set_pool(PoolStatus(settings.pool, settings.min_workers, settings.max_workers,
                                               scaler.size, None if d is None else d.target,
                                               "" if d is None else f"{d.action}: {d.reason}"))

            scaler.on_change = publish
            publish()
            await scaler.run(stop)

    return run
