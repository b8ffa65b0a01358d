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
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx

from .dataplanes import DataPlanePlan, DataPlanePorts, plan_data_plane
from .dataplanes.launch import healthy_hosts
from .loadgen import Answer, run_load
from .processes import ProcessGroup, free_port
from .runner import CAPACITY_CONFIGURATION, Report, ScenarioRunner, _slug
from .scenario import Fleet, Scenario, WorkerSpec

PRODUCT_RETRIES = 2  # the control plane's default (DataPlaneConfig.retries): faults run the product's settings
POLL_S = 0.1
ENDPOINT_HEADER = "x-inferlb-endpoint"  # set by ext_proc's pick: absent when Envoy failed open
WORKER_HEADER = "x-inferlb-worker"  # set by the worker that served
FAULTS = ("worker_kill", "worker_stop", "ext_proc_kill", "control_plane_kill", "envoy_restart", "worker_500")


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

    def ok(self, answer: Answer) -> bool:
        return answer.status is not None and 200 <= answer.status < 300

    def succeeded_since(self, t: float) -> list[Answer]:
        return [a for a in self.answers if a.send_at_s >= t and self.ok(a)]

    def failed(self) -> list[Answer]:
        return [a for a in self.answers if not self.ok(a)]


def envoy_stat(stats_text: str, name: str) -> int:
    """One counter of Envoy's admin ``/stats`` text (0 when absent)."""
    for line in stats_text.splitlines():
        key, _, value = line.partition(": ")
        if key == name and value.strip().isdigit():
            return int(value)
    return 0


def host_flags(clusters_text: str, host: str, cluster: str = "workers") -> str | None:
    """Envoy's health flags of ``host`` in ``cluster`` ("healthy", "/failed_active_hc", ...); None: not there."""
    for line in clusters_text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == cluster and parts[1] == host and parts[2] == "health_flags":
            return parts[3]
    return None


def host_requests(clusters_text: str, cluster: str = "workers") -> dict[str, int]:
    """Requests Envoy sent to each host of ``cluster`` (its ``rq_total``), retries included."""
    out = {}
    for line in clusters_text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == cluster and parts[2] == "rq_total" and parts[3].isdigit():
            out[parts[1]] = int(parts[3])
    return out


