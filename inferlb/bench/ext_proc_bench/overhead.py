"""Phase 1: what the ext_proc filter adds, open loop, the baseline and the stack's Envoy interleaved.

Each rate's duration is split into rounds; in each round both configurations get
the very same schedule, alternating which goes first. The load is the bench's
open-loop generator (``loadgen.run_load``): latency from the scheduled send time.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..stack.fleet import HOST
from ..report.histogram import LatencyHistogram
from ..load.loadgen import LoadOutcome, run_load
from ..processes import ProcessGroup
from .cpu import CpuMeter
from .stack import (
    EXT_PROC_STATS, Log, Stack, all_healthy, decisions, ext_proc_filter_stats, static_envoy, trivial_servicer,
    trivial_uds, wait_until,
)
from .workload import PATH, cycled, schedule

WARMUP_RATE = 500


async def open_loop(port: int, bodies: Sequence[bytes], rate: float, seconds: float, arrivals: str, seed: int,
                    max_connections: int, drain_s: float) -> LoadOutcome:
    """One open-loop run against 127.0.0.1:``port``; answers later than ``drain_s`` after their scheduled
    time count as timeouts."""
    trace = schedule(rate, seconds, arrivals, seed)
    return await run_load(f"http://127.0.0.1:{port}{PATH}", trace, cycled(list(bodies), len(trace)),
                          slo_s=drain_s, timeout_s=drain_s, progress=False, max_connections=max_connections)


def _ms(h: LatencyHistogram, q: float) -> float | None:
    return h.percentile(q) * 1000 if h.count else None


def summarise(runs: Sequence[LoadOutcome]) -> dict[str, Any]:
    """The rounds of one configuration at one rate, merged."""
    latency, service = LatencyHistogram(), LatencyHistogram()
    for r in runs:
        latency.merge(r.histogram)
        service.merge(r.service)
    wall = sum(r.wall_s for r in runs)
    requests = sum(r.sent for r in runs)
    statuses = sum((collections.Counter({str(k): v for k, v in r.statuses.items()}) for r in runs),
                   collections.Counter())
    return {
        "requests": requests,
        "completed": sum(r.completed for r in runs),
        "errors": sum(r.errors + r.timeouts for r in runs),
        "timeouts": sum(r.timeouts for r in runs),
        "achieved_rps": sum(r.completed for r in runs) / max(1e-9, sum(r.measured_s for r in runs)),
        "p50_ms": _ms(latency, 50), "p90_ms": _ms(latency, 90), "p99_ms": _ms(latency, 99),
        "p999_ms": _ms(latency, 99.9), "mean_ms": latency.mean() * 1000 if latency.count else None,
        "service_p50_ms": _ms(service, 50), "service_p99_ms": _ms(service, 99),
        "lag_p50_ms": max(r.send_lag_p50_s for r in runs) * 1000,
        "lag_p99_ms": max(r.send_lag_p99_s for r in runs) * 1000,
        "lag_max_ms": max(r.send_lag_max_s for r in runs) * 1000,
        "max_inflight": max(r.max_inflight for r in runs),
        "generator_cores": sum(r.client_cpu_s for r in runs) / max(1e-9, wall),
        "statuses": dict(statuses),
    }


def added(baseline: dict[str, Any], other: dict[str, Any]) -> dict[str, float | None]:
    """What ``other`` adds to the baseline, percentile by percentile."""
    return {k: (other[k] - baseline[k]) if other[k] is not None and baseline[k] is not None else None
            for k in ("p50_ms", "p90_ms", "p99_ms", "mean_ms", "service_p50_ms", "service_p99_ms")}


def generator_kept_up(s: dict[str, Any]) -> bool:
    """Every request answered or counted, sends rarely late by more than 2 ms, the generator under half a core."""
    return (s["lag_p99_ms"] is not None and s["lag_p99_ms"] <= 2.0 and s["generator_cores"] < 0.5
            and s["completed"] + s["errors"] == s["requests"])


async def filter_floor(st: Stack, group: ProcessGroup) -> int:
    """A static Envoy with the ext_proc filter in front of the same workers, its ext_proc a trivial servicer on
    the stack's gRPC front and transport: what the filter's three round trips add when the servicer does no
    work (it picks nothing, so Envoy balances by itself). Returns its listener port."""
    log_dir = st.log_dir / "filter-floor"
    log_dir.mkdir(exist_ok=True)
    trivial, port = trivial_servicer(log_dir, st.ext_proc_front)
    await group.start([trivial])
    endpoints = [(HOST, int(url.rsplit(":", 1)[1])) for url in st.worker_urls]
    envoy = static_envoy(st.envoy, log_dir, "filter-floor", endpoints, ext_proc_port=port,
                         ext_proc_uds=trivial_uds(log_dir, st.ext_proc_front) if st.transport == "uds" else None)
    await group.start([envoy.component])
    worker_ids = [f"{host}:{p}" for host, p in endpoints]
    await wait_until(lambda: all_healthy(st.client, envoy.admin_url, worker_ids), 30,
                     "every worker healthy in the filter floor's Envoy", group)
    return envoy.listener_port


async def overhead_phase(args: Any, st: Stack, bodies: Sequence[bytes], log: Log) -> dict[str, Any]:
    async with ProcessGroup() as group:
        configs = {"baseline": st.envoy_b_port, "ext_proc": st.envoy_x_port}
        if args.floor_seconds > 0:
            configs["filter_floor"] = await filter_floor(st, group)
        return await _measure(args, st, bodies, configs, log)


async def _measure(args: Any, st: Stack, bodies: Sequence[bytes], configs: dict[str, int],
                   log: Log) -> dict[str, Any]:
    groups = st.pids()
    client, metrics = st.client, st.ext_proc_metrics_url
    if args.warmup > 0:
        for name, port in configs.items():
            log(f"[warm-up] {name}: {args.warmup:g} s at {WARMUP_RATE} req/s")
            await open_loop(port, bodies, WARMUP_RATE, args.warmup, args.arrivals, args.seed, args.max_connections,
                            10)
    out: dict[str, Any] = {}
    per_round = args.duration / args.rounds
    seeds = itertools.count(args.seed + 1)
    for rate in args.rates:
        runs: dict[str, list[LoadOutcome]] = {name: [] for name in configs}
        extra: dict[str, dict[str, float]] = {name: collections.defaultdict(float) for name in configs}
        cores: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
        for round_ in range(args.rounds):
            seed = next(seeds)  # the same schedule for both
            order = list(configs) if round_ % 2 == 0 else list(reversed(configs))
            for name in order:
                d0 = await decisions(client, metrics)
                f0 = await ext_proc_filter_stats(client, st.envoy_x_admin_url)
                meter = CpuMeter(groups)
                result = await open_loop(configs[name], bodies, rate, per_round, args.arrivals, seed,
                                         args.max_connections, args.drain)
                cores[name].append(meter.stop())
                f1 = await ext_proc_filter_stats(client, st.envoy_x_admin_url)
                extra[name]["decisions"] += await decisions(client, metrics) - d0
                for key in EXT_PROC_STATS:
                    extra[name][key] += f1[key] - f0[key]
                runs[name].append(result)
                log(f"[overhead] {rate:>5} req/s round {round_ + 1}/{args.rounds} {name:<12}: "
                    f"p50 {_ms(result.histogram, 50) or 0:6.2f} ms  p99 {_ms(result.histogram, 99) or 0:6.2f} ms  "
                    f"sent {result.sent}  errors {result.errors + result.timeouts}  "
                    f"lag p99 {result.send_lag_p99_s * 1000:.2f} ms  decisions {extra[name]['decisions']:.0f}  "
                    f"others' CPU {cores[name][-1]['others']:.2f} cores")
        entry: dict[str, Any] = {}
        for name in configs:
            s = summarise(runs[name])
            s.update({k: int(v) for k, v in extra[name].items()})
            s["cores"] = {k: float(np.mean([c[k] for c in cores[name]])) for k in cores[name][0]}
            s["generator_kept_up"] = generator_kept_up(s)
            s["rounds"] = [{"p50_ms": _ms(r.histogram, 50), "p99_ms": _ms(r.histogram, 99),
                            "errors": r.errors + r.timeouts, "lag_p99_ms": r.send_lag_p99_s * 1000,
                            "scheduled": r.sent} for r in runs[name]]
            entry[name] = s
        entry["added"] = added(entry["baseline"], entry["ext_proc"])
        if "filter_floor" in entry:
            entry["filter_floor_added"] = added(entry["baseline"], entry["filter_floor"])
        out[str(rate)] = entry
    return out
