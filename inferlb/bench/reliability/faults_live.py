"""The live half of ``inferlb bench faults``: one fault per run, injected into a fresh stack under open-loop load.

Each run starts a fresh stack (simulated workers, control plane, ext_proc, Envoy, with the product's retries,
health checks and outlier detection), sends the fault plan's trace open loop, injects the fault once the
stack has served ``baseline`` requests, waits until the stack has visibly reacted (a condition, with a
deadline), restores the component, and waits until routing is back; then ``tail`` more requests are sent
and the load stops. Every step waits on a condition, never on a fixed sleep.

Recovery time, precisely: from the injection to the later of (a) the scheduled send time of the last
request, sent after the injection, that failed (non-2xx, no answer, or timed out), and (b) the first moment
the fault's "routing is back" condition held after the restore (``Fault.back``). It includes the time the
fault was left in place (until the stack reacted), which is reported on its own as ``reacted_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ..stack.dataplanes import DataPlanePlan, DataPlanePorts, plan_data_plane
from ..stack.dataplanes.launch import healthy_hosts, start_data_plane
from .faults_nacking_control_plane import FLAG_ENV
from .faults_postgres import PostgresProcess, ThrowawayPostgres
from .faults_proxy import DelayProxy
from .faults_redis import RedisProcess, ThrowawayRedis
from ..stack.fleet import fleet_components
from ..load.loadgen import WORKER_HEADERS, Answer, run_load
from ..processes import ProcessGroup, free_ports
from ...supervisor import Component
from ..routing.runner import CAPACITY_CONFIGURATION, Report, ScenarioRunner, _slug
from ..load.scenario import Fleet, Scenario, WorkerSpec

PRODUCT_RETRIES = 2  # the control plane's default (DataPlaneConfig.retries): faults run the product's settings
POLL_S = 0.1
ENDPOINT_HEADER = "x-inferlb-endpoint"  # set by ext_proc's pick: absent when Envoy failed open
WORKER_HEADER = "x-inferlb-worker"  # set by the worker that served
CACHE_HEADER = "x-inferlb-cache"  # "hit": answered by ext_proc's gateway cache, no worker
FAULTS = ("worker_kill", "worker_stop", "ext_proc_kill", "control_plane_kill", "envoy_restart", "worker_500",
          "worker_delay", "redis_down", "redis_down_closed", "redis_slow", "config_nack", "postgres_down")
REDIS_FAULTS = ("redis_down", "redis_down_closed", "redis_slow")
QUOTA_METRIC = "inferlb_ext_proc_quota_decisions_total"
CACHE_METRIC = "inferlb_ext_proc_cache_requests_total"
STORE_ERRORS_METRIC = "inferlb_ext_proc_quota_store_errors_total"
FAULT_TENANT = "faults"
NACKING_CONTROL_PLANE = "inferlb.bench.reliability.faults_nacking_control_plane"
RATE_LIMIT_HEADER = "x-ratelimit-limit-requests"  # on every answer to a key with a quota, once checked
REPLICA_B = "control-plane-b"  # postgres_down: the second control-plane replica (no Envoy on it)
PIN_WHILE_DOWN = 7  # postgres_down: the pin refused while PostgreSQL is down (never applied)
PIN_WHEN_BACK = 100  # postgres_down: the pin through replica B once it is back (the default weight: no shift)


@dataclass(frozen=True)
class FaultPlan:
    """The stack, the load and the bounds of every run."""

    faults: tuple[str, ...] = FAULTS
    load: float = 0.7  # of the fleet's capacity (every slot busy on the mix's mean request)
    workers: int = 4
    slots: int = 2
    cost_scale: float = 20.0  # the emulated fleet, not the 2-core host, is the bottleneck
    baseline: int = 150  # requests answered before the fault is injected
    tail: int = 150  # requests sent after routing is back
    max_run_s: float = 90.0  # the trace's length: a run that has not recovered by then is reported so
    react_timeout_s: float = 30.0  # for the stack to react to the fault before it is restored anyway
    request_timeout_s: float = 15.0
    seed: int = 1
    delay_hold: int = 150  # worker_delay: requests answered while delayed (the share it gets is the measure)
    worker_delay_s: float = 0.5  # worker_delay: added to what reaches the worker (under the 1 s health-check timeout)
    redis_delay_s: float = 0.2  # redis_slow: added to what reaches Redis (ext_proc's store timeouts are 50 ms)

    def problems(self) -> list[str]:
        out = [f"unknown fault {f!r}; known: {', '.join(FAULTS)}" for f in self.faults if f not in FAULTS]
        if not 0 < self.load <= 1.5:
            out.append(f"--load must be in (0, 1.5], got {self.load:g}")
        if self.workers < 3:
            out.append(f"--workers must be >= 3 (one faulty, the rest serve), got {self.workers}")
        if self.baseline < 1 or self.tail < 1:
            out.append("--baseline and --tail must be >= 1")
        return out


def fault_scenario(plan: FaultPlan) -> Scenario:
    fleet = Fleet(workers=tuple(WorkerSpec(1.0, plan.slots) for _ in range(plan.workers)), cost_scale=plan.cost_scale)
    return Scenario(name="faults", seed=plan.seed, duration_s=plan.max_run_s, warmup_s=0.0, slo_s=plan.request_timeout_s,
                    request_timeout_s=plan.request_timeout_s, loads=(plan.load,), slowdown=None, fleet=fleet,
                    configurations=(CAPACITY_CONFIGURATION,), pick_policy_loads=())


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


def parse_envoy_stats(stats_text: str) -> dict[str, int]:
    """The counters of Envoy's admin ``/stats`` text (name: value)."""
    counters = {}
    for line in stats_text.splitlines():
        key, _, value = line.partition(": ")
        if value.strip().isdigit():
            counters[key] = int(value)
    return counters


