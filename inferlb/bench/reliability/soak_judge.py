"""The soak's verdicts: is a sampled series flat, bounded, or back to zero? Pure functions of the samples.

Why its own module: the judgment is the soak's claim, so it is unit-tested on made-up series (a growing one
must fail) without running a stack for ten minutes.

Growth is a least-squares line through the samples taken after the warm-up (start-up allocations, pools
filling and caches warming are not leaks), reported per 10 minutes with its standard error. A series fails
when its growth is above its tolerance beyond its noise: ``slope - 2 * stderr > tolerance``. A real leak
grows steadily, so its standard error is small and it fails; a series that jitters with the load (open
connections, in-flight work) has a large standard error and is not called a leak on noise alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

PER = 600.0  # growth is reported per 10 minutes
SIGMAS = 2.0  # growth must exceed the tolerance by this many standard errors to fail
MIN_POINTS = 3  # a line through fewer has no standard error

Samples = Sequence[tuple[float, float]]  # (seconds since the load began, value)


@dataclass(frozen=True)
class Trend:
    """A least-squares line through (t, value): its slope per ``PER`` seconds, the slope's standard error."""

    growth: float
    stderr: float
    points: int
    first: float
    last: float
    low: float
    high: float


@dataclass(frozen=True)
class Check:
    """One PASS/FAIL line of the report."""

    check: str  # what kind: "rss", "fds", "errors", ...
    subject: str  # which process or service ("" for the whole run)
    passed: bool
    figure: str  # what was measured, for the table
    tolerance: str  # what was allowed
    trend: Trend | None = None

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"


@dataclass(frozen=True)
class Tolerance:
    """What a growth check allows, in the series' unit per 10 minutes, and why (printed in --help and docs)."""

    per_10_min: float
    unit: str
    why: str


# The default tolerances. RSS: 4 MiB per 10 min is under 200 bytes per request at the soak's ~35 req/s (21,000
# requests in 10 min): one object kept per request would exceed it. Descriptors and connections: 10 per 10 min
# is one kept per ~2,000 requests. Outstanding requests: 2 per 10 min, while the accounting should track the load.
TOLERANCES: Mapping[str, Tolerance] = {
    "rss": Tolerance(4.0, "MiB", "< 200 bytes kept per request at ~35 req/s"),
    "fds": Tolerance(10.0, "fds", "one descriptor kept per ~2,000 requests"),
    "connections": Tolerance(10.0, "connections", "one connection kept per ~2,000 requests"),
    "outstanding": Tolerance(2.0, "requests", "ext_proc's in-flight accounting follows the load, it does not pile up"),
}


def after(samples: Samples, warmup_s: float) -> list[tuple[float, float]]:
    """The samples taken at or after ``warmup_s``."""
    return [(t, v) for t, v in samples if t >= warmup_s]


def fit(samples: Samples) -> Trend:
    """The least-squares line through ``samples`` (at least ``MIN_POINTS``, at two or more distinct times)."""
    if len(samples) < MIN_POINTS:
        raise ValueError(f"a trend needs at least {MIN_POINTS} samples, got {len(samples)}")
    t = np.array([s[0] for s in samples], dtype=np.float64)
    v = np.array([s[1] for s in samples], dtype=np.float64)
    dt = t - t.mean()
    sxx = float(np.dot(dt, dt))
    if sxx <= 0:
        raise ValueError("a trend needs samples at two or more distinct times")
    slope = float(np.dot(dt, v - v.mean())) / sxx
    residuals = v - (v.mean() + slope * dt)
    stderr = math.sqrt(float(np.dot(residuals, residuals)) / (len(v) - 2) / sxx)
    return Trend(growth=slope * PER, stderr=stderr * PER, points=len(v), first=float(v[0]), last=float(v[-1]),
                 low=float(v.min()), high=float(v.max()))


def judge_growth(check: str, subject: str, samples: Samples, warmup_s: float, tolerance: Tolerance,
                 scale: float = 1.0) -> Check:
    """Flat: growth after the warm-up within ``tolerance`` (beyond 2 standard errors); values divided by ``scale``."""
    kept = [(t, v / scale) for t, v in after(samples, warmup_s)]
    allowed = f"<= {tolerance.per_10_min:g} {tolerance.unit}/10 min"
    if len(kept) < MIN_POINTS:
        return Check(check, subject, False, f"only {len(kept)} samples after the warm-up", allowed)
    trend = fit(kept)
    passed = trend.growth - SIGMAS * trend.stderr <= tolerance.per_10_min
    figure = (f"{trend.growth:+.2f} ± {trend.stderr:.2f} {tolerance.unit}/10 min "
              f"({trend.first:.4g} -> {trend.last:.4g})")
    return Check(check, subject, passed, figure, allowed, trend)


