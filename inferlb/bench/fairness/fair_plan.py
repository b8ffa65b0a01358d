"""What ``inferlb bench fair`` runs: the two tenants, the scenarios' splits of the offered load, the plan.

Light (no imports beyond the standard library): ``inferlb --help`` and the live half both read it.
"""

from __future__ import annotations

from dataclasses import dataclass

TENANTS = ("light", "heavy")
# Each scenario's split of the offered load between the tenants (light, heavy).
SCENARIOS: dict[str, tuple[float, float]] = {"heavy-under-share": (5 / 6, 1 / 6), "both-over-share": (0.4, 0.6)}
MAX_REQUESTS = 200_000  # per tenant and run: a bound on a typo in --load or --duration


@dataclass(frozen=True)
class FairPlan:
    """What the bench runs; ``capacity_tps`` 0 means the simulated fleet's own cost model."""

    workers: int = 2
    slots: int = 1
    weights: tuple[float, float] = (1.0, 3.0)  # light, heavy
    load: float = 1.5
    duration_s: float = 55.0
    warmup_s: float = 5.0
    timeout_s: float = 15.0
    fair_queue_depth: int = 8
    capacity_tps: float = 0.0
    scenarios: tuple[str, ...] = tuple(SCENARIOS)
    seed: int = 14

    def problems(self) -> list[str]:
        """Why this plan cannot run (empty when it can)."""
        out = []
        if self.workers < 1 or self.slots < 1:
            out.append(f"workers and slots must be >= 1, got {self.workers} and {self.slots}")
        if not all(0 < w <= 1000 for w in self.weights):
            out.append(f"weights must be in (0, 1000] (the admin API's range), got {self.weights}")
        if not 0 < self.load <= 5:
            out.append(f"load is a multiple of capacity in (0, 5], got {self.load}")
        if not (self.duration_s > 0 and self.warmup_s >= 0 and self.timeout_s > 0):
            out.append("duration and timeout must be > 0, warmup >= 0")
        if not 1 <= self.fair_queue_depth <= 10_000:
            out.append(f"depth must be in 1..10000 (the baseline run is 0), got {self.fair_queue_depth}")
        if self.capacity_tps < 0:
            out.append(f"capacity must be >= 0 (0: the fleet's cost model), got {self.capacity_tps}")
        unknown = [s for s in self.scenarios if s not in SCENARIOS]
        if unknown or not self.scenarios:
            out.append(f"scenarios are a comma-separated list of {', '.join(SCENARIOS)}; got {','.join(unknown)}")
        return out