def envoy_stat(stats_text: str, name: str) -> int:
    """One counter of Envoy's admin ``/stats`` text (0 when absent)."""
    return parse_envoy_stats(stats_text).get(name, 0)


def envoy_stat_sum(stats_text: str, suffix: str) -> int:
    """The sum of the counters whose names end with ``suffix``, whatever their prefix (the listener's, ...)."""
    return sum(v for k, v in parse_envoy_stats(stats_text).items() if k.endswith(suffix))


def host_flags(clusters_text: str, host: str, cluster: str = "workers") -> str | None:
    """Envoy's health flags of ``host`` in ``cluster`` ("healthy", "/failed_active_hc", ...); None: not there."""
    for line in clusters_text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == cluster and parts[1] == host and parts[2] == "health_flags":
            return parts[3]
    return None


def host_weight(clusters_text: str, host: str, cluster: str = "workers") -> int | None:
    """Envoy's load-balancing weight of ``host`` in ``cluster`` (from EDS); None: not there."""
    for line in clusters_text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == cluster and parts[1] == host and parts[2] == "weight":
            return int(parts[3]) if parts[3].isdigit() else None
    return None


def host_requests(clusters_text: str, cluster: str = "workers") -> dict[str, int]:
    """Requests Envoy sent to each host of ``cluster`` (its ``rq_total``), retries included."""
    out = {}
    for line in clusters_text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == cluster and parts[2] == "rq_total" and parts[3].isdigit():
            out[parts[1]] = int(parts[3])
    return out


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


def second_replica(control_plane: Component, workdir: Path) -> tuple[Component, str]:
    """Another control plane like ``control_plane`` (same store, endpoints, settings and admin token) on its
    own ports and data directory; its admin URL. Nothing connects to its xDS: it is the replica an operator
    may reach instead."""
    xds, admin = free_ports(2)
    data = workdir / "control-plane-b-data"
    data.mkdir(parents=True, exist_ok=True)
    changed = {"--xds-port": str(xds), "--admin-port": str(admin), "--data-dir": str(data)}
    argv = list(control_plane.argv)
    for i, arg in enumerate(argv[:-1]):
        if arg in changed:
            argv[i + 1] = changed[arg]
    url = f"http://127.0.0.1:{admin}"
    return dataclasses.replace(control_plane, name=REPLICA_B, argv=argv, ready_url=f"{url}/readyz",
                               log_path=control_plane.log_path.with_name(f"{REPLICA_B}.log"),
                               env={**control_plane.env, "INFERLB_DATA_DIR": str(data)}), url


