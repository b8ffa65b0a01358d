"""What ``inferlb sim`` prints: the bench's comparison table plus a spread summary per run (and, with a
class mix, each class's figures); and the summary it writes with ``--summary``.

The table itself is the bench's (``inferlb.bench.report.table``), so simulated and
live figures read alike; the spread says how the requests were shared out,
which is where the balancers differ most on a heterogeneous fleet.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from inferlb.bench.report.results import RunResult
from inferlb.bench.load.scenario import Scenario
from inferlb.bench.report.table import ms, render_markdown

from .oracles import is_oracle

VS_ORACLE = "vs_best_oracle"  # the key in a RunResult's extra


def _ratio(value: float | None, bound: float | None) -> float | None:
    return value / bound if value is not None and bound else None


def against_oracles(results: Sequence[RunResult]) -> list[RunResult]:
    """``results`` with, for every non-oracle run that has an oracle run at the same (run, load),
    ``extra["vs_best_oracle"]``: its p99 over the lowest oracle p99 and its goodput over the highest oracle
    goodput (each from whichever oracle is better at it), and those bounds."""
    best: dict[tuple[str, float], dict[str, object]] = {}
    for r in results:
        if not is_oracle(r.configuration):
            continue
        b = best.setdefault((r.run, r.load), {})
        if r.p99_s and (b.get("p99_s") is None or r.p99_s < b["p99_s"]):  # type: ignore[operator]
            b["p99_s"], b["p99_oracle"] = r.p99_s, r.configuration
        if b.get("goodput_rps") is None or r.goodput_rps > b["goodput_rps"]:  # type: ignore[operator]
            b["goodput_rps"], b["goodput_oracle"] = r.goodput_rps, r.configuration
    out = []
    for r in results:
        b = best.get((r.run, r.load))
        if b is None or is_oracle(r.configuration):
            out.append(r)
            continue
        vs = {"p99_ratio": _ratio(r.p99_s, b.get("p99_s")),  # type: ignore[arg-type]
              "goodput_ratio": _ratio(r.goodput_rps, b.get("goodput_rps")), **b}  # type: ignore[arg-type]
        out.append(replace(r, extra={**r.extra, VS_ORACLE: vs}))
    return out


def _x(ratio: float | None) -> str:
    return f"{ratio:.2f}x" if ratio is not None else "-"


def oracle_table(results: Sequence[RunResult]) -> list[str]:
    """Each configuration against the better oracle at its load (runs with ``against_oracles``' figures only)."""
    rows = [r for r in results if VS_ORACLE in r.extra]
    if not rows:
        return []
    lines = ["", "## Against the ideal (the better of oracle_clairvoyant and oracle_central_queue per figure)", "",
             "| configuration | run | load | p99 ms | best oracle p99 ms | p99 / best oracle | goodput/s "
             "| best oracle goodput/s | goodput / best oracle |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r.run != "steady", r.load)):
        vs = r.extra[VS_ORACLE]
        lines.append(f"| {r.configuration} | {r.run} | {r.load:.0%} | {ms(r.p99_s)} | {ms(vs.get('p99_s'))} "
                     f"| {_x(vs['p99_ratio'])} | {r.goodput_rps:.1f} | {vs['goodput_rps']:.1f} "
                     f"| {_x(vs['goodput_ratio'])} |")
    return lines


def spread_summary(result: RunResult, scenario: Scenario) -> str:
    """Per-worker completions (up to 8 workers), else completions per worker by speed class."""
    counts = [int(result.spread.get(str(i), 0)) for i in range(len(scenario.fleet.workers))]
    if len(counts) <= 8:
        return " ".join(str(c) for c in counts)
    by_speed: dict[float, list[int]] = {}
    for w, c in zip(scenario.fleet.workers, counts):
        by_speed.setdefault(w.speed, []).append(c)
    parts = [f"speed {speed:g}: {statistics.fmean(cs):.0f}/worker" for speed, cs in sorted(by_speed.items())]
    return ", ".join(parts) + f" (min {min(counts)}, max {max(counts)})"


def spread_by_group(result: RunResult, scenario: Scenario) -> dict[str, dict[str, float]]:
    """Completed requests per worker for each kind of worker ("speed 0.5, 2 slots"): mean, min, max."""
    kinds: dict[str, list[int]] = {}
    for i, w in enumerate(scenario.fleet.workers):
        kinds.setdefault(f"speed {w.speed:g}, {w.slots} slot{'s' if w.slots > 1 else ''}", []).append(
            int(result.spread.get(str(i), 0)))
    return {k: {"workers": len(cs), "mean": round(statistics.fmean(cs), 1), "min": min(cs), "max": max(cs)}
            for k, cs in kinds.items()}


SUMMARY_FIELDS = ("configuration", "run", "load", "offered_rps", "sent", "completed", "errors", "timeouts",
                  "p50_s", "p90_s", "p99_s", "p999_s", "mean_s", "goodput_rps")


def summary(results: Sequence[RunResult], scenario: Scenario, capacity_rps: float) -> dict[str, Any]:
    """Per (configuration, run, load): the figures, the ratios to the better oracle when there is one, and the
    spread per kind of worker; no per-request or per-worker data, so a 10,000-worker run stays a few kB in
    git (the full RunResults, CDF and per-worker spread included, are ``--json``'s)."""
    slowdown = scenario.slowdown
    runs = []
    for r in results:
        row: dict[str, Any] = {name: getattr(r, name) for name in SUMMARY_FIELDS}
        row["goodput_of_capacity"] = r.extra.get("goodput_of_capacity")
        row.update({k: v for k, v in r.extra.items()
                    if k in ("ext_proc_replicas", "ext_proc_fallbacks", "ext_proc_shed", "cost_mape", "classes")})
        if VS_ORACLE in r.extra:
            row[VS_ORACLE] = r.extra[VS_ORACLE]
        row["spread"] = spread_by_group(r, scenario)
        runs.append(row)
    return {"scenario": scenario.name, "seed": scenario.seed, "workers": len(scenario.fleet.workers),
            "slots": sum(w.slots for w in scenario.fleet.workers), "capacity_rps": capacity_rps,
            "warmup_s": scenario.warmup_s, "duration_s": scenario.duration_s, "slo_s": scenario.slo_s,
            "ext_proc_replicas": scenario.ext_proc_replicas,
            "slowdown": None if slowdown is None else {"worker": slowdown.worker, "factor": slowdown.factor,
                                                       "at_s": slowdown.at_s, "duration_s": slowdown.duration_s,
                                                       "load": slowdown.load},
            "results": runs}


def class_table(results: Sequence[RunResult]) -> list[str]:
    """Per class (runs with a class mix only): p50/p99 of the served, shed and the shed answers' p99,
    timeouts (the simulator's only other error), goodput; and the run's goodput as a share of capacity."""
    rows = [r for r in results if r.extra.get("classes")]
    if not rows:
        return []
    lines = ["", "## Classes (served p50/p99; shed: ext_proc's 429, never on a worker)", "",
             "| configuration | load | class | sent | p50 ms | p99 ms | shed | shed p99 ms | timeouts | goodput/s "
             "| run goodput / capacity |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        for name, c in r.extra["classes"].items():
            lines.append(f"| {r.configuration} | {r.load:.0%} | {name} | {c['sent']} | {ms(c['p50_s'])} "
                         f"| {ms(c['p99_s'])} | {c['shed']} | {ms(c['shed_p99_s'])} | {c['timeouts']} "
                         f"| {c['goodput_rps']:.1f} | {r.extra['goodput_of_capacity']:.0%} |")
    return lines


def render(results: Sequence[RunResult], scenario: Scenario, capacity_rps: float) -> str:
    text = render_markdown(results, title=f"inferlb sim: {scenario.name}", capacity_rps=capacity_rps,
                           capacity_note="simulated" if not scenario.capacity_rps else "from the scenario")
    lines = ["", "## Spread (completed requests per worker)", "", "| configuration | run | load | spread |",
             "|---|---|---:|---|"]
    for r in sorted(results, key=lambda r: (r.run != "steady", r.load, r.run)):
        lines.append(f"| {r.configuration} | {r.run} | {r.load:.0%} | {spread_summary(r, scenario)} |")
    lines += class_table(results)
    lines += oracle_table(results)
    return text + "\n".join(lines) + "\n"
