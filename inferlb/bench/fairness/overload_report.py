"""What ``inferlb bench overload`` reports: each run's headline figures (live and simulated alike), the
issue's targets judged on them, and the tables."""

from __future__ import annotations

from typing import Any

from ..report.table import ms

SHED_P99_TARGET_S = 0.005
GOODPUT_TARGET = 0.95


def run_figures(name: str, source: str, offered_rps: float, capacity_rps: float, slo_s: float,
                classes: dict[str, dict[str, Any]], duration_s: float) -> dict[str, Any]:
    """One run's headline figures from its per-class ones (same keys live and simulated)."""
    goodput = sum(c["goodput_rps"] for c in classes.values())
    critical = classes.get("critical", {})
    sheddable = classes.get("sheddable", {})
    return {
        "run": name, "source": source, "offered_rps": round(offered_rps, 2), "capacity_rps": round(capacity_rps, 2),
        "slo_s": slo_s, "duration_s": duration_s,
        "critical_p99_s": critical.get("p99_s"), "critical_errors": critical.get("errors", 0),
        "standard_p99_s": classes.get("standard", {}).get("p99_s"),
        "shed": sheddable.get("shed", 0), "shed_p99_s": sheddable.get("shed_p99_s"),
        "gateway_429_p99_ms": sheddable.get("gateway_429", {}).get("p99_ms"),
        "goodput_rps": round(goodput, 2), "goodput_of_capacity": round(goodput / capacity_rps, 4),
        "classes": classes,
    }


def sim_classes(extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The simulator's per-class figures with ``errors`` (it has no errors but timeouts)."""
    return {name: {**c, "errors": c["timeouts"]} for name, c in extra["classes"].items()}


def verdicts(run: dict[str, Any]) -> dict[str, bool | None]:
    """Each target met or not (None: nothing to judge; the simulator's 429 time is its constant overheads)."""
    critical = run["critical_p99_s"]
    shed_p99 = run["shed_p99_s"] if run["source"] == "live" else None
    return {
        "critical_within_slo": None if critical is None else critical <= run["slo_s"] and run["critical_errors"] == 0,
        "shed_429_within_5ms": None if shed_p99 is None else shed_p99 <= SHED_P99_TARGET_S,
        # the same at the gateway: Envoy's own time for the 429s, without the generator's lateness
        "gateway_429_within_5ms": None if run.get("gateway_429_p99_ms") is None
        else run["gateway_429_p99_ms"] <= SHED_P99_TARGET_S * 1000,
        "goodput_95pct": run["goodput_of_capacity"] >= GOODPUT_TARGET,
    }


def render(report: dict[str, Any]) -> str:
    lines = [f"# inferlb bench overload: {report['scenario']}", "",
             f"Capacity {report['capacity']['rps']:.1f} req/s ({report['capacity']['source']}); load "
             f"{report['load']:.0%}; classes {report['classes']}; SLO {report['slo_s'] * 1000:.0f} ms; ext_proc "
             f"slo_ms {report['shed_slo_ms']:g} with shedding, 0 for the baseline.", "",
             "| run | source | offered req/s | critical p99 ms | critical errors | standard p99 ms | shed (429) "
             "| 429 p99 ms | goodput/s | goodput / capacity | targets |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for run in report["runs"]:
        v = verdicts(run)
        marks = ", ".join(f"{k} {'met' if ok else 'MISSED'}" for k, ok in v.items() if ok is not None)
        lines.append(f"| {run['run']} | {run['source']} | {run['offered_rps']:.1f} | {ms(run['critical_p99_s'])} "
                     f"| {run['critical_errors']} | {ms(run['standard_p99_s'])} | {run['shed']} "
                     f"| {ms(run['shed_p99_s'])} | {run['goodput_rps']:.1f} | {run['goodput_of_capacity']:.0%} "
                     f"| {marks} |")
    lines += ["", "Per class (served p50/p99; errors: non-2xx other than the sheddable 429s, and timeouts)", "",
              "| run | source | class | sent | served | p50 ms | p99 ms | shed | errors | goodput/s |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for run in report["runs"]:
        for name, c in run["classes"].items():
            lines.append(f"| {run['run']} | {run['source']} | {name} | {c['sent']} | {c['completed']} "
                         f"| {ms(c['p50_s'])} | {ms(c['p99_s'])} | {c['shed']} | {c['errors']} "
                         f"| {c['goodput_rps']:.1f} |")
    for run in report["runs"]:
        sheddable = run["classes"].get("sheddable", {})
        if run["source"] == "live" and sheddable.get("shed"):
            lines.append(f"\n{run['run']}, live: the 429s p50 {ms(sheddable.get('shed_p50_s'))} ms, p99 "
                         f"{ms(sheddable.get('shed_p99_s'))} ms from their scheduled send; the sheddable generator "
                         f"sent p50 {ms(sheddable.get('send_lag_p50_s'))} ms, p99 {ms(sheddable.get('send_lag_p99_s'))}"
                         " ms late")
            gateway = sheddable.get("gateway_429")
            if gateway and gateway["count"]:
                lines.append(f"{run['run']}, live: Envoy's own time for {gateway['count']} 429s (access log, whole ms "
                             f"truncated) p50 {gateway['p50_ms']:.1f} ms, p99 {gateway['p99_ms']:.1f} ms, max "
                             f"{gateway['max_ms']} ms")
            if "shed_at" in sheddable:
                lines.append(f"{run['run']}, live: ext_proc shed them at " + ", ".join(
                    f"{at} {n}" for at, n in sheddable["shed_at"].items()))
    return "\n".join(lines) + "\n"
