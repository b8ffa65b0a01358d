"""The cost curves of a real fleet's worker kinds, measured before the routing runs.

An emulated worker's cost is a formula; a real one's must be measured, and
micro-batching makes it depend on the queue as well as on the request. So,
for each kind of worker in the scenario (precision, threads, CPU quota), one
fresh worker, alone, in its cgroup, is driven by wrk (closed loop, C, cheap:
``inferlb bench worker``'s scripts) through two sweeps:

- **tokens**: one connection (nothing queued) at each request length: the
  service time of one request, HTTP included; fitted as ``fixed + per_token x n``;
- **queue**: the scenario's length mix at 1, 2, 4, 8 connections (that many
  requests in the worker at once): throughput, latency and the mean batch the
  worker formed. ``1 / throughput`` is the effective service time per request
  at that queue; the best throughput is the kind's capacity on the mix.

The fleet's estimated capacity is the sum of its workers' kind capacities:
the upper bound the live capacity search starts from. A worker measured alone
has the host to itself; in the routing runs the fleet shares 2 cores with
Envoy, ext_proc and the load generator, so the live capacity is lower.
"""

from __future__ import annotations

import random
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx
import numpy as np

from ...supervisor import Component
from ..stack.cpu_quota import CpuQuotas
from ..stack.fleet import FLEET_GROUP, HOST, child_env
from ..processes import ProcessGroup, free_port
from ..stack.real_fleet import place_workers, real_worker_argv
from ..load.scenario import Fleet, LengthBucket, Scenario
from ..load.texts import text_with_tokens
from ..worker.worker_bench import batches_and_inputs, wrk_script
from ..load.wrk import run_wrk

TOKENS = (8, 32, 64, 128, 256)
CONCURRENCY = (1, 2, 4, 8)
QUICK_TOKENS = (16, 128)
QUICK_CONCURRENCY = (1, 4)
MIX_BODIES = 400  # distinct mix requests wrk cycles through


@dataclass(frozen=True)
class TokenPoint:
    tokens: int
    requests: int
    service_ms: float  # mean time per request with one in flight: seconds / requests
    p50_ms: float


@dataclass(frozen=True)
class QueuePoint:
    concurrency: int
    requests: int
    rps: float
    service_ms: float  # 1000 / rps: the effective time per request at this queue
    p50_ms: float
    p99_ms: float
    mean_batch: float
    errors: int


@dataclass(frozen=True)
class CostCurve:
    """One worker kind's measured curve."""

    kind: str
    precision: str
    threads: int
    cpu_quota: float
    fixed_ms: float
    per_token_us: float
    saturated_rps: float  # the best throughput on the scenario's mix
    mix_mean_tokens: float
    tokens: tuple[TokenPoint, ...]
    queue: tuple[QueuePoint, ...]


@dataclass(frozen=True)
class Calibration:
    curves: tuple[CostCurve, ...]
    worker_kinds: tuple[str, ...]  # worker i's kind
    cpu_quota: str  # the mechanism, or why quotas were skipped
    seconds_per_point: float

    def curve(self, kind: str) -> CostCurve:
        return next(c for c in self.curves if c.kind == kind)

    @property
    def capacity_rps(self) -> float:
        """Sum of every worker's saturated throughput on the mix (each measured alone)."""
        return sum(self.curve(k).saturated_rps for k in self.worker_kinds)

    def relative_speeds(self) -> tuple[float, ...]:
        """Worker i's saturated throughput over the fastest kind's (the emulated fleet's ``speed``)."""
        best = max(c.saturated_rps for c in self.curves) or 1.0
        return tuple(round(self.curve(k).saturated_rps / best, 3) for k in self.worker_kinds)

    def to_json(self) -> dict[str, Any]:
        return {"curves": [asdict(c) for c in self.curves], "worker_kinds": list(self.worker_kinds),
                "cpu_quota": self.cpu_quota, "seconds_per_point": self.seconds_per_point,
                "capacity_rps": round(self.capacity_rps, 2), "relative_speeds": list(self.relative_speeds())}


def mix_lengths(mix: Sequence[LengthBucket], count: int, seed: int) -> list[int]:
    """``count`` token counts drawn from the scenario's mix (bucket by share, uniform inside)."""
    rng = random.Random(seed)
    buckets = rng.choices(list(mix), weights=[b.share for b in mix], k=count)
    return [rng.randint(b.min_tokens, b.max_tokens) for b in buckets]


def fit_cost(points: Sequence[TokenPoint]) -> tuple[float, float]:
    """(fixed ms, per-token µs): least squares over the points (one point: all of it per token)."""
    if len(points) == 1:
        return 0.0, points[0].service_ms * 1e3 / points[0].tokens
    x = np.array([p.tokens for p in points], dtype=float)
    y = np.array([p.service_ms for p in points], dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope * 1e3)


