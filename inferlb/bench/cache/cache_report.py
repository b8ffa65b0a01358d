"""``inferlb bench cache``'s plan and figures: what runs, and the pure functions that judge it.

Issue 16's targets: at a 30% repeat rate the fleet's throughput at the SLO is at least 1.4x what it is
without the cache, and a hit answers through Envoy in at most 2 ms at p50. Throughput at the SLO is
read off a load sweep (rates rising geometrically, open loop): the highest rate whose p99 met the SLO
with no error and no timeout, stopping at the first rate that missed (beyond it the fleet is
overloaded and every later rate would only queue longer). Each mode's crossing is then bisected between
those two rates, with longer windows (``refine_steps``): the verdict reads sweep and refinement together.
Kept apart from the live half so the rules are tested without a stack.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

MIB = 1024 * 1024
RATIO_TARGET = 1.4
HIT_P50_TARGET_S = 0.002
MAX_LOADS = 40  # a load loop's bound, whatever the flags say
MAX_REFINE_STEPS = 10
HIT = "hit"


@dataclass(frozen=True)
class CachePlan:
    """What the bench runs; loads are fractions of the simulated fleet's no-cache capacity."""

    repeat_rate: float = 0.3
    repeat_pool: int = 1000
    zipf_s: float = 1.1
    workers: int = 2
    slots: int = 2
    cost_scale: float = 8.0  # the simulated cost curve stretched: the fleet, not the 2-core host, saturates
    load_min: float = 0.8  # below it both modes meet the SLO: rates there decide nothing
    load_max: float = 2.0
    load_step: float = 1.03  # each rate is the one before times this (the ratio's resolution)
    duration_s: float = 15.0  # measured, per rate (p99 of ~1,000-1,500 answers)
    warmup_s: float = 2.0  # sent before it, not measured
    slo_s: float = 0.5
    timeout_s: float = 10.0
    hit_requests: int = 300  # the closed-loop series of one repeated body
    hit_warmup: int = 20
    cache_max_bytes: int = 64 * MIB  # ext_proc's, when on
    seed: int = 1
    # Then each mode's crossing is bisected between its last rate met and its first missed, this many
    # times, each rate measured this long: a sweep's step alone can only say 1.03**k (1.384x or 1.426x
    # around 1.4), and a 15 s window's p99 swings with its trace. 0: the sweep's figures only.
    refine_steps: int = 3
    refine_duration_s: float = 45.0

    def loads(self) -> tuple[float, ...]:
        """The sweep's loads, from ``load_min`` up to ``load_max`` (included, give or take rounding)."""
        out, load = [], self.load_min
        while load <= self.load_max * (1 + 1e-9) and len(out) < MAX_LOADS:
            out.append(round(load, 4))
            load *= self.load_step
        return tuple(out)

    def problems(self) -> list[str]:
        out = []
        if not 0 <= self.repeat_rate <= 1:
            out.append(f"--repeat-rate must be in [0, 1], got {self.repeat_rate:g}")
        if not self.zipf_s > 0:
            out.append(f"--zipf-s must be > 0, got {self.zipf_s:g}")
        for name in ("repeat_pool", "workers", "slots", "hit_requests"):
            if getattr(self, name) < 1:
                out.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.load_min <= self.load_max:
            out.append(f"--load-min must be > 0 and <= --load-max, got {self.load_min:g} and {self.load_max:g}")
        if not self.load_step > 1:
            out.append(f"--load-step must be > 1, got {self.load_step:g}")
        if not 0 <= self.refine_steps <= MAX_REFINE_STEPS:
            out.append(f"--refine-steps must be in [0, {MAX_REFINE_STEPS}], got {self.refine_steps}")
        for name in ("duration_s", "refine_duration_s", "slo_s", "timeout_s", "cost_scale"):
            if not getattr(self, name) > 0:
                out.append(f"--{name.removesuffix('_s').replace('_', '-')} must be > 0, got {getattr(self, name):g}")
        if self.warmup_s < 0 or self.hit_warmup < 0:
            out.append("warm-ups must be >= 0")
        if self.cache_max_bytes < 1:
            out.append(f"--cache-max-bytes must be >= 1 (the cache is on in one mode), got {self.cache_max_bytes}")
        return out


QUICK = {"duration_s": 4.0, "warmup_s": 1.0, "load_step": 1.15, "hit_requests": 100, "refine_steps": 0}