def judge_bounded(check: str, subject: str, samples: Samples, warmup_s: float) -> Check:
    """Bounded: never above the highest value seen during the warm-up (a set that flaps is fine, one that grows is not)."""
    before = [v for t, v in samples if t < warmup_s]
    kept = after(samples, warmup_s)
    if not before or not kept:
        return Check(check, subject, False, "no samples both in and after the warm-up", "<= the warm-up's highest")
    ceiling, high = max(before), max(v for _, v in kept)
    return Check(check, subject, high <= ceiling, f"highest {high:g} after the warm-up, {ceiling:g} in it",
                 "<= the warm-up's highest")


def judge_zero(check: str, subject: str, value: float | None, what: str) -> Check:
    """Exactly zero (``None``: it could not be read, which fails)."""
    if value is None:
        return Check(check, subject, False, f"{what}: not read", "0")
    return Check(check, subject, abs(value) < 1e-9, f"{what}: {value:g}", "0")


def downsample(samples: Samples, points: int) -> list[tuple[float, float]]:
    """At most ``points`` samples, evenly spaced in index, the first and the last always kept (for the JSON)."""
    if len(samples) <= points:
        return list(samples)
    step = (len(samples) - 1) / (points - 1)
    return [samples[round(i * step)] for i in range(points)]


def judge_run(series: Callable[[str], Samples], names: Sequence[str], warmup_s: float, *,
              failed: Mapping[str, Any], rest: Mapping[str, float], drained_s: float | None) -> list[Check]:
    """Every check of a soak. ``series(name)`` gives a series sampled during the load (names as
    ``soak_sample`` makes them: ``rss:<process>``, ``series:<service>``, ``outstanding:requests``...);
    ``failed`` the client's counts; ``rest`` the sample at rest after the load, ``drained_s`` how long after
    the load's end it was taken (None: things were still in flight at the deadline)."""
    errors = failed["failed"]
    checks = [Check("errors", "clients", errors == 0,
                    f"{errors} of {failed['sent']} (non-2xx {failed['non_2xx']}, no answer {failed['no_answer']}, "
                    f"timed out {failed['timeouts']})", "0")]
    processes = [n.split(":", 1)[1] for n in names if n.startswith("rss:")]
    for process in processes:
        checks.append(judge_growth("rss", process, series(f"rss:{process}"), warmup_s, TOLERANCES["rss"], 2**20))
        for kind in ("fds", "connections"):
            checks.append(judge_growth(kind, process, series(f"{kind}:{process}"), warmup_s, TOLERANCES[kind]))
    for process in processes:
        checks.append(judge_bounded("series", process, series(f"series:{process}"), warmup_s))
    checks.append(judge_growth("outstanding", "ext_proc", series("outstanding:requests"), warmup_s,
                               TOLERANCES["outstanding"]))
    checks.append(judge_zero("leaked", "ext_proc", rest.get("outstanding:leaked"),
                             "outstanding entries dropped by the age safety net"))
    when = "at the drain deadline" if drained_s is None else f"{drained_s:.1f} s after the load"
    for key in ("requests", "tokens", "seconds", "streams"):
        checks.append(judge_zero("at rest", "ext_proc", rest.get(f"outstanding:{key}"), f"outstanding {key} {when}"))
    inflight = [v for k, v in rest.items() if k.startswith("inflight:")]
    checks.append(judge_zero("at rest", "workers", sum(inflight) if inflight else None, f"in flight {when}"))
    return checks


def summarise(checks: Sequence[Check]) -> list[dict[str, Any]]:
    """The checks as JSON rows."""
    rows = []
    for c in checks:
        row: dict[str, Any] = {"check": c.check, "subject": c.subject, "verdict": c.verdict, "figure": c.figure,
                               "tolerance": c.tolerance}
        if c.trend is not None:
            row["growth_per_10_min"] = round(c.trend.growth, 4)
            row["stderr_per_10_min"] = round(c.trend.stderr, 4)
            row["low"], row["high"] = round(c.trend.low, 4), round(c.trend.high, 4)
        rows.append(row)
    return rows
