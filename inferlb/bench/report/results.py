"""The figures of one measured run, shared by the live bench and the simulator.

Both write the same record so that a run of ``inferlb bench`` and one of
``inferlb sim`` on the same scenario can be put side by side (the simulator's
validation) and into the same comparison table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class RunResult:
    """One configuration at one load. Latencies are seconds from each request's *scheduled* send time."""

    configuration: str  # a name from scenario.CONFIGURATIONS or "inferlb_pick:<policy>"
    load: float  # fraction of capacity; the slowdown run has its own label in ``run``
    offered_rps: float
    duration_s: float  # the measured window
    sent: int
    completed: int  # 2xx answers
    errors: int  # non-2xx answers and connection errors
    timeouts: int  # no answer within the scenario's request_timeout_s
    p50_s: float
    p90_s: float
    p99_s: float
    p999_s: float
    mean_s: float
    goodput_rps: float  # completions within the SLO per second of the measured window
    slo_s: float
    run: str = "steady"  # "steady" or "slowdown"
    source: str = "live"  # "live" (inferlb bench) or "sim" (inferlb sim)
    spread: Mapping[str, int] = field(default_factory=dict)  # completed requests per worker (host:port or index)
    # CDF points for plots: (latency_s, cumulative fraction), from the HDR histogram
    cdf: tuple[tuple[float, float], ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)
    round: int = 1  # which round of ``inferlb bench run --rounds`` (0: the median over the rounds)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["spread"] = dict(self.spread)
        out["cdf"] = [list(p) for p in self.cdf]
        out["extra"] = dict(self.extra)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "RunResult":
        values = dict(data)
        values["cdf"] = tuple(tuple(p) for p in values.get("cdf", ()))
        return cls(**values)
