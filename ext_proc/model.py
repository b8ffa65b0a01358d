"""ext_proc's domain values: what it knows of each endpoint, what a request
looks like to a pick policy, and what a pick policy returns.

All frozen: a policy gets a consistent picture and cannot change it, and a
policy can be unit-tested with no servers at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence


@dataclass(frozen=True)
class EndpointInfo:
    """One endpoint of the ``workers`` cluster as the control plane's EDS describes it.

    ``telemetry`` holds the figures the control plane attaches as metadata
    (namespace ``inferlb``: cpu_utilization, latency_per_token_s, queue_depth,
    inflight, rps, error_rate, batch_cost_per_token_s, batch_cost_fixed_s, ...).
    """

    id: str  # host:port
    address: str
    port: int
    weight: int = 100
    healthy: bool = True  # EDS health HEALTHY or UNKNOWN
    draining: bool = False
    telemetry: Mapping[str, float] = field(default_factory=dict)

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining


@dataclass(frozen=True)
class RequestView:
    """What a policy may know of a request."""

    tokens: int  # counted with the model's tokenizer, or estimated from bytes
    estimated: bool  # True when ``tokens`` is a byte-based estimate
    model: str | None
    inputs: int  # number of inputs (texts or token arrays)
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Candidate:
    """A routable endpoint with ext_proc's predictions for this request."""

    endpoint: EndpointInfo
    predicted_cost_s: float  # this request's predicted service time on the endpoint
    outstanding_s: float  # predicted work already there: our in-flight + the worker's reported queue
    outstanding_requests: int  # requests this ext_proc has in flight there
    outstanding_tokens: int  # tokens this ext_proc has in flight there

    @property
    def id(self) -> str:
        return self.endpoint.id

    @property
    def predicted_completion_s(self) -> float:
        return self.outstanding_s + self.predicted_cost_s


class PickPolicy(Protocol):
    """Ranks candidates for one request; the first is the pick, the next one or two are retry fallbacks.

    Implementations must be fast (called per request), must only return ids
    of the candidates given, and must not block. They may keep internal state
    (a round-robin cursor, a random generator).
    """

    name: str

    def rank(self, request: RequestView, candidates: Sequence[Candidate]) -> Sequence[str]: ...
