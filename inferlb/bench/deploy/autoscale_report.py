"""What ``inferlb bench autoscale`` makes of a run (pure): per-phase latency and failures, the times to scale
up, to get p99 back under the SLO and to scale back down, from the requests and the pool-size samples."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

P99_WINDOW_S = 5.0  # p99 is judged over the requests sent in windows this long


@dataclass(frozen=True)
class Phase:
    name: str
    start_s: float
    end_s: float
    load: float  # of one worker's capacity


@dataclass(frozen=True)
class Request:
    sent_s: float  # since the run began
    latency_s: float
    ok: bool  # 200; anything else (an error status, a timeout, a reset) is a failure
    outcome: str = "200"  # the status code, or the client's exception


@dataclass(frozen=True)
class Sample:
    at_s: float
    workers: int  # routable endpoints of the pool
    desired: int | None  # the control plane's signal


def p99(latencies: Sequence[float]) -> float | None:
    return float(np.percentile(np.asarray(latencies), 99)) if latencies else None


def phase_figures(phase: Phase, requests: Sequence[Request], rps: float) -> dict[str, object]:
    inside = [r for r in requests if phase.start_s <= r.sent_s < phase.end_s]
    ok = [r.latency_s for r in inside if r.ok]
    return {"phase": phase.name, "load": phase.load, "rps": round(rps, 2), "start_s": phase.start_s,
            "end_s": phase.end_s, "requests": len(inside), "failed": len(inside) - len(ok),
            "p50_s": None if not ok else round(float(np.percentile(ok, 50)), 4),
            "p99_s": None if not ok else round(p99(ok) or 0.0, 4)}


def first_at_or_after(samples: Sequence[Sample], start_s: float, holds: Callable[[Sample], bool]) -> float | None:
    """Seconds from ``start_s`` to the first sample at or after it for which ``holds``; None if none."""
    for s in samples:
        if s.at_s >= start_s and holds(s):
            return round(s.at_s - start_s, 2)
    return None


def p99_recovery_s(requests: Sequence[Request], start_s: float, end_s: float, slo_s: float) -> float | None:
    """Seconds from ``start_s`` until p99 stays under the SLO: the start of the first window after which
    every window of :data:`P99_WINDOW_S` up to ``end_s`` has p99 <= SLO and no failure; None if never."""
    edges = np.arange(start_s, end_s - P99_WINDOW_S / 2, P99_WINDOW_S / 5)
    good = []
    for left in edges:
        inside = [r for r in requests if left <= r.sent_s < min(left + P99_WINDOW_S, end_s)]
        lat = [r.latency_s for r in inside if r.ok]
        good.append(bool(inside) and len(lat) == len(inside) and (p99(lat) or 0.0) <= slo_s)
    recovered = None
    for left, ok in zip(edges, good):
        if ok and recovered is None:
            recovered = float(left)
        elif not ok:
            recovered = None
    return None if recovered is None else round(recovered - start_s, 2)


def summarise(phases: Sequence[Phase], requests: Sequence[Request], samples: Sequence[Sample], slo_s: float,
              rps: Sequence[float], min_workers: int) -> dict[str, object]:
    """The report's figures (see the module docstring)."""
    low, high, after = phases
    peak = max((s.workers for s in samples if high.start_s <= s.at_s < after.start_s), default=None)
    return {
        "phases": [phase_figures(p, requests, r) for p, r in zip(phases, rps)],
        "failed": sum(not r.ok for r in requests),
        "failures": dict(sorted(Counter(r.outcome for r in requests if not r.ok).items())),
        "requests": len(requests),
        "peak_workers": peak,
        "scale_up_first_s": first_at_or_after(samples, high.start_s, lambda s: s.workers > min_workers),
        "scale_up_peak_s": None if peak is None else first_at_or_after(samples, high.start_s,
                                                                         lambda s: s.workers >= peak),
        "p99_back_under_slo_s": p99_recovery_s(requests, high.start_s, high.end_s, slo_s),
        "scale_down_s": first_at_or_after(samples, after.start_s, lambda s: s.workers <= min_workers),
        "pool_size": [[round(s.at_s, 1), s.workers, s.desired] for s in samples],
    }


def table(report: dict[str, object]) -> str:
    """The human-readable summary."""
    def secs(value: object) -> str:
        return "-" if not isinstance(value, (int, float)) else f"{value:.1f} s"

    def ms(value: object) -> str:
        return "-" if not isinstance(value, (int, float)) else f"{value * 1000:.0f} ms"

    lines = [f"{'phase':<8} {'load':>5} {'req/s':>6} {'requests':>8} {'failed':>6} {'p50':>8} {'p99':>8}"]
    phases: list[dict[str, Any]] = report["phases"]  # type: ignore[assignment]
    for p in phases:
        lines.append(f"{p['phase']:<8} {p['load']:>5.0%} {p['rps']:>6.1f} {p['requests']:>8} {p['failed']:>6} "
                     f"{ms(p['p50_s']):>8} {ms(p['p99_s']):>8}")
    lines += [
        f"peak workers {report['peak_workers']}; first worker added after {secs(report['scale_up_first_s'])}, "
        f"peak after {secs(report['scale_up_peak_s'])}",
        f"p99 back under the SLO {secs(report['p99_back_under_slo_s'])} after the step up; "
        f"back to MIN workers {secs(report['scale_down_s'])} after the step down",
        f"failed requests: {report['failed']} of {report['requests']} {report['failures'] or ''}".rstrip(),
    ]
    return "\n".join(lines)
