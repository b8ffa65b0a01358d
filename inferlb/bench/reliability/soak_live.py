"""The live half of ``inferlb bench soak``: the faults harness's stack, no fault, open-loop load for a long time.

The stack is the one ``FaultRunner`` starts (simulated workers so that the emulated fleet, not the 2-core
host, is the bottleneck; the control plane, ext_proc and Envoy with the product's retries, health checks and
outlier detection), so the soak and the faults measure the same thing. It is sampled at rest before the
load, every ``every_s`` seconds during it, and at rest again once nothing is in flight after it (waited on,
with a deadline). The verdicts are ``soak_judge.judge_run``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .faults_live import FaultRunner
from .faults_plan import FaultPlan
from ..load.loadgen import Answer, LoadOutcome, run_load
from ..processes import ProcessGroup
from ..routing.runner import CAPACITY_CONFIGURATION, Report
from .soak_judge import Check, downsample, judge_run, summarise
from .soak_sample import Watched, settled, take_sample

JSON_POINTS = 40  # samples per series kept in the JSON (downsampled)


@dataclass(frozen=True)
class SoakPlan:
    """The stack, the load and the sampling of one soak."""

    duration_s: float = 600.0
    load: float = 0.6  # of the fleet's capacity (every slot busy on the mix's mean request)
    workers: int = 4
    slots: int = 2
    cost_scale: float = 20.0  # as the faults harness: the emulated fleet is the bottleneck
    every_s: float = 10.0  # between samples
    warmup: float = 0.2  # the share of the run not judged for growth (start-up, pools filling, caches warming)
    request_timeout_s: float = 15.0
    drain_timeout_s: float = 30.0  # after the load, for everything in flight to finish
    seed: int = 1

    @property
    def warmup_s(self) -> float:
        return self.warmup * self.duration_s

    def problems(self) -> list[str]:
        out = []
        if not 0 < self.load <= 1.5:
            out.append(f"--load must be in (0, 1.5], got {self.load:g}")
        if self.workers < 1:
            out.append(f"--workers must be >= 1, got {self.workers}")
        if not 0 <= self.warmup < 1:
            out.append(f"--warmup must be in [0, 1), got {self.warmup:g}")
        if not 0 < self.every_s <= self.duration_s * (1 - self.warmup) / 3:
            out.append(f"--every must leave at least 3 samples after the warm-up: in (0, "
                       f"{self.duration_s * (1 - self.warmup) / 3:g}] for this duration, got {self.every_s:g}")
        return out

    def fault_plan(self) -> FaultPlan:
        """The faults harness's plan of the same stack and load, without a fault."""
        return FaultPlan(faults=(), load=self.load, workers=self.workers, slots=self.slots,
                         cost_scale=self.cost_scale, max_run_s=self.duration_s,
                         request_timeout_s=self.request_timeout_s, seed=self.seed)


@dataclass
class Tally:
    """The answers so far, for the progress lines (the final counts are the load generator's)."""

    ok: int = 0
    failed: int = 0

    def add(self, answer: Answer) -> None:
        if answer.status is not None and 200 <= answer.status < 300:
            self.ok += 1
        else:
            self.failed += 1


@dataclass
class SoakResult:
    plan: SoakPlan
    capacity_rps: float
    outcome: LoadOutcome
    before: dict[str, float]  # at rest, before the load
    samples: list[tuple[float, dict[str, float]]]  # (seconds since the load began, sample)
    rest: dict[str, float]  # at rest after the load (or the last try when it never settled)
    drained_s: float | None  # from the load's end to nothing in flight; None: not within the deadline
    wall_s: float
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def series(self, name: str) -> list[tuple[float, float]]:
        return [(t, s[name]) for t, s in self.samples if name in s]

    def load_figures(self) -> dict[str, Any]:
        o = self.outcome
        s = o.histogram.summary()
        return {"offered_rps": round(o.offered_rps, 2), "sent": o.sent, "succeeded": o.completed,
                "non_2xx": sum(v for k, v in o.statuses.items() if not 200 <= k < 300),
                "no_answer": sum(o.error_kinds.values()), "timeouts": o.timeouts,
                "failed": o.errors + o.timeouts, "statuses": {str(k): v for k, v in sorted(o.statuses.items())},
                "error_kinds": dict(o.error_kinds), "p50_ms": round(s.p50_s * 1e3, 1),
                "p99_ms": round(s.p99_s * 1e3, 1), "max_inflight": o.max_inflight,
                "send_lag_p99_ms": round(o.send_lag_p99_s * 1e3, 2)}

    def to_json(self) -> dict[str, Any]:
        """A summary and every series downsampled to ``JSON_POINTS`` points: kilobytes, not megabytes."""
        names = sorted({k for _, s in self.samples for k in s})
        return {"plan": asdict(self.plan), "capacity_rps": round(self.capacity_rps, 2),
                "passed": self.passed, "load": self.load_figures(),
                "drained_s": None if self.drained_s is None else round(self.drained_s, 2),
                "checks": summarise(self.checks), "at_rest_before": self.before, "at_rest_after": self.rest,
                "samples": {"count": len(self.samples), "every_s": self.plan.every_s,
                            "series": {n: [[round(t, 1), v] for t, v in downsample(self.series(n), JSON_POINTS)]
                                       for n in names}},
                "wall_s": round(self.wall_s, 1)}


