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
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from ...supervisor import Component
from ..load.loadgen import WORKER_HEADERS, LoadOutcome, run_load
from ..load.scenario import Fleet, Scenario, WorkerSpec
from ..processes import ProcessGroup, free_ports
from ..routing.runner import CAPACITY_CONFIGURATION, Report, ScenarioRunner, _slug
from ..stack.dataplanes import DataPlanePlan, DataPlanePorts, plan_data_plane
from ..stack.dataplanes.launch import start_data_plane
from ..stack.fleet import fleet_components
from .faults_nacking_control_plane import FLAG_ENV
from .faults_plan import REDIS_FAULTS, FaultPlan
from .faults_postgres import ThrowawayPostgres
from .faults_processes import ProcessFaults
from .faults_proxy import DelayProxy
from .faults_redis import ThrowawayRedis
from .faults_steps import CACHE_HEADER, FaultSetup, host_share, rounded_since
from .faults_stores import StoreFaults

PRODUCT_RETRIES = 2  # the control plane's default (DataPlaneConfig.retries): faults run the product's settings
NACKING_CONTROL_PLANE = "inferlb.bench.reliability.faults_nacking_control_plane"
REPLICA_B = "control-plane-b"  # postgres_down: the second control-plane replica (no Envoy on it)


def fault_scenario(plan: FaultPlan) -> Scenario:
    """The plan's fleet and load as a scenario, so that ``ScenarioRunner`` starts the stack."""
    fleet = Fleet(workers=tuple(WorkerSpec(1.0, plan.slots) for _ in range(plan.workers)), cost_scale=plan.cost_scale)
    return Scenario(name="faults", seed=plan.seed, duration_s=plan.max_run_s, warmup_s=0.0, slo_s=plan.request_timeout_s,
                    request_timeout_s=plan.request_timeout_s, loads=(plan.load,), slowdown=None, fleet=fleet,
                    configurations=(CAPACITY_CONFIGURATION,), pick_policy_loads=())


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


class Fault(ProcessFaults, StoreFaults):
    """One fault's run: the load, then inject, react, hold, restore, back; the table's row. The steps per fault
    are the methods named after it (``ProcessFaults``, ``StoreFaults``)."""

    def __init__(self, name: str, runner: FaultRunner, group: ProcessGroup, client: httpx.AsyncClient,
                 dp: DataPlanePlan) -> None:
        super().__init__(name, runner.fault_plan, runner.setup, group, client, dp, worker_ids=runner.layout.ids,
                         target="%s:%d" % runner.routed[0], report=runner.report)
        self.runner = runner

    async def run(self) -> dict[str, Any]:
        """The load, and under it the fault's steps; the row of the table."""
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
            figures = await self._steps()
        finally:
            stop.set()
            outcome = await load
        row = await self._row(rps, outcome, before, figures)
        runner.report(f"    sent {row['sent']}, succeeded {row['succeeded']}, failed {row['failed']}, "
                      f"retried {row['retried']}, reacted in {row['reacted_s']} s, recovered in {row['recovery_s']} s")
        return row

    async def _steps(self) -> dict[str, Any]:
        """Once the baseline is served: inject, wait for the reaction, hold, restore, wait until routing is back
        and for the tail; the figures of each step (times from the injection)."""
        plan = self.plan
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
        figures = {"injected_at_s": round(injected, 3), "reacted_s": rounded_since(reacted, injected),
                   "restored_s": round(restored - injected, 3), "back_s": rounded_since(back, injected),
                   "target_share_until_reaction": host_share(hosts0, hosts1, self.target), **held}
        if hasattr(self, f"figures_{self.name}"):
            figures.update(await getattr(self, f"figures_{self.name}")())
        return figures

    async def _row(self, rps: float, outcome: LoadOutcome, before: dict[str, int],
                   figures: dict[str, Any]) -> dict[str, Any]:
        """The table's row: the load's outcome, Envoy's counters over the run, the recovery time."""
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
        return row
