"""The live half of ``inferlb bench overload``: one stack, its SLO switched through the admin API, each class
sent by its own open-loop generator (see ``overload.py``)."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx

from inferlb_runtime.pick_chain import DEFAULT_PICK_POLICY
from inferlb_runtime.request_class import Priority

from ..load.classes import class_headers, trace_classes
from ..stack.dataplanes import DataPlanePlan
from ..report.exposition import sums_by_label
from ..load.gateway_log import log_size, wait_for_answers
from ..load.loadgen import LoadOutcome, run_load
from .overload_report import run_figures
from ..report.table import ms
from ..processes import ProcessGroup
from ..routing.runner import CAPACITY_CONFIGURATION, ScenarioRunner
from ..load.trace import Trace

SWITCH_TIMEOUT_S = 30.0
SHED_STAGES = ("request_headers", "screen", "fair_queue", "decision")  # ext_proc's sheds_total{at}


def live_class_figures(outcome: LoadOutcome) -> dict[str, Any]:
    """One class's figures from its generator's ``LoadOutcome``: a 429 is a shed, any other failure an error."""
    s = outcome.histogram.summary()
    shed = outcome.statuses.get(429, 0)
    return {
        "sent": outcome.sent, "completed": outcome.completed, "shed": shed,
        "errors": outcome.errors - shed + outcome.timeouts, "timeouts": outcome.timeouts,
        "p50_s": s.p50_s if outcome.completed else None, "p99_s": s.p99_s if outcome.completed else None,
        "shed_p50_s": outcome.refused.percentile(50) if shed else None,
        "shed_p99_s": outcome.refused.percentile(99) if shed else None,  # of every non-2xx: 429s, unless errors
        # what the 429s' time holds of the client's own: how late it sent, against the schedule
        "send_lag_p50_s": outcome.send_lag_p50_s, "send_lag_p99_s": outcome.send_lag_p99_s,
        "client_cpu_s": round(outcome.client_cpu_s, 2),
        "goodput_rps": outcome.goodput_rps, "statuses": {str(k): v for k, v in sorted(outcome.statuses.items())},
    }


class OverloadRunner(ScenarioRunner):
    """The scenario runner's fleet, data plane and capacity search, driven for the overload runs."""

    async def _switch_slo(self, client: httpx.AsyncClient, plan: DataPlanePlan, slo_ms: float) -> None:
        """Set the pick policy's slo_ms through the control plane's admin API; wait until ext_proc took it."""
        before = await self._switches(client, plan)
        response = await client.put(f"{plan.control_plane_url}/v1/policy",
                                    json={"pick": {"name": DEFAULT_PICK_POLICY, "params": {"slo_ms": slo_ms}}},
                                    headers={"Authorization": f"Bearer {plan.admin_token}"})
        if response.status_code != 200:
            raise RuntimeError(f"the control plane refused slo_ms {slo_ms:g}: {response.status_code} {response.text}")
        deadline = time.monotonic() + SWITCH_TIMEOUT_S
        while await self._switches(client, plan) <= before:
            if time.monotonic() > deadline:
                raise RuntimeError(f"ext_proc did not take slo_ms {slo_ms:g} within {SWITCH_TIMEOUT_S:g} s")
            await asyncio.sleep(0.1)

    @staticmethod
    async def _ext_proc_sums(client: httpx.AsyncClient, plan: DataPlanePlan, name: str,
                             label: str) -> dict[str, float]:
        text = (await client.get(f"{plan.ext_proc_metrics_url}/metrics")).text
        return sums_by_label(text, name, label)

    async def _switches(self, client: httpx.AsyncClient, plan: DataPlanePlan) -> float:
        sums = await self._ext_proc_sums(client, plan, "inferlb_ext_proc_policy_switches_total", "result")
        return sums.get("switched", 0.0)

    async def _sheds(self, client: httpx.AsyncClient, plan: DataPlanePlan) -> dict[str, float]:
        """ext_proc's sheds so far, by the step that judged them (``inferlb_ext_proc_sheds_total{at}``)."""
        sums = await self._ext_proc_sums(client, plan, "inferlb_ext_proc_sheds_total", "at")
        return {at: sums.get(at, 0.0) for at in SHED_STAGES}

    @staticmethod
    def _envoy_log(plan: DataPlanePlan) -> Path:
        return next(c.log_path for stage in plan.stages for c in stage if c.name == "envoy")

    async def _classes_run(self, group: ProcessGroup, client: httpx.AsyncClient, plan: DataPlanePlan,
                           rps: float) -> dict[str, dict[str, Any]]:
        """The trace at ``rps``, each class by its own generator, concurrently; figures per class."""
        s = self.scenario
        await self._wait_idle(client, group)
        trace, bodies = await asyncio.to_thread(self._trace, s, rps)
        classes = trace_classes(s.workload.classes, len(trace), s.seed)
        runs = {}
        for priority in Priority:
            mine = classes == int(priority)
            if not mine.any():
                continue
            share = float(mine.mean())
            sub = Trace(trace.send_at_s[mine], trace.tokens[mine], trace.bucket[mine], trace.rate_rps * share,
                        trace.duration_s, trace.seed)
            sub_bodies = [b for b, m in zip(bodies, mine.tolist()) if m]
            runs[priority.name.lower()] = run_load(plan.url, sub, sub_bodies, slo_s=s.slo_s,
                                                   timeout_s=s.request_timeout_s, warmup_s=s.warmup_s,
                                                   progress=False, headers=class_headers(priority))
        envoy_log = self._envoy_log(plan)
        offset, sheds_before = log_size(envoy_log), await self._sheds(client, plan)
        measured_from = datetime.now(timezone.utc) + timedelta(seconds=s.warmup_s)
        outcomes = await asyncio.gather(*runs.values())
        group.check_alive()
        figures = {name: live_class_figures(o) for name, o in zip(runs, outcomes)}
        if "sheddable" in figures:
            sheddable = figures["sheddable"]
            sheds_after = await self._sheds(client, plan)
            # the same 429s as Envoy timed them, without the generator's lateness (whole ms, truncated;
            # requests started after the warm-up on the wall clock, so a few more or fewer than the client's)
            gateway = await wait_for_answers(envoy_log, offset, 429, measured_from, sheddable["shed"])
            sheddable["gateway_429"] = gateway.summary()
            sheddable["shed_at"] = {k: int(sheds_after[k] - sheds_before[k]) for k in SHED_STAGES}
        return figures

    async def overload(self, load: float, shed_slo_ms: float) -> dict[str, Any]:
        """Capacity, then the shedding and the baseline runs on one stack."""
        self._log.parent.mkdir(parents=True, exist_ok=True)
        s = self.scenario
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            capacity = await self.find_capacity(client)
            rps = load * capacity["rps"]
            plan = self._plan(CAPACITY_CONFIGURATION)
            runs = []
            async with ProcessGroup(report=self._log_line) as group:
                await self._start(group, plan, client)
                for name, slo_ms in (("shedding", shed_slo_ms), ("baseline", 0.0)):
                    await self._switch_slo(client, plan, slo_ms)
                    self.report(f"  {name}: slo_ms {slo_ms:g}, {rps:.1f} req/s ({load:.0%}) for "
                                f"{s.warmup_s:g}s warm-up + {s.duration_s:g}s")
                    classes = await self._classes_run(group, client, plan, rps)
                    run = run_figures(name, "live", rps, capacity["rps"], s.slo_s, classes, s.duration_s)
                    self.report(f"    critical p99 {ms(run['critical_p99_s'])} ms, errors {run['critical_errors']}; "
                                f"shed {run['shed']} (429 p99 {ms(run['shed_p99_s'])} ms); goodput "
                                f"{run['goodput_of_capacity']:.0%} of capacity")
                    runs.append(run)
        return {"capacity": capacity, "runs": runs}