class SoakRunner(FaultRunner):
    """One soak on one fresh stack; logs in ``<out>/runs/``."""

    def __init__(self, plan: SoakPlan, out_dir: Path, report: Report) -> None:
        super().__init__(plan.fault_plan(), out_dir, report)
        self.soak = plan

    def _watched(self, group: ProcessGroup, dp: Any) -> list[Watched]:
        out = [Watched("envoy", group.pid("envoy"), f"{dp.envoy_admin_url}/stats/prometheus"),
               Watched("control-plane", group.pid("control-plane"), f"{dp.control_plane_url}/metrics"),
               Watched("ext_proc", group.pid("ext_proc"), f"{dp.ext_proc_metrics_url}/metrics")]
        for i, port in enumerate(self.layout.ports):
            name = f"worker:{port}"
            out.append(Watched(name, group.pid(name), f"{self.layout.url(i)}/metrics", is_worker=True))
        return out

    async def run(self) -> SoakResult:
        plan = self.soak
        (self.out_dir / "logs").mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        rps = plan.load * self.capacity_rps
        trace, bodies = await asyncio.to_thread(self._trace, self.scenario, rps)
        async with contextlib.AsyncExitStack() as stack:
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=10.0, trust_env=False))
            group = await stack.enter_async_context(ProcessGroup(report=self._log_line))
            dp = self._plan(CAPACITY_CONFIGURATION)
            await self._start(group, dp, client)
            watched = self._watched(group, dp)
            before = await take_sample(client, watched)
            self.report(f"soak: {rps:.1f} req/s ({plan.load:.0%} of {self.capacity_rps:.1f}) for {plan.duration_s:g} s, "
                        f"{len(trace)} requests; a sample every {plan.every_s:g} s, warm-up {plan.warmup_s:g} s")
            tally = Tally()
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            load = asyncio.create_task(run_load(dp.url, trace, bodies, slo_s=plan.request_timeout_s,
                                                timeout_s=plan.request_timeout_s, progress=False,
                                                on_answer=tally.add))
            samples: list[tuple[float, dict[str, float]]] = []
            try:
                while not load.done():  # a sample every every_s on the clock (pacing, not synchronisation)
                    due = t0 + (len(samples) + 1) * plan.every_s
                    await asyncio.wait({load}, timeout=max(0.0, due - loop.time()))
                    group.check_alive()
                    t = loop.time() - t0
                    sample = await take_sample(client, watched)
                    samples.append((t, sample))
                    self.report(progress_line(t, plan.duration_s, tally, sample))
                outcome = await load
            finally:
                if not load.done():
                    load.cancel()
                    await asyncio.gather(load, return_exceptions=True)
            ended = loop.time()
            rest, drained = await self._drain(client, group, watched, ended)
        result = SoakResult(plan, self.capacity_rps, outcome, before, samples, rest, drained,
                            time.monotonic() - started)
        result.checks = judge_run(result.series, sorted({k for _, s in samples for k in s}), plan.warmup_s,
                                  failed=result.load_figures(), rest=rest, drained_s=drained)
        return result

    async def _drain(self, client: httpx.AsyncClient, group: ProcessGroup, watched: list[Watched],
                     ended: float) -> tuple[dict[str, float], float | None]:
        """Sample until nothing is in flight anywhere (the sample then is the one at rest), or the deadline."""
        loop = asyncio.get_running_loop()
        deadline = ended + self.soak.drain_timeout_s
        while True:
            group.check_alive()
            sample = await take_sample(client, watched)
            if settled(sample):
                return sample, loop.time() - ended
            if loop.time() > deadline:
                self.report(f"soak: still in flight {self.soak.drain_timeout_s:g} s after the load: "
                            + ", ".join(f"{k} {v:g}" for k, v in sample.items()
                                        if k.startswith(("outstanding:", "inflight:")) and v))
                return sample, None
            await asyncio.sleep(0.2)


def progress_line(t: float, duration_s: float, tally: Tally, sample: dict[str, float]) -> str:
    """One line per sample: where the run is, what clients got, each process's RSS, what is in flight."""
    mib = {k.split(":", 1)[1]: v / 2**20 for k, v in sample.items() if k.startswith("rss:")}
    workers = [v for k, v in mib.items() if k.startswith("worker:")]
    fds = sum(v for k, v in sample.items() if k.startswith("fds:"))
    return (f"  {t:6.0f}/{duration_s:g} s  ok {tally.ok}  failed {tally.failed}  RSS MiB: envoy {mib['envoy']:.1f}, "
            f"control-plane {mib['control-plane']:.1f}, ext_proc {mib['ext_proc']:.1f}, workers "
            f"{min(workers):.1f}-{max(workers):.1f}  fds {fds:.0f}  outstanding {sample['outstanding:requests']:g}")
