"""Alternating rounds (``inferlb bench run --rounds N``): what a comparison's verdict rests on when each
configuration ran more than once.

Why rounds: on a shared host one run per configuration rests on a few dozen requests for its p99, and on
what else the host did that minute. In the real-worker runs of docs/benchmarks.md the same
configuration's p99 varied by up to an order of magnitude between rounds, far more than between
configurations. So the runner can repeat the comparison, each round in a rotated order
(``runner.plan_rounds``), and the verdict is taken from the median over the rounds, here: pure functions
of the ``RunResult``s, which carry their ``round``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from .results import RunResult

MEDIAN_ROUND = 0  # the ``round`` of a result that is the median over rounds, not one run


def rounds_in(results: Sequence[RunResult]) -> int:
    """How many rounds ``results`` hold (1 for a bench run without ``--rounds``)."""
    return max((r.round for r in results), default=1)


def _key(r: RunResult) -> tuple[str, str, float, str]:
    return r.configuration, r.run, round(r.load, 9), r.source


def median_over_rounds(results: Sequence[RunResult]) -> list[RunResult]:
    """One result per configuration, run and load: each latency figure and goodput the median over its
    rounds; the counts and the per-worker spread summed over them (how many requests the figures rest on);
    the CDF the median-p99 round's; ``extra`` the rounds, the p99 range and the median host CPU. In the
    order each first appears."""
    groups: dict[tuple[str, str, float, str], list[RunResult]] = {}
    for r in results:
        groups.setdefault(_key(r), []).append(r)
    out = []
    for rs in groups.values():
        by_p99 = sorted(rs, key=lambda r: r.p99_s)
        middle = by_p99[(len(by_p99) - 1) // 2]  # the lower median: an actual run, for its CDF
        spread: dict[str, int] = {}
        for r in rs:
            for worker, n in r.spread.items():
                spread[worker] = spread.get(worker, 0) + n
        cpus = [r.extra.get("host_cpu") for r in rs if isinstance(r.extra.get("host_cpu"), (int, float))]
        extra = {"rounds": len(rs), "p99_min_s": by_p99[0].p99_s, "p99_max_s": by_p99[-1].p99_s,
                 **({"host_cpu": statistics.median(cpus)} if cpus else {}),
                 **({"worker_speeds": middle.extra["worker_speeds"]} if "worker_speeds" in middle.extra else {})}
        out.append(RunResult(
            configuration=middle.configuration, load=middle.load, offered_rps=middle.offered_rps,
            duration_s=sum(r.duration_s for r in rs), sent=sum(r.sent for r in rs),
            completed=sum(r.completed for r in rs), errors=sum(r.errors for r in rs),
            timeouts=sum(r.timeouts for r in rs),
            p50_s=statistics.median(r.p50_s for r in rs), p90_s=statistics.median(r.p90_s for r in rs),
            p99_s=statistics.median(r.p99_s for r in rs), p999_s=statistics.median(r.p999_s for r in rs),
            mean_s=statistics.median(r.mean_s for r in rs),
            goodput_rps=statistics.median(r.goodput_rps for r in rs), slo_s=middle.slo_s, run=middle.run,
            source=middle.source, spread=spread, cdf=middle.cdf, extra=extra, round=MEDIAN_ROUND))
    return out


def judged(results: Sequence[RunResult]) -> list[RunResult]:
    """What a verdict (targets, plots, the best peer) rests on: the medians over the rounds, or the runs
    themselves when there was one round."""
    return median_over_rounds(results) if rounds_in(results) > 1 else list(results)


def per_round_ratios(results: Sequence[RunResult], subject: str, baseline: str, load: float,
                     run: str = "steady") -> list[float]:
    """``subject``'s p99 over ``baseline``'s in each round both ran at ``load``, in round order: paired in
    time, so the host's drift between rounds cancels out of each ratio."""
    def p99s(configuration: str) -> dict[int, float]:
        return {r.round: r.p99_s for r in results
                if r.configuration == configuration and r.run == run and abs(r.load - load) < 1e-9}

    mine, theirs = p99s(subject), p99s(baseline)
    return [mine[n] / theirs[n] for n in sorted(mine) if n in theirs and theirs[n] > 0]