class FaultRunner(ScenarioRunner):
    """Runs each fault of the plan on its own fresh stack; ``run_fault`` returns one row of the table."""

    def __init__(self, plan: FaultPlan, out_dir: Path, report: Report) -> None:
        super().__init__(fault_scenario(plan), out_dir, plans=(), progress=False, report=report)
        self.fault_plan = plan
        self.base_dir = out_dir
        self.setup = FaultSetup()

    @property
    def routed(self) -> tuple[tuple[str, int], ...]:
        """The endpoints the control plane is given: the workers, the target behind its proxy if any."""
        endpoints = list(self.layout.endpoints)
        if self.setup.proxy is not None:
            endpoints[0] = ("127.0.0.1", self.setup.proxy.port)
        return tuple(endpoints)

    @property
    def capacity_rps(self) -> float:
        from ..routing.capacity import theoretical_capacity_rps

        return theoretical_capacity_rps(self.scenario)

    def _plan(self, configuration: str) -> DataPlanePlan:
        plan = plan_data_plane(configuration, endpoints=self.routed,
                               workdir=self.out_dir / "runs" / _slug(configuration),
                               ports=DataPlanePorts.allocate(),
                               request_timeout_s=self.scenario.request_timeout_s, envoy=self.envoy,
                               retries=PRODUCT_RETRIES)
        flag = self.setup.nack_flag
        postgres = self.setup.postgres

        def changed(c: Component) -> Component:
            if c.name == "ext_proc" and self.setup.ext_proc_env:
                return dataclasses.replace(c, env={**c.env, **self.setup.ext_proc_env})
            if c.name == "control-plane" and flag is not None:  # the same process, its build wrapped
                argv = [c.argv[0], "-m", NACKING_CONTROL_PLANE, *c.argv[3:]]
                return dataclasses.replace(c, argv=argv, env={**c.env, FLAG_ENV: str(flag)})
            if c.name == "control-plane" and postgres is not None:
                return dataclasses.replace(c, env={**c.env, "INFERLB_STORE": postgres.url})
            return c

        return dataclasses.replace(plan, stages=tuple(tuple(changed(c) for c in stage) for stage in plan.stages))

    async def _start(self, group: ProcessGroup, plan: DataPlanePlan, client: httpx.AsyncClient) -> None:
        """The fleet and the data plane, ready when Envoy routes to every endpoint (proxies included)."""
        workdir = self.out_dir / "runs" / _slug(plan.configuration)
        await group.start(fleet_components(self.scenario.fleet, self.layout, workdir / "logs",
                                           workdir / "worker-data", env=self.worker_env))
        await start_data_plane(plan, group, client, [f"{h}:{p}" for h, p in self.routed])
        if self.setup.postgres is not None:  # the second replica, on the same store
            replica, self.setup.replica_b_url = second_replica(plan.stages[0][0], workdir)
            await group.start([replica])

    async def _set_up(self, name: str, stack: contextlib.AsyncExitStack) -> FaultSetup:
        setup = FaultSetup()
        if name == "config_nack":
            setup.nack_flag = self.out_dir / "nack.flag"
            setup.nack_flag.unlink(missing_ok=True)
        if name == "worker_delay":
            host, port = self.layout.endpoints[0]
            setup.proxy = await stack.enter_async_context(DelayProxy(host, port))
        if name in REDIS_FAULTS:
            setup.redis = await stack.enter_async_context(ThrowawayRedis())
            url = setup.redis.url
            if name == "redis_slow":
                setup.redis_proxy = await stack.enter_async_context(DelayProxy("127.0.0.1", setup.redis.port))
                url = f"redis://{setup.redis_proxy.address}/0"
            setup.ext_proc_env = {
                "INFERLB_EXT_PROC_QUOTA_STORE": url, "INFERLB_EXT_PROC_CACHE_STORE": url,
                "INFERLB_EXT_PROC_CACHE_MAX_BYTES": str(64 << 20),  # the product's default: the cache on
                "INFERLB_EXT_PROC_QUOTA_FAILURE_MODE": "closed" if name == "redis_down_closed" else "open"}
        if name == "postgres_down":
            setup.postgres = await stack.enter_async_context(ThrowawayPostgres(self.out_dir / "logs"))
        return setup

    async def run_all(self) -> list[dict[str, Any]]:
        return [await self.run_fault(name) for name in self.fault_plan.faults]

    async def run_fault(self, name: str) -> dict[str, Any]:
        """A fresh stack, the load, the fault; the figures of the run. Its logs: ``<out>/<fault>/``."""
        self.out_dir = self.base_dir / name
        self._log = self.out_dir / "logs" / "bench.log"
        (self.out_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.layout = type(self.layout)(tuple(free_ports(len(self.scenario.fleet.workers))))
        async with contextlib.AsyncExitStack() as stack:
            self.setup = await self._set_up(name, stack)
            dp = self._plan(CAPACITY_CONFIGURATION)
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=5.0, trust_env=False))
            group = await stack.enter_async_context(ProcessGroup(report=self._log_line))
            await self._start(group, dp, client)
            fault = Fault(name, self, group, client, dp)
            return await fault.run()


