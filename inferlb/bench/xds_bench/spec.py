"""One configuration of the xDS bench (mode x change x endpoints x clients), and its fleet of endpoints."""

from __future__ import annotations

from dataclasses import dataclass, replace

from control_plane.model import Endpoint, FleetState, Telemetry

CONV_TARGET_MS = 1000.0  # 10,000 endpoints x 50 clients
SINGLE_TARGET_MS = 50.0  # one weight, Delta, 10 clients
NODE_CLUSTER = "inferlb"
ENVOY_NODE = "bench-envoy"


@dataclass(frozen=True)
class Spec:
    mode: str  # sotw | delta
    change: str  # all | one
    endpoints: int
    clients: int  # xDS clients in all, the Envoy included
    envoy: bool
    rounds: int
    warmup: int
    telemetry: bool
    health_check_interval_s: float
    round_timeout_s: float
    sync_timeout_s: float
    envoy_path: str

    @property
    def fakes(self) -> int:
        return self.clients - (1 if self.envoy else 0)

    @property
    def label(self) -> str:
        who = f"{self.clients} ({'1 envoy' if self.envoy else 'no envoy'})"
        return f"{self.mode:5} change={self.change:3} endpoints={self.endpoints:<6} clients={who}"


def weight_of(index: int, round_no: int, change: str) -> int:
    """Round 0 is the initial state; every later round changes every weight ("all") or one ("one")."""
    if change == "one":
        return 100 + round_no if index == 0 else 1 + (index * 31) % 1000
    return 1 + (index * 31 + round_no * 17) % 1000  # differs from the previous round for every index


def make_endpoints(n: int, telemetry: bool) -> tuple[Endpoint, ...]:
    out = []
    for i in range(n):
        t = None
        if telemetry:
            f = (i % 97) / 97
            t = Telemetry(observed_at=1000.0, cpu_utilization=0.3 + 0.5 * f, latency_mean_s=0.012 + 0.01 * f,
                          latency_p50_s=0.010 + 0.01 * f, latency_p99_s=0.041 + 0.03 * f,
                          latency_per_token_s=0.00021 + 0.0001 * f, queue_wait_mean_s=0.0013 * f,
                          queue_depth=3.0 * f, inflight=1.0 + 4.0 * f, rps=12.5 + 10 * f, tokens_per_s=1500.0 + 900 * f,
                          error_rate=0.001 * f, batch_cost_per_token_s=0.00009 + 0.00001 * f,
                          batch_cost_fixed_s=0.0021 + 0.001 * f)
        out.append(Endpoint(address=f"127.77.{i // 250}.{i % 250 + 1}", port=1, source="static",
                            computed_weight=weight_of(i, 0, "all"), telemetry=t))
    return tuple(out)


def reweigh(state: FleetState, round_no: int, change: str) -> FleetState:
    if change == "one":
        endpoints = list(state.endpoints)
        endpoints[0] = replace(endpoints[0], computed_weight=weight_of(0, round_no, "one"))
        return replace(state, endpoints=tuple(endpoints))
    return replace(state, endpoints=tuple(replace(e, computed_weight=weight_of(i, round_no, "all"))
                                          for i, e in enumerate(state.endpoints)))