def render_markdown(cal: Calibration) -> str:
    """The cost curves as two tables (for table.md and the docs)."""
    lines = [f"CPU quota: {cal.cpu_quota}. Each worker kind measured alone, wrk closed loop, "
             f"{cal.seconds_per_point:g} s per point.", "",
             "| kind | fixed ms | per token µs | " + " | ".join(f"{t} tok ms" for t in _tokens(cal))
             + " | saturated req/s (mix) |",
             "|---|---:|---:|" + "---:|" * len(_tokens(cal)) + "---:|"]
    for c in cal.curves:
        by = {p.tokens: p.service_ms for p in c.tokens}
        cells = " | ".join(f"{by[t]:.1f}" if t in by else "-" for t in _tokens(cal))
        lines.append(f"| {c.kind} | {c.fixed_ms:.1f} | {c.per_token_us:.0f} | {cells} | {c.saturated_rps:.1f} |")
    lines += ["", "Against the queue (the scenario's mix, mean "
              f"{cal.curves[0].mix_mean_tokens:.0f} tokens; N requests in the worker at once):", "",
              "| kind | in flight | req/s | ms per request (1/throughput) | p50 ms | p99 ms | mean batch |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for c in cal.curves:
        for q in c.queue:
            lines.append(f"| {c.kind} | {q.concurrency} | {q.rps:.1f} | {q.service_ms:.1f} | {q.p50_ms:.1f} "
                         f"| {q.p99_ms:.1f} | {q.mean_batch:.2f} |")
    lines += ["", f"Estimated fleet capacity (sum of the workers' saturated throughputs, each alone): "
              f"{cal.capacity_rps:.1f} req/s; relative speeds "
              + ", ".join(f"{k} {s:g}" for k, s in zip(cal.worker_kinds, cal.relative_speeds())), ""]
    return "\n".join(lines)


def _tokens(cal: Calibration) -> list[int]:
    return sorted({p.tokens for c in cal.curves for p in c.tokens})


async def calibrate(scenario: Scenario, quotas: CpuQuotas | None, work_dir: Path, *, quick: bool = False,
                    report: Callable[[str], None] = lambda line: None, models_dir: Path | None = None) -> Calibration:
    """Measure each worker kind of ``scenario.fleet`` (the first worker of each kind, in its cgroup)."""
    from workers.config import default_data_dir

    fleet = scenario.fleet
    tokens, concurrency = (QUICK_TOKENS, QUICK_CONCURRENCY) if quick else (TOKENS, CONCURRENCY)
    seconds = 1.0 if quick else 2.0
    kinds = tuple(w.kind for w in fleet.workers)
    first = {k: kinds.index(k) for k in dict.fromkeys(kinds)}
    models = models_dir or default_data_dir()
    work_dir.mkdir(parents=True, exist_ok=True)
    curves = []
    with tempfile.TemporaryDirectory(prefix="calibrate-", dir=work_dir) as tmp:
        scripts = Path(tmp)
        by_tokens = {n: wrk_script(scripts, f"tokens{n}", [text_with_tokens(n, v) for v in range(8)], [n] * 8)
                     for n in tokens}
        lengths = mix_lengths(scenario.workload.mix, MIX_BODIES, scenario.seed)
        mix = wrk_script(scripts, "mix", [text_with_tokens(n, i) for i, n in enumerate(lengths)], lengths)
        for kind, index in first.items():
            report(f"calibrating {kind} (worker {index}): {len(tokens)} lengths, then the mix at "
                   f"{', '.join(map(str, concurrency))} in flight, {seconds:g} s each")
            curve = await _measure_kind(fleet, index, kind, quotas, models, work_dir, by_tokens, mix,
                                        concurrency, seconds, sum(lengths) / len(lengths))
            report(f"  {kind}: {curve.fixed_ms:.1f} ms + {curve.per_token_us:.0f} µs/token alone; "
                   f"{curve.saturated_rps:.1f} req/s at best on the mix")
            curves.append(curve)
    mechanism = quotas.mechanism if quotas is not None else "not asked"
    return Calibration(tuple(curves), kinds, mechanism, seconds)


async def _measure_kind(fleet: Fleet, index: int, kind: str, quotas: CpuQuotas | None, models: Path,
                        work_dir: Path, by_tokens: dict[int, Path], mix: Path, concurrency: Sequence[int],
                        seconds: float, mix_mean: float) -> CostCurve:
    port = free_port()
    url = f"http://{HOST}:{port}"
    name = f"calibrate:{port}"
    component = Component(name=name, argv=real_worker_argv(fleet, index, HOST, port, models, sys.executable),
                          ready_url=f"{url}/readyz", log_path=work_dir / f"calibrate-{port}.log",
                          env=child_env({"INFERLB_DATA_DIR": str(work_dir / "worker-data")}),
                          ready_timeout_s=180.0, group=FLEET_GROUP)
    spec = fleet.workers[index]
    async with ProcessGroup(stop_timeout_s=30.0) as group, httpx.AsyncClient(timeout=10, trust_env=False) as client:
        await group.start([component])
        place_workers(quotas, fleet, group, {index: name})  # in worker ``index``'s group, as in the runs
        await run_wrk(mix, url, connections=2, seconds=1, timeout_s=30)  # warm: sessions, allocator, caches
        points = []
        for n, script in by_tokens.items():
            figures, _ = await run_wrk(script, url, connections=1, seconds=seconds, timeout_s=30)
            requests = max(1, int(figures["requests"]))
            points.append(TokenPoint(n, requests, round(1e3 * figures["seconds"] / requests, 3),
                                     round(figures["p50_ms"], 3)))
        queue = []
        for c in concurrency:
            b0, i0 = batches_and_inputs((await client.get(f"{url}/metrics")).text)
            figures, _ = await run_wrk(mix, url, connections=c, seconds=seconds, timeout_s=30)
            b1, i1 = batches_and_inputs((await client.get(f"{url}/metrics")).text)
            rps = figures["requests"] / figures["seconds"]
            queue.append(QueuePoint(c, int(figures["requests"]), round(rps, 2), round(1e3 / max(rps, 1e-9), 3),
                                    round(figures["p50_ms"], 3), round(figures["p99_ms"], 3),
                                    round((i1 - i0) / max(1.0, b1 - b0), 3), int(figures["errors"])))
        group.check_alive()
    fixed_ms, per_token_us = fit_cost(points)
    return CostCurve(kind, spec.precision, spec.threads, spec.cpu_quota, round(fixed_ms, 3), round(per_token_us, 2),
                     max(q.rps for q in queue), round(mix_mean, 1), tuple(points), tuple(queue))