class Fault:
    """One fault's run: inject, react, restore, back. The steps per fault are the methods named after it."""

    def __init__(self, name: str, runner: FaultRunner, group: ProcessGroup, client: httpx.AsyncClient,
                 dp: DataPlanePlan) -> None:
        self.name, self.runner, self.group, self.client, self.dp = name, runner, group, client, dp
        self.plan = runner.fault_plan
        self.timeline = Timeline()
        self.setup = runner.setup
        self.target_worker = runner.layout.ids[0]  # the faulty worker, for the worker faults (x-inferlb-worker)
        self.target = "%s:%d" % runner.routed[0]  # the same as Envoy's host (its proxy for worker_delay)
        self.headers: dict[str, str] = {}  # on every request of the load (the API key of the Redis faults)
        self.killed_envoy: dict[str, int] | None = None  # Envoy's counters when it was killed (they restart at 0)
        self.counts_back: dict[str, int] = {}  # the Redis faults: ext_proc's counts when Redis was back
        self.loop = asyncio.get_running_loop()
        self.t0 = 0.0

    # --- the shared sequence ---------------------------------------------------------------------

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
        self.runner.report(f"    {self.name}: no {what} within {timeout_s:g} s")
        return None

    async def answered(self, n: int, since: float) -> bool:
        return len(self.timeline.succeeded_since(since)) >= n

    async def run(self) -> dict[str, Any]:
        runner, plan = self.runner, self.plan
        rps = plan.load * runner.capacity_rps
        trace, bodies = await asyncio.to_thread(runner._trace, runner.scenario, rps)
        stop = asyncio.Event()
        if self.name in REDIS_FAULTS:
            await self.quota_key(bodies[0])
        before = await self.envoy_counters()
        self.hosts_start = await self.hosts()
        self.t0 = self.loop.time()
        load = asyncio.create_task(run_load(self.dp.url, trace, bodies, slo_s=plan.request_timeout_s,
                                            timeout_s=plan.request_timeout_s, progress=False, headers=self.headers,
                                            worker_headers=(*WORKER_HEADERS, CACHE_HEADER),
                                            on_answer=self.timeline.add, stop=stop))
        runner.report(f"  {self.name}: {rps:.1f} req/s ({plan.load:.0%} of {runner.capacity_rps:.1f})")
        figures: dict[str, Any] = {}
        try:
            if await self.wait(lambda: self.answered(plan.baseline, 0.0), plan.max_run_s, "baseline") is None:
                raise RuntimeError(f"{self.name}: the stack did not serve {plan.baseline} requests before the fault")
            hosts0 = self.hosts_injected = await self.hosts()
            injected = self.now()
            await getattr(self, f"inject_{self.name}")()
            reacted = await self.wait(getattr(self, f"reacted_{self.name}"), plan.react_timeout_s, "reaction",
                                      alive=False)
            hosts1 = await self.hosts()
            held: dict[str, Any] = {}
            if hasattr(self, f"hold_{self.name}") and reacted is not None:
                held = await getattr(self, f"hold_{self.name}")(reacted)
            restored = self.now()
            await getattr(self, f"restore_{self.name}")()
            back = await self.wait(getattr(self, f"back_{self.name}"), max(1.0, plan.max_run_s - self.now()),
                                   "recovery")
            if back is not None:
                await self.wait(lambda: self.answered(plan.tail, back), max(1.0, plan.max_run_s - self.now()),
                                "tail")
            figures = {"injected_at_s": round(injected, 3), "reacted_s": _since(reacted, injected),
                       "restored_s": round(restored - injected, 3), "back_s": _since(back, injected),
                       "target_share_until_reaction": _share(hosts0, hosts1, self.target), **held}
            if hasattr(self, f"figures_{self.name}"):
                figures.update(await getattr(self, f"figures_{self.name}")())
        finally:
            stop.set()
            outcome = await load
        after = await self.envoy_counters()
        if self.killed_envoy is not None:  # the old Envoy's share, then the new one's from 0
            after = {k: v + self.killed_envoy[k] for k, v in after.items()}
        failed = self.timeline.failed()
        failed_after = [a for a in failed if a.send_at_s >= figures.get("injected_at_s", 0.0)]
        injected = figures.get("injected_at_s", 0.0)
        last_failure = max((a.send_at_s for a in failed_after), default=injected)
        back = figures.get("back_s")
        recovery = None if back is None else round(max(back, last_failure - injected), 3)
        row = {
            "fault": self.name, "offered_rps": round(rps, 2), "sent": outcome.sent,
            "succeeded": outcome.completed, "failed": outcome.errors + outcome.timeouts,
            "failed_after_back": None if back is None else sum(a.send_at_s >= injected + back for a in failed_after),
            "retried": after["retries"] - before["retries"],
            "fail_open": after["fail_open"] - before["fail_open"],
            "ext_proc_timeouts": after["ext_proc_timeouts"] - before["ext_proc_timeouts"],
            "recovery_s": recovery, **figures,
            "statuses": {str(k): v for k, v in sorted(outcome.statuses.items())},
            "error_kinds": dict(outcome.error_kinds), "timeouts": outcome.timeouts,
            "failures_by_second": dict(sorted(Counter(int(a.send_at_s - injected) for a in failed_after).items())),
            "spread": dict(sorted(outcome.spread.items())), "target": self.target_worker,
        }
        runner.report(f"    sent {row['sent']}, succeeded {row['succeeded']}, failed {row['failed']}, "
                      f"retried {row['retried']}, reacted in {row['reacted_s']} s, recovered in {recovery} s")
        return row

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
        return set(self.runner.layout.ids) <= healthy_hosts(await self.clusters())

    # --- kill -9 a worker: retried elsewhere; it leaves, and returns with slow start when restarted -----

    async def inject_worker_kill(self) -> None:
        self.worker_spec = await self.group.kill(self._worker_name())

    async def reacted_worker_kill(self) -> bool:
        return await self.target_flags() != "healthy"

    async def restore_worker_kill(self) -> None:
        self.restored_at = self.now()
        await self.group.start([self.worker_spec])

    async def back_worker_kill(self) -> bool:
        return await self.target_serves(self.restored_at)

    # --- SIGSTOP a worker, then SIGCONT: timeouts and health checks route around it -----------------

    def _worker_name(self) -> str:
        return f"worker:{self.target_worker.rsplit(':', 1)[1]}"

    async def inject_worker_stop(self) -> None:
        self.group.send_signal(self._worker_name(), signal.SIGSTOP)

    reacted_worker_stop = reacted_worker_kill

    async def restore_worker_stop(self) -> None:
        self.restored_at = self.now()
        self.group.send_signal(self._worker_name(), signal.SIGCONT)

    back_worker_stop = back_worker_kill

    # --- kill ext_proc: Envoy fails open; restarted, it routes again with a fresh view ----------------

    async def inject_ext_proc_kill(self) -> None:
        self.killed_at = self.now()
        self.ext_proc_spec = await self.group.kill("ext_proc")

    async def reacted_ext_proc_kill(self) -> bool:  # a request served without ext_proc's pick: fail-open
        return any(ENDPOINT_HEADER not in a.headers for a in self.timeline.succeeded_since(self.killed_at))

    async def restore_ext_proc_kill(self) -> None:
        await self.group.start([self.ext_proc_spec])
        self.restored_at = self.now()

    async def back_ext_proc_kill(self) -> bool:
        return any(ENDPOINT_HEADER in a.headers for a in self.timeline.succeeded_since(self.restored_at))

    # --- kill the control plane: the last good state serves; restarted, it restores and clients resync --

    async def inject_control_plane_kill(self) -> None:
        self.killed_at = self.now()
        self.control_plane_spec = await self.group.kill("control-plane")

    async def reacted_control_plane_kill(self) -> bool:  # serving goes on without it (the baseline's count again)
        return await self.answered(self.plan.baseline, self.killed_at)

    async def restore_control_plane_kill(self) -> None:
        await self.group.start([self.control_plane_spec])

    async def back_control_plane_kill(self) -> bool:
        """Envoy and ext_proc reconnected to the restarted control plane and ACKed its current config."""
        response = await self.client.get(f"{self.dp.control_plane_url}/v1/xds/clients",
                                         headers={"Authorization": f"Bearer {self.dp.admin_token}"})
        clients = response.json().get("clients", []) if response.status_code == 200 else []
        groups = {c["node_cluster"] for c in clients}
        synced = all(t.get("in_sync") for c in clients for t in c["types"].values())
        return len(groups) >= 2 and synced and await self.every_worker_healthy()

    # --- restart Envoy: configured from xDS alone ------------------------------------------------------

    async def inject_envoy_restart(self) -> None:
        self.killed_envoy = await self.envoy_counters()
        self.envoy_spec = await self.group.kill("envoy")

    async def reacted_envoy_restart(self) -> bool:
        return True  # nothing listens: the requests now fail; restart at once

    async def restore_envoy_restart(self) -> None:
        await self.group.start([self.envoy_spec])
        self.restored_at = self.now()

    async def back_envoy_restart(self) -> bool:
        return await self.every_worker_healthy() and await self.answered(1, self.restored_at)

    # --- a worker that answers 500 fast: no traffic for looking fast; weight drops, outlier detection ejects -

    async def _fail_rate(self, rate: float) -> None:
        response = await self.client.put(f"http://{self.target_worker}/v1/simulation", json={"fail_rate": rate})
        response.raise_for_status()

    async def inject_worker_500(self) -> None:
        await self._fail_rate(1.0)

    async def reacted_worker_500(self) -> bool:
        return "failed_outlier_check" in (await self.target_flags() or "")

    async def hold_worker_500(self, reacted: float) -> dict[str, Any]:
        """Keep it failing while the baseline's count of requests is served: what share does it still get?"""
        hosts0 = await self.hosts()
        await self.wait(lambda: self.answered(self.plan.baseline, reacted), self.plan.react_timeout_s, "hold")
        endpoint = (await self.client.get(f"{self.dp.control_plane_url}/v1/endpoints/{self.target_worker}")).json()
        return {"target_share_while_held": _share(hosts0, await self.hosts(), self.target),
                "target_weight_after_hold": endpoint.get("weight"),
                "held_s": round(self.now() - reacted, 3), "target_flags_after_hold": await self.target_flags()}

    async def restore_worker_500(self) -> None:
        self.restored_at = self.now()
        await self._fail_rate(0.0)

    back_worker_500 = back_worker_kill

    # --- delay in front of one worker (a delaying TCP proxy): it gets less traffic ---------------------

    async def inject_worker_delay(self) -> None:
        assert self.setup.proxy is not None
        self.setup.proxy.delay_s = self.plan.worker_delay_s

    async def reacted_worker_delay(self) -> bool:
        return True  # nothing is ejected: the measure is the share it gets while delayed (hold)

    async def hold_worker_delay(self, reacted: float) -> dict[str, Any]:
        """Keep it delayed while the baseline's count of requests is served: its share then, and before."""
        hosts0 = await self.hosts()
        await self.wait(lambda: self.answered(self.plan.delay_hold, reacted), self.plan.react_timeout_s, "hold")
        return {"delay_s": self.plan.worker_delay_s,
                "target_share_before": _share(self.hosts_start, self.hosts_injected, self.target),
                "target_share_while_held": _share(hosts0, await self.hosts(), self.target),
                "held_s": round(self.now() - reacted, 3)}

    async def restore_worker_delay(self) -> None:
        assert self.setup.proxy is not None
        self.restored_at = self.now()
        self.setup.proxy.delay_s = 0.0

    back_worker_delay = back_worker_kill

    # --- Redis down or slow: quotas fail open or closed as configured, the shared cache misses, nothing else -

    async def quota_key(self, body: bytes) -> None:
        """An API key with a quota too large to bind, so every request's quota is checked in Redis; ready when
        a request with it is answered with its rate-limit headers (ext_proc has the key from xDS)."""
        response = await self.client.post(
            f"{self.dp.control_plane_url}/v1/api-keys", json={"tenant": FAULT_TENANT, "requests_per_minute": 10**9},
            headers={"Authorization": f"Bearer {self.dp.admin_token}"})
        response.raise_for_status()
        self.headers = {"Authorization": f"Bearer {response.json()['key']}"}

        async def checked() -> bool:
            answer = await self.client.post(self.dp.url, content=body,
                                            headers={**self.headers, "Content-Type": "application/json"})
            return answer.status_code == 200 and RATE_LIMIT_HEADER in answer.headers

        if await self.wait(checked, 30.0, "quota-checked answer") is None:
            raise RuntimeError(f"{self.name}: ext_proc never checked the API key's quota")

    async def ext_proc_counts(self) -> dict[str, int]:
        """ext_proc's quota decisions by result (``quota:…``), quota-store calls not answered by reason
        (``store:…``) and its cache lookups by ``level:result``."""
        text = (await self.client.get(f"{self.dp.ext_proc_metrics_url}/metrics")).text
        out: Counter[str] = Counter()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == QUOTA_METRIC:
                    out[f"quota:{sample.labels['result']}"] += int(sample.value)
                elif sample.name == STORE_ERRORS_METRIC:
                    out[f"store:{sample.labels['reason']}"] += int(sample.value)
                elif sample.name == CACHE_METRIC:
                    out[f"cache:{sample.labels['level']}:{sample.labels['result']}"] += int(sample.value)
        return dict(out)

    def _store_failure(self) -> str:
        return "quota:failed_closed" if self.name == "redis_down_closed" else "quota:failed_open"

    async def inject_redis_down(self) -> None:
        assert self.setup.redis is not None
        self.counts_injected = await self.ext_proc_counts()
        await self.setup.redis.kill()

    async def reacted_redis_down(self) -> bool:
        failure = self._store_failure()
        return (await self.ext_proc_counts()).get(failure, 0) > self.counts_injected.get(failure, 0)

    async def hold_redis_down(self, reacted: float) -> dict[str, Any]:
        """Keep it down while the baseline's count of requests is answered: how were they answered?"""
        counts0 = await self.ext_proc_counts()
        await self.wait(lambda: self._any_answered(self.plan.baseline, reacted), self.plan.react_timeout_s, "hold")
        counts1 = await self.ext_proc_counts()
        held = self.timeline.since(reacted)
        return {"held_s": round(self.now() - reacted, 3),
                "statuses_while_held": dict(Counter(str(a.status) for a in held)),
                "picked_while_held": sum(ENDPOINT_HEADER in a.headers for a in held),
                "cache_hits_while_held": sum(a.headers.get(CACHE_HEADER) == "hit" for a in held),
                "ext_proc_while_held": {k: v - counts0.get(k, 0) for k, v in sorted(counts1.items())
                                        if v != counts0.get(k, 0)}}

    async def _any_answered(self, n: int, since: float) -> bool:
        return len(self.timeline.since(since)) >= n

    async def restore_redis_down(self) -> None:
        assert self.setup.redis is not None
        self.counts_restored = await self.ext_proc_counts()
        self.restored_at = self.now()
        await self.setup.redis.start()  # on its port, empty

    async def back_redis_down(self) -> bool:
        """A quota checked in Redis again (admitted), and a client served since the restore."""
        counts = await self.ext_proc_counts()
        if counts.get("quota:admitted", 0) > self.counts_restored.get("quota:admitted", 0) \
                and await self.answered(1, self.restored_at):
            self.counts_back = counts
            return True
        return False

    async def figures_redis_down(self) -> dict[str, Any]:
        """Quota-store calls not answered since it was back, by reason: a timeout (a stalled host) fails the
        next half second of checks by design; an error would be a stale connection to the old Redis."""
        counts = await self.ext_proc_counts()
        return {"store_unanswered_after_back": {k: v - self.counts_back.get(k, 0) for k, v in sorted(counts.items())
                                                if k.startswith("store:") and v != self.counts_back.get(k, 0)}}

    inject_redis_down_closed = inject_redis_down
    reacted_redis_down_closed = reacted_redis_down
    hold_redis_down_closed = hold_redis_down
    restore_redis_down_closed = restore_redis_down
    back_redis_down_closed = back_redis_down
    figures_redis_down_closed = figures_redis_down

    async def inject_redis_slow(self) -> None:
        assert self.setup.redis_proxy is not None
        self.counts_injected = await self.ext_proc_counts()
        self.setup.redis_proxy.delay_s = self.plan.redis_delay_s

    reacted_redis_slow = reacted_redis_down
    hold_redis_slow = hold_redis_down

    async def restore_redis_slow(self) -> None:
        assert self.setup.redis_proxy is not None
        self.counts_restored = await self.ext_proc_counts()
        self.restored_at = self.now()
        self.setup.redis_proxy.delay_s = 0.0

    back_redis_slow = back_redis_down

    # --- a NACKed config: traffic goes on with the last good one; the NACK shows in the admin API -----------

    def _admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.dp.admin_token}"}

    async def envoy_eds(self) -> dict[str, Any] | None:
        """Envoy's EDS status in ``GET /v1/xds/clients`` (Envoy: the client without ext_proc's key table)."""
        response = await self.client.get(f"{self.dp.control_plane_url}/v1/xds/clients", headers=self._admin())
        response.raise_for_status()
        envoys = [c for c in response.json()["clients"] if "keys" not in c["types"]]
        return envoys[0]["types"].get("eds") if len(envoys) == 1 else None

    async def _pin(self, weight: int | None) -> None:
        """A change of EDS for the control plane to publish (pin the target's weight; None: unpin)."""
        url = f"{self.dp.control_plane_url}/v1/endpoints/{self.target_worker}/weight"
        response = await (self.client.put(url, json={"weight": weight}, headers=self._admin()) if weight
                          else self.client.delete(url, headers=self._admin()))
        response.raise_for_status()

    async def inject_config_nack(self) -> None:
        assert self.setup.nack_flag is not None
        self.setup.nack_flag.touch()
        await self._pin(50)

    async def reacted_config_nack(self) -> bool:
        eds = await self.envoy_eds()
        return eds is not None and eds["nack_count"] > 0

    async def hold_config_nack(self, reacted: float) -> dict[str, Any]:
        """Keep the bad config current while the baseline's count of requests is answered."""
        await self.wait(lambda: self._any_answered(self.plan.baseline, reacted), self.plan.react_timeout_s, "hold")
        eds = await self.envoy_eds() or {}
        stats = (await self.client.get(f"{self.dp.envoy_admin_url}/stats")).text
        held = self.timeline.since(reacted)
        return {"held_s": round(self.now() - reacted, 3),
                "statuses_while_held": dict(Counter(str(a.status) for a in held)),
                "nack_count": eds.get("nack_count"), "last_nack": (eds.get("last_nack") or {}).get("message"),
                "in_sync_while_held": eds.get("in_sync"),
                "envoy_update_rejected": envoy_stat(stats, "cluster.workers.update_rejected")}

    async def restore_config_nack(self) -> None:
        assert self.setup.nack_flag is not None
        self.setup.nack_flag.unlink()
        self.restored_at = self.now()
        await self._pin(None)

    async def back_config_nack(self) -> bool:
        """Envoy ACKed the good config published after the restore, and served."""
        eds = await self.envoy_eds()
        return eds is not None and eds["in_sync"] and await self.answered(1, self.restored_at)

    # --- PostgreSQL down under two control-plane replicas: serving goes on, mutations get a clear 503, and
    # the replicas converge when it returns ----------------------------------------------------------------

    def _replica_urls(self) -> dict[str, str]:
        assert self.dp.control_plane_url is not None and self.setup.replica_b_url is not None
        return {"a": self.dp.control_plane_url, "b": self.setup.replica_b_url}

    async def _mutate(self, replica: str, weight: int) -> dict[str, Any]:
        """Pin the target's weight through ``replica``: the answer's status, error code and time (a hang shows
        as ``timeout`` after the client's 5 s)."""
        url = f"{self._replica_urls()[replica]}/v1/endpoints/{self.target_worker}/weight"
        started = self.loop.time()
        try:
            response = await self.client.put(url, json={"weight": weight}, headers=self._admin())
        except httpx.TimeoutException:
            return {"replica": replica, "status": "timeout", "at_s": round(self.now(), 3)}
        try:
            body = response.json()
        except ValueError:
            body = {}
        error = body.get("error") if isinstance(body, dict) else None
        return {"replica": replica, "status": response.status_code, "at_s": round(self.now(), 3),
                "took_s": round(self.loop.time() - started, 3),
                "code": error.get("code") if isinstance(error, dict) else None,
                # the admin API's one error shape: {"error": {"status", "code", "message", "detail"}}
                "error_shape": isinstance(error, dict) and {"status", "code", "message", "detail"} <= set(error)
                and error["status"] == response.status_code,
                "message": error.get("message") if isinstance(error, dict) else None}

    async def _pinned(self, replica: str) -> int | None:
        url = f"{self._replica_urls()[replica]}/v1/endpoints/{self.target_worker}"
        response = await self.client.get(url, headers=self._admin())
        response.raise_for_status()
        pinned = response.json()["weight"]["pinned"]
        return None if pinned is None else int(pinned)

    async def inject_postgres_down(self) -> None:
        assert self.setup.postgres is not None
        self.mutations: list[dict[str, Any]] = []
        self.refused: set[str] = set()
        await self.setup.postgres.shutdown_immediately()

    async def reacted_postgres_down(self) -> bool:
        """Each replica refused a pin with 503 ``store_unavailable`` (each is asked until it has)."""
        for replica in sorted(set(self._replica_urls()) - self.refused):
            answer = await self._mutate(replica, PIN_WHILE_DOWN)
            self.mutations.append(answer)
            if answer["status"] == 503 and answer["code"] == "store_unavailable" and answer["error_shape"]:
                self.refused.add(replica)
        return self.refused == set(self._replica_urls())

    async def hold_postgres_down(self, reacted: float) -> dict[str, Any]:
        """Keep it down while the baseline's count of requests is answered; then each replica is asked once
        more, and neither shows the refused pin."""
        await self.wait(lambda: self._any_answered(self.plan.baseline, reacted), self.plan.react_timeout_s, "hold")
        for replica in sorted(self._replica_urls()):
            self.mutations.append(await self._mutate(replica, PIN_WHILE_DOWN))
        held = self.timeline.since(reacted)
        return {"held_s": round(self.now() - reacted, 3),
                "statuses_while_held": dict(Counter(str(a.status) for a in held)),
                "picked_while_held": sum(ENDPOINT_HEADER in a.headers for a in held),
                "pinned_while_down": {r: await self._pinned(r) for r in sorted(self._replica_urls())}}

    async def restore_postgres_down(self) -> None:
        assert self.setup.postgres is not None
        self.restored_at = self.now()
        self.converging: list[dict[str, Any]] = []  # the pins through B until one is saved
        await self.setup.postgres.start()  # same data directory and port: crash recovery, every row kept

    async def back_postgres_down(self) -> bool:
        """A pin through replica B saved, shown by replica A and applied by A's Envoy; ext_proc picks again
        and every worker is healthy."""
        if not any(m["status"] == 200 for m in self.converging):
            self.converging.append(await self._mutate("b", PIN_WHEN_BACK))
            if self.converging[-1]["status"] != 200:
                return False
        if await self._pinned("a") != PIN_WHEN_BACK:
            return False
        if host_weight(await self.clusters(), self.target) != PIN_WHEN_BACK:
            return False
        picked = any(ENDPOINT_HEADER in a.headers for a in self.timeline.succeeded_since(self.restored_at))
        return picked and await self.every_worker_healthy()

    async def figures_postgres_down(self) -> dict[str, Any]:
        return {"mutations_while_down": list(getattr(self, "mutations", [])),
                "mutations_converging": list(getattr(self, "converging", [])),
                "pinned_after": {r: await self._pinned(r) for r in sorted(self._replica_urls())}}


def _since(t: float | None, origin: float) -> float | None:
    return None if t is None else round(t - origin, 3)


def _share(before: dict[str, int], after: dict[str, int], host: str) -> float | None:
    """``host``'s share of the requests Envoy sent to the workers between the two samples (retries included)."""
    total = sum(after.get(h, 0) - before.get(h, 0) for h in after)
    return round((after.get(host, 0) - before.get(host, 0)) / total, 4) if total > 0 else None


