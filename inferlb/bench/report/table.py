"""The comparison table: every configuration at every load, and the ratios the issue's targets use.

Pure functions of ``RunResult``s (live or simulated alike), rendered as
Markdown; ``table.md`` and the console show the same text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .results import RunResult
from .rounds import judged, per_round_ratios, rounds_in

TARGET_LOAD = 0.8
SUBJECT = "inferlb_ext_proc"  # (f)


@dataclass(frozen=True)
class Ratio:
    """``subject``'s ``metric`` divided by ``baseline``'s, at ``load`` of ``run``; None when either is missing."""

    label: str
    metric: str  # "p99" or "goodput"
    baseline: str
    run: str
    load: float | None
    value: float | None
    better: str  # "lower" or "higher"


def find(results: Sequence[RunResult], configuration: str, *, run: str = "steady",
         load: float | None = TARGET_LOAD) -> RunResult | None:
    for r in results:
        if r.configuration == configuration and r.run == run and (load is None or abs(r.load - load) < 1e-9):
            return r
    return None


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def target_ratios(results: Sequence[RunResult], subject: str = SUBJECT, load: float = TARGET_LOAD) -> list[Ratio]:
    """At ``load``: (f) p99 vs (b) and (a), goodput vs (b), p99 vs (c); in the slowdown run, p99 vs (b) and (c)."""
    wanted = [
        ("p99", "envoy_least_request", "steady"),
        ("p99", "envoy_round_robin", "steady"),
        ("goodput", "envoy_least_request", "steady"),
        ("p99", "envoy_cswrr_orca", "steady"),
        ("p99", "envoy_least_request", "slowdown"),
        ("p99", "envoy_cswrr_orca", "slowdown"),
    ]
    out = []
    for metric, baseline, run in wanted:
        at = load if run == "steady" else None
        mine, theirs = find(results, subject, run=run, load=at), find(results, baseline, run=run, load=at)
        value = None
        if mine is not None and theirs is not None:
            value = (_ratio(mine.p99_s, theirs.p99_s) if metric == "p99"
                     else _ratio(mine.goodput_rps, theirs.goodput_rps))
        where = f"{load:.0%} load" if run == "steady" else "slowdown run"
        out.append(Ratio(f"{subject} {metric} / {baseline} {metric} ({where})", metric, baseline, run, at, value,
                         "lower" if metric == "p99" else "higher"))
    return out


def ms(seconds: float | None) -> str:
    """Seconds as milliseconds for a table cell; "-" for none."""
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _cpu(r: RunResult) -> str:
    cpu = r.extra.get("host_cpu") if r.extra else None
    return f"{cpu:.0%}" if isinstance(cpu, (int, float)) else "-"


def spread_by_speed(r: RunResult) -> str:
    """``speed 1: 380/worker, speed 0.5: 190/worker, ...`` from the spread and ``extra.worker_speeds``."""
    speeds = (r.extra or {}).get("worker_speeds") or {}
    if not r.spread or not speeds:
        return ""
    by_speed: dict[float, list[int]] = {}
    for worker, speed in speeds.items():
        by_speed.setdefault(float(speed), []).append(int(r.spread.get(worker, 0)))
    return ", ".join(f"speed {speed:g}: {sum(n) / len(n):.0f}/worker"
                     for speed, n in sorted(by_speed.items(), reverse=True))


def _in_order(results: Sequence[RunResult]) -> list[RunResult]:
    """Steady runs by load, then the slowdown runs; rounds in order within each."""
    return sorted(results, key=lambda r: (r.run != "steady", r.load, r.run, r.round))


def render_markdown(results: Sequence[RunResult], *, title: str = "inferlb bench", capacity_rps: float | None = None,
                    capacity_note: str = "") -> str:
    """The whole table.md: one row per run (steady runs by load, then the slowdown runs), then the ratios.
    With rounds (``--rounds``): a round column, the medians over the rounds, the ratios of the medians, and
    each round's own ratio."""
    rounds = rounds_in(results)
    verdict = judged(results)  # the runs themselves, or their medians over the rounds
    lines = [f"# {title}", ""]
    if capacity_rps is not None:
        lines += [f"Capacity (100% load): {capacity_rps:.1f} req/s{(' - ' + capacity_note) if capacity_note else ''}",
                  ""]
    slo = results[0].slo_s if results else 0.0
    lines += [
        f"Latency from each request's scheduled send time (open loop); goodput = completions within "
        f"{slo * 1000:.0f} ms per second.",
        "",
        "| configuration | run | load |" + (" round |" if rounds > 1 else "")
        + " offered req/s | p50 ms | p90 ms | p99 ms | p99.9 ms | goodput/s | completed | errors | timeouts | host CPU |",
        "|---|---|---:|" + ("---:|" if rounds > 1 else "") + "---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    judged_rows = _in_order(verdict)
    for r in _in_order(results):
        lines.append(
            f"| {r.configuration} | {r.run} | {r.load:.0%} |" + (f" {r.round} |" if rounds > 1 else "")
            + f" {r.offered_rps:.1f} | {ms(r.p50_s)} | {ms(r.p90_s)} | {ms(r.p99_s)} | {ms(r.p999_s)} "
            f"| {r.goodput_rps:.1f} | {r.completed} | {r.errors} | {r.timeouts} | {_cpu(r)} |")
    if rounds > 1:
        lines += ["", f"## Medians over {rounds} rounds", "",
                  "Each configuration ran once per round, the order rotated each round. The verdicts below are "
                  "taken from these medians.", "",
                  "| configuration | run | load | rounds | p50 ms | p99 ms | p99 ms, lowest - highest round "
                  "| goodput/s | completed (all rounds) | host CPU |", "|---|---|---:|---:|---:|---:|---|---:|---:|---:|"]
        lines += [f"| {r.configuration} | {r.run} | {r.load:.0%} | {r.extra['rounds']} | {ms(r.p50_s)} "
                  f"| {ms(r.p99_s)} | {ms(r.extra['p99_min_s'])} - {ms(r.extra['p99_max_s'])} "
                  f"| {r.goodput_rps:.1f} | {r.completed} | {_cpu(r)} |" for r in judged_rows]
    spread_rows = [(r, spread_by_speed(r)) for r in judged_rows]
    if any(text for _, text in spread_rows):
        lines += ["", "## Spread", "", "Completed requests per worker, by the worker's speed (mean over the workers "
                  "of that speed).", "", "| configuration | run | load | spread |", "|---|---|---:|---|"]
        lines += [f"| {r.configuration} | {r.run} | {r.load:.0%} | {text} |" for r, text in spread_rows if text]
    ratios = target_ratios(verdict)
    if any(x.value is not None for x in ratios):
        lines += ["", "## Targets" + (" (medians over the rounds)" if rounds > 1 else ""), "",
                  "| ratio | value | better |" + (" each round |" if rounds > 1 else ""),
                  "|---|---:|---|" + ("---|" if rounds > 1 else "")]
        for x in ratios:
            if x.value is None:
                continue
            each = ""
            if rounds > 1:
                paired = (per_round_ratios(results, SUBJECT, x.baseline, x.load, x.run)
                          if x.metric == "p99" and x.load is not None else [])
                each = " " + (", ".join(f"{v:.2f}x" for v in paired) or "-") + " |"
            lines.append(f"| {x.label} | {x.value:.2f}x | {x.better} |{each}")
    return "\n".join(lines) + "\n"
