"""What ``inferlb bench faults`` runs: the faults, the stack and the load, and every run's bounds.

Light (no imports beyond the standard library): the command's parser and the soak read it without loading
the stack."""

from __future__ import annotations

from dataclasses import dataclass

FAULTS = ("worker_kill", "worker_stop", "ext_proc_kill", "control_plane_kill", "envoy_restart", "worker_500",
          "worker_delay", "redis_down", "redis_down_closed", "redis_slow", "config_nack", "postgres_down")
REDIS_FAULTS = ("redis_down", "redis_down_closed", "redis_slow")


@dataclass(frozen=True)
class FaultPlan:
    """The stack, the load and the bounds of every run."""

    faults: tuple[str, ...] = FAULTS
    load: float = 0.7  # of the fleet's capacity (every slot busy on the mix's mean request)
    workers: int = 4
    slots: int = 2
    cost_scale: float = 20.0  # the emulated fleet, not the 2-core host, is the bottleneck
    baseline: int = 150  # requests answered before the fault is injected
    tail: int = 150  # requests sent after routing is back
    max_run_s: float = 90.0  # the trace's length: a run that has not recovered by then is reported so
    react_timeout_s: float = 30.0  # for the stack to react to the fault before it is restored anyway
    request_timeout_s: float = 15.0
    seed: int = 1
    delay_hold: int = 150  # worker_delay: requests answered while delayed (the share it gets is the measure)
    worker_delay_s: float = 0.5  # worker_delay: added to what reaches the worker (under the 1 s health-check timeout)
    redis_delay_s: float = 0.2  # redis_slow: added to what reaches Redis (ext_proc's store timeouts are 50 ms)

    def problems(self) -> list[str]:
        out = [f"unknown fault {f!r}; known: {', '.join(FAULTS)}" for f in self.faults if f not in FAULTS]
        if not 0 < self.load <= 1.5:
            out.append(f"--load must be in (0, 1.5], got {self.load:g}")
        if self.workers < 3:
            out.append(f"--workers must be >= 3 (one faulty, the rest serve), got {self.workers}")
        if self.baseline < 1 or self.tail < 1:
            out.append("--baseline and --tail must be >= 1")
        return out
