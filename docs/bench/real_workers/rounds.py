"""Alternating rounds of the real-worker bench at a fixed capacity, with every request's worker and length.

Runs the listed configurations in rotated order for N rounds (a fresh fleet per run, as the bench does),
skipping the calibration (the cost curves are in docs/benchmarks.md) and the capacity search (--capacity).
Wraps the bench's load generator to keep each measured request's (tokens, worker, latency), so the
per-worker shares and latencies say where a configuration's tail comes from.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

from inferlb.bench.load import loadgen
from inferlb.bench.routing.run_command import run_on_uvloop
from inferlb.bench.routing.runner import ConfigurationPlan, RunSpec, ScenarioRunner, plan_rounds
from inferlb.bench.load.scenario import load_scenario

Row = tuple[int, str, float]  # (tokens, worker host:port, latency s from the scheduled send)


def recording(records: list[list[Row]]) -> Callable[..., Any]:
    """The bench's ``run_load``, also keeping each measured 2xx answer's row in a new list of ``records``."""
    real = loadgen.run_load

    async def run_load(url: str, trace: Any, bodies: Any, **kw: Any) -> Any:
        warmup = kw.get("warmup_s", 0.0)
        tokens = {float(t): int(n) for t, n in zip(trace.send_at_s.tolist(), trace.tokens.tolist())}
        rows: list[Row] = []

        def seen(a: loadgen.Answer) -> None:
            if a.send_at_s >= warmup and a.status is not None and 200 <= a.status < 300:
                rows.append((tokens[a.send_at_s], next(iter(a.headers.values()), "?"), a.done_at_s - a.send_at_s))

        out = await real(url, trace, bodies, on_answer=seen, **kw)
        records.append(rows)
        return out

    return run_load


class Runner(ScenarioRunner):
    """The bench's runner without the cost-curve calibration: measured once already, not needed at a given capacity."""

    async def _calibrate(self) -> None:
        return None


def summary(rows: list[Row], ports: dict[int, str]) -> dict[str, Any]:
    """Per worker: share, mean tokens, p50/p99 (all and <= 64 tokens); and which workers the p99 tail came from."""
    names = {f"127.0.0.1:{p}": n for p, n in ports.items()}
    by: dict[str, list[tuple[int, float]]] = {}
    for tok, w, lat in rows:
        by.setdefault(names.get(w, w), []).append((tok, lat))
    lat_all = np.array([r[2] for r in rows])
    p99 = float(np.percentile(lat_all, 99))
    tail = [(names.get(w, w), tok) for tok, w, lat in rows if lat >= p99]
    out: dict[str, Any] = {"n": len(rows), "p99_s": p99, "tail_workers": {}, "workers": {}}
    for n, t in tail:
        out["tail_workers"][n] = out["tail_workers"].get(n, 0) + 1
    for n, xs in sorted(by.items()):
        tok = np.array([x[0] for x in xs]); lat = np.array([x[1] for x in xs])
        short = lat[tok <= 64]
        out["workers"][n] = {"share": len(xs) / len(rows), "n": len(xs), "mean_tokens": float(tok.mean()),
                             "p50_s": float(np.percentile(lat, 50)), "p99_s": float(np.percentile(lat, 99)),
                             "n_short": int(short.size),
                             "short_p50_s": float(np.percentile(short, 50)) if short.size else None,
                             "short_p99_s": float(np.percentile(short, 99)) if short.size else None}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--scenario", default="scenarios/real_workers.toml")
    p.add_argument("--configurations", default="inferlb_ext_proc,nginx_least_conn")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--load", type=float, default=0.8)
    p.add_argument("--capacity", type=float, default=74.1)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    records: list[list[Row]] = []
    loadgen.run_load = recording(records)  # the runner imports run_load at each run: it gets this one
    s = load_scenario(Path(a.scenario))
    s = dataclasses.replace(s, capacity_rps=a.capacity, duration_s=a.duration, warmup_s=a.warmup, loads=(a.load,))
    plans = plan_rounds([ConfigurationPlan(c, (RunSpec(a.load),)) for c in a.configurations.split(",")], a.rounds)
    order = [(p.round, p.configuration) for p in plans]
    runner = Runner(s, a.out.resolve(), plans=plans, progress=False)
    ports = {port: f"w{i}:{w.precision}/{w.threads}t/q{w.cpu_quota:g}"
             for i, (port, w) in enumerate(zip(runner.layout.ports, s.fleet.workers))}
    outcome = run_on_uvloop(runner.run())
    rows = []
    for (rnd, c), res, rec in zip(order, outcome.results, records):
        rows.append({"round": rnd, "configuration": c, "p50_s": res.p50_s, "p99_s": res.p99_s,
                     "goodput_rps": res.goodput_rps, "completed": res.completed, "timeouts": res.timeouts,
                     "host_cpu": res.extra.get("host_cpu") if hasattr(res, "extra") else None,
                     **summary(rec, ports)})
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "rounds.json").write_text(json.dumps({"capacity_rps": a.capacity, "load": a.load,
                                                   "duration_s": a.duration, "rounds": rows}, indent=1))
    for r in rows:
        ws = "  ".join(f"{n}: {w['share']:.0%} p50 {w['p50_s']*1e3:.0f} p99 {w['p99_s']*1e3:.0f} "
                       f"short p99 {(w['short_p99_s'] or 0)*1e3:.0f}" for n, w in r["workers"].items())
        print(f"r{r['round']} {r['configuration']:<20} p50 {r['p50_s']*1e3:6.1f} p99 {r['p99_s']*1e3:6.1f} "
              f"good {r['goodput_rps']:.1f} tail {r['tail_workers']} | {ws}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
