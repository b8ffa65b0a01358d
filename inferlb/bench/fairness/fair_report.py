"""What ``inferlb bench fair`` reports: the shares each run should give, each tenant's figures, the table.

Pure: no clock, no network. The two expectations a run is read against, both
as fractions of the fleet's capacity:

- ``fair_shares``: weighted max-min fairness (water-filling), what weighted
  fair queuing at admission gives a saturated fleet: a tenant that asks for
  less than its weighted share gets all it asks, the rest is split among the
  others by weight (work-conserving: nothing stays idle while anyone waits);
- ``fifo_shares``: one queue for everyone, served in arrival order: on a
  saturated fleet each tenant gets capacity in proportion to what it offers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..report.table import ms


def fair_shares(weights: Mapping[str, float], offered: Mapping[str, float]) -> dict[str, float]:
    """Each tenant's share of a fleet of capacity 1 under weighted max-min fairness (``offered`` in the same
    unit: fractions of capacity). The shares add up to min(1, total offered)."""
    shares = {name: 0.0 for name in weights}
    wanting = {name for name in weights if offered[name] > 0}
    room = 1.0
    while wanting and room > 1e-12:
        total_weight = sum(weights[n] for n in wanting)
        quota = {n: room * weights[n] / total_weight for n in wanting}
        sated = {n for n in wanting if offered[n] - shares[n] <= quota[n]}
        if not sated:  # everyone left wants more than its slice: split the rest by weight
            for n in wanting:
                shares[n] += quota[n]
            break
        for n in sated:
            room -= offered[n] - shares[n]
            shares[n] = offered[n]
        wanting -= sated
    return shares


def fifo_shares(offered: Mapping[str, float]) -> dict[str, float]:
    """Each tenant's share of a fleet of capacity 1 served in arrival order: all it asks while the fleet keeps
    up, in proportion to what it offers once it does not."""
    total = sum(offered.values())
    scale = 1.0 / total if total > 1.0 else 1.0
    return {name: o * scale for name, o in offered.items()}


def normalised(shares: Mapping[str, float]) -> dict[str, float]:
    """Shares of the served total (what the table compares: the measured fleet may be slower than modelled)."""
    total = sum(shares.values())
    return {name: (s / total if total > 0 else 0.0) for name, s in shares.items()}


def tenant_figures(*, weight: float, offered_tokens: int, served_tokens: float, served_requests: float,
                   window_s: float, capacity_tps: float, load: Mapping[str, Any]) -> dict[str, Any]:
    """One tenant's figures in one run: offered (the trace's exact tokens in the measured window), served
    (ext_proc's count of 2xx tokens finished in that window) and the client's view of its requests (``load``:
    ``live_class_figures`` of its generator)."""
    return {
        "weight": weight,
        "offered_tps": round(offered_tokens / window_s, 1),
        "offered_of_capacity": round(offered_tokens / window_s / capacity_tps, 4),
        "served_tps": round(served_tokens / window_s, 1),
        "served_requests": int(served_requests),
        "sent": load["sent"], "ok": load["completed"], "rejected_429": load["shed"],
        "errors": load["errors"], "timeouts": load["timeouts"],  # errors: non-2xx but 429, and timeouts
        "p50_s": load["p50_s"], "p99_s": load["p99_s"], "statuses": load["statuses"],
    }


def add_shares(tenants: dict[str, dict[str, Any]], fair_queue: bool) -> None:
    """Each tenant's share of the served total, and the share expected of this run's admission (weighted
    fair with the queue, arrival order without) on a fleet whose capacity is what it served in all (the
    host may run it slower or faster than its cost model says)."""
    total = sum(t["served_tps"] for t in tenants.values())
    served = normalised({n: t["served_tps"] for n, t in tenants.items()})
    offered = {n: t["offered_tps"] / total if total > 0 else 0.0 for n, t in tenants.items()}
    expected = (fair_shares({n: t["weight"] for n, t in tenants.items()}, offered) if fair_queue
                else fifo_shares(offered))
    for name, share in normalised(expected).items():
        tenants[name]["served_share"] = round(served[name], 4)
        tenants[name]["expected_share"] = round(share, 4)


def render(report: Mapping[str, Any]) -> str:
    """The markdown table: one row per run and tenant."""
    plan = report["plan"]
    weights = ", ".join(f"{name} {w:g}" for name, w in plan["weights"].items())
    lines = [f"# inferlb bench fair: weights {weights}", "",
             f"{plan['workers']} simulated workers ({plan['slots']} slot(s) each); capacity "
             f"{report['capacity_tps']:.0f} tokens/s ({report['capacity_source']}); offered {plan['load']:.0%} of it; "
             f"{plan['warmup_s']:g} s warm-up + {plan['duration_s']:g} s measured per run. fair queue on: "
             f"ext_proc's fair_queue_depth {plan['fair_queue_depth']}; off: 0 (every request goes straight to "
             "the workers' queues). Served: ext_proc's count of 2xx tokens finished in the measured window; "
             "latency and 429s: the client's, of the requests sent in it.", "",
             "| scenario | fair queue | tenant | weight | offered tok/s | served tok/s | served share | expected "
             "| 429s | errors | p50 ms | p99 ms |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in report["runs"]:
        for name, t in run["tenants"].items():
            lines.append(f"| {run['scenario']} | {'on' if run['fair_queue'] else 'off'} | {name} | {t['weight']:g} "
                         f"| {t['offered_tps']:.0f} ({t['offered_of_capacity']:.0%}) | {t['served_tps']:.0f} "
                         f"| {t['served_share']:.1%} | {t['expected_share']:.1%} | {t['rejected_429']} "
                         f"| {t['errors']} | {ms(t['p50_s'])} "
                         f"| {ms(t['p99_s'])} |")
    lines += ["", "expected: the share of the served total that weighted max-min fairness gives with the fair "
              "queue on, and arrival order (in proportion to offered load) with it off, on a fleet of the "
              "capacity served in all.", ""]
    for run in report["runs"]:
        lines.append(f"- {run['scenario']}, fair queue {'on' if run['fair_queue'] else 'off'}: served "
                     f"{run['served_tps']:.0f} tokens/s in all ({run['served_of_capacity']:.0%} of capacity)")
    for failure in report.get("failures", []):
        lines.append(f"- FAILED: fair queue {failure['mode']}: {failure['error']}")
    return "\n".join(lines) + "\n"
