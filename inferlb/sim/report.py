"""What ``inferlb sim`` prints: the bench's comparison table plus a spread summary per run (and, with a
class mix, each class's figures).

The table itself is the bench's (``inferlb.bench.table``), so simulated and
live figures read alike; the spread says how the requests were shared out,
which is where the balancers differ most on a heterogeneous fleet.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from inferlb.bench.results import RunResult
from inferlb.bench.scenario import Scenario
from inferlb.bench.table import ms, render_markdown


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
    return text + "\n".join(lines) + "\n"