class FaultRunner(ScenarioRunner):
    """Runs each fault of the plan on its own fresh stack; ``run_fault`` returns one row of the table."""

    def __init__(self, plan: FaultPlan, out_dir: Path, report: Report) -> None:
        super().__init__(fault_scenario(plan), out_dir, plans=(), progress=False, report=report)
        self.fault_plan = plan
        self.base_dir = out_dir

    @property
    def capacity_rps(self) -> float:
        from .capacity import theoretical_capacity_rps

        return theoretical_capacity_rps(self.scenario)

    def _plan(self, configuration: str) -> DataPlanePlan:
        return plan_data_plane(configuration, endpoints=self.layout.endpoints,
                               workdir=self.out_dir / "runs" / _slug(configuration),
                               ports=DataPlanePorts.allocate(free_port),
                               request_timeout_s=self.scenario.request_timeout_s, envoy=self.envoy,
                               retries=PRODUCT_RETRIES)

    async def run_all(self) -> list[dict[str, Any]]:
        return [await self.run_fault(name) for name in self.fault_plan.faults]

    async def run_fault(self, name: str) -> dict[str, Any]:
        """A fresh stack, the load, the fault; the figures of the run. Its logs: ``<out>/<fault>/``."""
        self.out_dir = self.base_dir / name
        self._log = self.out_dir / "logs" / "bench.log"
        (self.out_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.layout = type(self.layout)(tuple(self._distinct_ports(len(self.scenario.fleet.workers))))
        dp = self._plan(CAPACITY_CONFIGURATION)
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client, \
                ProcessGroup(report=self._log_line) as group:
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
        self.target = runner.layout.ids[0]  # the faulty worker, for the worker faults
        self.killed_envoy: dict[str, int] | None = None  # Envoy's counters when it was killed (they restart at 0)
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
        before = await self.envoy_counters()
        self.t0 = self.loop.time()
        load = asyncio.create_task(run_load(self.dp.url, trace, bodies, slo_s=plan.request_timeout_s,
                                            timeout_s=plan.request_timeout_s, progress=False,
                                            on_answer=self.timeline.add, stop=stop))
        runner.report(f"  {self.name}: {rps:.1f} req/s ({plan.load:.0%} of {runner.capacity_rps:.1f})")
        figures: dict[str, Any] = {}
        try:
            if await self.wait(lambda: self.answered(plan.baseline, 0.0), plan.max_run_s, "baseline") is None:
                raise RuntimeError(f"{self.name}: the stack did not serve {plan.baseline} requests before the fault")
            hosts0 = await self.hosts()
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
            "retried": after["retries"] - before["retries"],
            "fail_open": after["fail_open"] - before["fail_open"],
            "recovery_s": recovery, **figures,
            "statuses": {str(k): v for k, v in sorted(outcome.statuses.items())},
            "error_kinds": dict(outcome.error_kinds), "timeouts": outcome.timeouts,
            "failures_by_second": dict(sorted(Counter(int(a.send_at_s - injected) for a in failed_after).items())),
            "spread": dict(sorted(outcome.spread.items())), "target": self.target,
        }
        runner.report(f"    sent {row['sent']}, succeeded {row['succeeded']}, failed {row['failed']}, "
                      f"retried {row['retried']}, reacted in {row['reacted_s']} s, recovered in {recovery} s")
        return row

    # --- Envoy's admin API ------------------------------------------------------------------------

    async def envoy_counters(self) -> dict[str, int]:
        try:
            text = (await self.client.get(f"{self.dp.envoy_admin_url}/stats")).text
        except httpx.TransportError:
            return {"retries": 0, "fail_open": 0}
        fail_open = sum(int(v) for k, _, v in (line.partition(": ") for line in text.splitlines())
                        if k.endswith("failure_mode_allowed") and v.strip().isdigit())
        return {"retries": envoy_stat(text, "cluster.workers.upstream_rq_retry"), "fail_open": fail_open}

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
        return any(a.headers.get(WORKER_HEADER) == self.target for a in self.timeline.succeeded_since(since))

    async def every_worker_healthy(self) -> bool:
        return set(self.runner.layout.ids) <= healthy_hosts(await self.clusters())

    # --- kill -9 a worker: retried elsewhere; it leaves, and returns with slow start when restarted -----

    async def inject_worker_kill(self) -> None:
        self.worker_spec = await self.group.kill(f"worker:{self.target.rsplit(':', 1)[1]}")

    async def reacted_worker_kill(self) -> bool:
        return await self.target_flags() != "healthy"

    async def restore_worker_kill(self) -> None:
        self.restored_at = self.now()
        await self.group.start([self.worker_spec])

    async def back_worker_kill(self) -> bool:
        return await self.target_serves(self.restored_at)

    # --- SIGSTOP a worker, then SIGCONT: timeouts and health checks route around it -----------------

    def _worker_name(self) -> str:
        return f"worker:{self.target.rsplit(':', 1)[1]}"

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
        response = await self.client.put(f"http://{self.target}/v1/simulation", json={"fail_rate": rate})
        response.raise_for_status()

    async def inject_worker_500(self) -> None:
        await self._fail_rate(1.0)

    async def reacted_worker_500(self) -> bool:
        return "failed_outlier_check" in (await self.target_flags() or "")

    async def hold_worker_500(self, reacted: float) -> dict[str, Any]:
        """Keep it failing while the baseline's count of requests is served: what share does it still get?"""
        hosts0 = await self.hosts()
        await self.wait(lambda: self.answered(self.plan.baseline, reacted), self.plan.react_timeout_s, "hold")
        endpoint = (await self.client.get(f"{self.dp.control_plane_url}/v1/endpoints/{self.target}")).json()
        return {"target_share_while_held": _share(hosts0, await self.hosts(), self.target),
                "target_weight_after_hold": endpoint.get("weight"),
                "held_s": round(self.now() - reacted, 3), "target_flags_after_hold": await self.target_flags()}

    async def restore_worker_500(self) -> None:
        self.restored_at = self.now()
        await self._fail_rate(0.0)

    back_worker_500 = back_worker_kill


def _since(t: float | None, origin: float) -> float | None:
    return None if t is None else round(t - origin, 3)


def _share(before: dict[str, int], after: dict[str, int], host: str) -> float | None:
    """``host``'s share of the requests Envoy sent to the workers between the two samples (retries included)."""
    total = sum(after.get(h, 0) - before.get(h, 0) for h in after)
    return round((after.get(host, 0) - before.get(host, 0)) / total, 4) if total > 0 else None


