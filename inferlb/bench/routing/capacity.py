"""The fleet's capacity: the offered load (req/s) at which p99 crosses the SLO.

The issue defines 100% load as that point, measured under inferlb with
ext_proc. The search starts from the theoretical capacity (every worker busy
all the time on the mix's mean request), steps up or down by a factor until
one probe meets the SLO and one misses it, then bisects that bracket. Each
probe is a short open-loop run; the pure functions here decide where to probe
next and read the answer off the probes, so they are tested without a fleet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..load.scenario import Scenario

# A probe misses the SLO when its p99 is above it, or when more than this share of its
# requests failed or timed out (their latency is unknown, so p99 of the rest would flatter it).
MAX_FAILED_SHARE = 0.01
STEP_UP = 1.25
STEP_DOWN = 0.75
FLOOR = 0.1  # of the theoretical capacity: below it the scenario cannot be met at all
CEILING = 2.0
RESOLUTION = 0.05  # stop once the bracket is this narrow (relative)


@dataclass(frozen=True)
class Probe:
    rps: float
    p99_s: float
    sent: int
    failed: int  # errors + timeouts

    def meets(self, slo_s: float) -> bool:
        return self.p99_s <= slo_s and self.failed <= MAX_FAILED_SHARE * max(self.sent, 1)


def mean_tokens(scenario: Scenario) -> float:
    """Mean tokens per input of the scenario's mix (uniform within each bucket)."""
    return sum(b.share * (b.min_tokens + b.max_tokens) / 2 for b in scenario.workload.mix)


def theoretical_capacity_rps(scenario: Scenario) -> float:
    """Requests/s the fleet completes when every slot is always busy with mean-sized requests."""
    fleet = scenario.fleet
    tokens = mean_tokens(scenario) * scenario.workload.inputs_per_request
    cost = (fleet.fixed_s + fleet.per_token_s * tokens) * fleet.cost_scale
    return sum(w.slots * w.speed for w in fleet.workers) / cost


def bracket(probes: Sequence[Probe], slo_s: float) -> tuple[Probe | None, Probe | None]:
    """(the fastest probe that met the SLO below every miss, the slowest probe that missed)."""
    misses = [p for p in probes if not p.meets(slo_s)]
    high = min(misses, key=lambda p: p.rps) if misses else None
    oks = [p for p in probes if p.meets(slo_s) and (high is None or p.rps < high.rps)]
    low = max(oks, key=lambda p: p.rps) if oks else None
    return low, high


def next_probe_rps(probes: Sequence[Probe], theoretical_rps: float, slo_s: float) -> float | None:
    """Where to probe next, or None when the answer is good enough (or cannot be bracketed)."""
    if not probes:
        return theoretical_rps
    low, high = bracket(probes, slo_s)
    if low is None:
        assert high is not None
        nxt = high.rps * STEP_DOWN
        return nxt if nxt >= FLOOR * theoretical_rps else None
    if high is None:
        nxt = low.rps * STEP_UP
        return nxt if nxt <= CEILING * theoretical_rps else None
    if (high.rps - low.rps) / high.rps <= RESOLUTION:
        return None
    return (low.rps + high.rps) / 2


def capacity_from_probes(probes: Sequence[Probe], theoretical_rps: float, slo_s: float) -> float:
    """The load where p99 crosses the SLO: interpolated linearly between the bracketing probes.

    Unbracketed: the best probe that met it (the ceiling was never missed), or the lowest
    probe's rate when none met it (the SLO cannot be met; a loud note goes with that result).
    """
    if not probes:
        return theoretical_rps
    low, high = bracket(probes, slo_s)
    if low is None:
        return min(p.rps for p in probes)
    if high is None:
        return low.rps
    if high.p99_s <= low.p99_s or high.p99_s <= slo_s:  # missed on failures, not on p99: no slope to use
        return low.rps
    share = (slo_s - low.p99_s) / (high.p99_s - low.p99_s)
    return low.rps + max(0.0, min(1.0, share)) * (high.rps - low.rps)