def cache_counts(metrics_text: str) -> dict[str, float]:
    """ext_proc's ``inferlb_ext_proc_cache_requests_total`` by result, summed over levels."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == "inferlb_ext_proc_cache_requests_total":
                out[s.labels.get("result", "?")] = out.get(s.labels.get("result", "?"), 0.0) + s.value
    return out


def hit_ratio(before: Mapping[str, float], after: Mapping[str, float]) -> float | None:
    """Hits over hits and misses between two ``cache_counts`` (None: no lookup, e.g. the cache off)."""
    hits = after.get(HIT, 0.0) - before.get(HIT, 0.0)
    misses = after.get("miss", 0.0) - before.get("miss", 0.0)
    return round(hits / (hits + misses), 4) if hits + misses > 0 else None


def meets(point: Mapping[str, Any], slo_s: float) -> bool:
    """A rate met the SLO: answers came, p99 within it, no error and no timeout."""
    return point["completed"] > 0 and point["p99_s"] <= slo_s and point["errors"] == 0 and point["timeouts"] == 0


def throughput_at_slo(points: Sequence[Mapping[str, Any]], slo_s: float) -> float:
    """The highest offered rate (req/s) that met the SLO before the first that did not; 0 if none did."""
    best = 0.0
    for point in sorted(points, key=lambda p: p["rps"]):
        if not meets(point, slo_s):
            break
        best = point["rps"]
    return best


def slo_crossing(points: Sequence[Mapping[str, Any]], slo_s: float) -> float:
    """Where p99 crosses the SLO, interpolated linearly between the last rate met and the first missed
    (finer than the sweep's step); the last rate met when that miss was an error, not the p99."""
    ordered = sorted(points, key=lambda p: p["rps"])
    best = throughput_at_slo(ordered, slo_s)
    below = [p for p in ordered if p["rps"] == best]
    above = [p for p in ordered if p["rps"] > best]
    if not below or not above or above[0]["errors"] or above[0]["timeouts"] or not above[0]["completed"]:
        return best
    lo, hi = below[0], above[0]
    if hi["p99_s"] <= lo["p99_s"]:
        return best
    return lo["rps"] + (hi["rps"] - lo["rps"]) * (slo_s - lo["p99_s"]) / (hi["p99_s"] - lo["p99_s"])


def bracket(points: Sequence[Mapping[str, Any]], slo_s: float) -> tuple[float, float] | None:
    """(the last rate met, the first rate missed after it) in req/s: where the crossing lies, to bisect;
    None when no rate was met or none missed."""
    best = throughput_at_slo(points, slo_s)
    above = sorted(p["rps"] for p in points if p["rps"] > best)
    return (best, above[0]) if best > 0 and above else None


def midpoint(low_rps: float, high_rps: float) -> float:
    """The next rate to measure between two: their geometric mean (the sweep's rates are geometric too)."""
    return math.sqrt(low_rps * high_rps)


def repeat_work_share(tokens: np.ndarray, repeat_of: np.ndarray, fixed_s: float, per_token_s: float) -> float:
    """The repeats' share of the cost model's work: what an exact-match cache can take off the workers at
    most (its throughput ceiling is ``1 / (1 - share)``, before the hits' own cost)."""
    cost = fixed_s + per_token_s * np.asarray(tokens, dtype=np.float64)
    total = float(cost.sum())
    return round(float(cost[np.asarray(repeat_of) >= 0].sum()) / total, 4) if total > 0 else 0.0


def latency_figures(latencies_s: Sequence[float], caches: Sequence[str | None]) -> dict[str, Any]:
    """The closed-loop series: how many answers said hit, and the hits' latency percentiles."""
    hits = np.array([t for t, c in zip(latencies_s, caches) if c == HIT], dtype=np.float64)
    out: dict[str, Any] = {"requests": len(latencies_s), "hits": int(hits.size)}
    for name, values in (("hit", hits), ("all", np.asarray(latencies_s, dtype=np.float64))):
        if values.size:
            out[f"{name}_p50_ms"] = round(float(np.percentile(values, 50)) * 1e3, 3)
            out[f"{name}_p99_ms"] = round(float(np.percentile(values, 99)) * 1e3, 3)
    return out


def with_refinement(sweep: Sequence[Mapping[str, Any]],
                    refine: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The points a mode is judged by: its refinement's (long windows), and the sweep's below them (a short
    window's p99 at or above the refinement's lowest rate is superseded, not counted against it)."""
    if not refine:
        return list(sweep)
    lowest = min(p["rps"] for p in refine)
    return [*(p for p in sweep if p["rps"] < lowest), *refine]


def verdicts(off_points: Sequence[Mapping[str, Any]], on_points: Sequence[Mapping[str, Any]],
             hits: Mapping[str, Any], slo_s: float) -> dict[str, Any]:
    """The two targets, each with its figures and met / not met (a target without figures is not met; the
    ratio is judged unrounded)."""
    off, on = throughput_at_slo(off_points, slo_s), throughput_at_slo(on_points, slo_s)
    ratio = on / off if off > 0 else None
    off_x, on_x = slo_crossing(off_points, slo_s), slo_crossing(on_points, slo_s)
    p50_ms = hits.get("hit_p50_ms")
    return {"throughput_off_rps": round(off, 2), "throughput_on_rps": round(on, 2),
            "ratio": round(ratio, 4) if ratio is not None else None,
            "crossing_off_rps": round(off_x, 2), "crossing_on_rps": round(on_x, 2),
            "crossing_ratio": round(on_x / off_x, 4) if off_x > 0 else None,
            "ratio_target": RATIO_TARGET, "ratio_met": ratio is not None and ratio >= RATIO_TARGET,
            "hit_p50_ms": p50_ms, "hit_p50_target_ms": HIT_P50_TARGET_S * 1e3,
            "hit_met": p50_ms is not None and hits.get("hits", 0) > 0 and p50_ms <= HIT_P50_TARGET_S * 1e3}


def render(report: Mapping[str, Any]) -> str:
    """The table printed at the end."""
    v, plan = report["verdicts"], report["plan"]
    lines = [f"cache bench: {plan['repeat_rate']:.0%} repeats (Zipf s={plan['zipf_s']:g} over {plan['repeat_pool']} "
             f"texts), {plan['workers']} simulated workers, no-cache capacity {report['capacity_rps']:.1f} req/s "
             f"(the cost model's), SLO p99 <= {plan['slo_s'] * 1e3:.0f} ms",
             f"  {'load':>6} {'req/s':>7} | {'off p99 ms':>10} {'err':>4} | {'on p99 ms':>10} {'err':>4} {'hits':>6}"]
    refined = [p for mode in ("off", "on") for p in report[mode].get("refine", [])]
    # a row per (load, refined): a refinement rate may repeat a sweep rate, in its longer window
    off, on = ({(p["load"], r): p for r, key in ((False, "sweep"), (True, "refine")) for p in report[mode].get(key, [])}
               for mode in ("off", "on"))

    def cells(p: Mapping[str, Any] | None, hits: bool) -> str:
        if p is None:
            return f"{'-':>10} {'-':>4}" + (f" {'-':>6}" if hits else "")
        out = f"{p['p99_s'] * 1e3:>10.1f} {p['errors'] + p['timeouts']:>4}"
        if hits:
            out += f" {p['hit_ratio']:>6.1%}" if p.get("hit_ratio") is not None else f" {'-':>6}"
        return out

    for row in sorted(set(on) | set(off)):
        load, is_refined = row
        rps = (on.get(row) or off[row])["rps"]
        mark = "*" if is_refined else " "
        lines.append(f"  {load:>6.3f}{mark}{rps:>7.1f} | {cells(off.get(row), False)} | {cells(on.get(row), True)}")
    if refined:
        lines.append(f"  * the refinement's rates (each mode's crossing bisected), {refined[0]['measured_s']:g} s each")
    ratio = f"{v['ratio']:.3f}x" if v["ratio"] is not None else "n/a"
    shares = [p["repeat_work_share"] for p in report["on"]["sweep"] if p.get("repeat_work_share") is not None]
    if shares:
        share = sum(shares) / len(shares)
        lines.append(f"  the repeats carry {share:.1%} of the work (the cost model's), so an exact-match cache's "
                     f"ceiling is {1 / (1 - share):.2f}x")
    lines.append(f"  throughput at the SLO: off {v['throughput_off_rps']:.1f} req/s, on {v['throughput_on_rps']:.1f} "
                 f"req/s = {ratio} (target >= {v['ratio_target']:g}x): {'met' if v['ratio_met'] else 'NOT MET'}")
    if v.get("crossing_ratio") is not None:
        lines.append(f"  p99 crosses the SLO (interpolated): off {v['crossing_off_rps']:.1f} req/s, on "
                     f"{v['crossing_on_rps']:.1f} req/s = {v['crossing_ratio']:.3f}x")
    h = report["on"]["hit_series"]
    p50 = f"{v['hit_p50_ms']:.2f} ms" if v["hit_p50_ms"] is not None else "n/a (no hit)"
    base = report["off"]["hit_series"].get("all_p50_ms")
    lines.append(f"  a hit through Envoy: p50 {p50} over {h['hits']} hits of {h['requests']} requests"
                 + (f" (cache off, the same body: p50 {base:.2f} ms)" if base is not None else "")
                 + f" (target <= {v['hit_p50_target_ms']:g} ms): {'met' if v['hit_met'] else 'NOT MET'}")
    return "\n".join(lines)
