"""A canary at a fixed traffic share, as a **filter** of ext_proc's pick chain: each request goes to the
canary worker with probability ``share`` (say 5%), else to the others, where the rest of the chain (the
default: least predicted completion time) picks as usual.

**When to use it.** Rolling out a new model version, runtime or machine type
on one worker and watching its errors and latency before trusting it with
more: a fixed, small share limits the damage of a bad build however fast or
slow it looks, which least-completion-time picking (that sends more traffic
to faster workers) would not. Remove it (``PUT /v1/policy`` back to plain
``least_completion_time``) when the canary is promoted.

**What the share means.** The share of ext_proc's picks, exactly (a
Bernoulli draw per request): unlike weights (``canary_weights.py``, the
control plane's form), it does not bend under load. A request drawn for the
canary is offered the canary alone, so it has no retry fallback on another
worker: its errors reach the client, which is what a canary is for. When
the canary is unknown, drained, unhealthy or the only candidate, nothing is
split. With several ext_proc replicas on a fleet large enough to be
partitioned (32 workers per replica), only the replica whose partition holds
the canary splits, so the fleet-wide share is ``share`` / replicas.

**Use it.** Allow its module in the control plane and in ext_proc
(``--allow-policy-module examples.policies``: nothing is allowed by default), then::

    curl -X PUT -H "Authorization: Bearer $TOKEN" localhost:8080/v1/policy \\
      -d '{"pick": {"name": "least_completion_time", "params": {"filters": [
            {"plugin": "examples.policies.canary:CanaryFilter",
             "params": {"endpoint": "10.0.0.7:8000", "share": 0.05}}]}}}'
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # types only: the control plane may import this module to describe it, never ext_proc
    from ext_proc.model import EndpointView, RequestView


@dataclass(frozen=True)
class CanaryShare:
    """Which worker is the canary and its share (this filter's, and the weight policy's in canary_weights.py)."""

    endpoint: str  # the canary's endpoint id, host:port (required)
    share: float = 0.05  # its fraction of the traffic, in (0, 0.5]

    def __post_init__(self) -> None:
        host, _, port = self.endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"endpoint must be host:port, got {self.endpoint!r}")
        if not 0.0 < self.share <= 0.5:
            raise ValueError(f"share must be in (0, 0.5], got {self.share}")


@dataclass(frozen=True)
class CanaryParams(CanaryShare):
    seed: int | None = None  # random seed (tests); None: random


class CanaryFilter:
    """Filter: the canary worker for ``share`` of the requests, the other workers for the rest."""

    name: ClassVar[str] = "canary"
    kind: ClassVar[str] = "filter"  # for the inferlb.policies entry-point group
    Params: ClassVar[type] = CanaryParams

    def __init__(self, params: CanaryParams) -> None:
        self.params = params
        self._rng = random.Random(params.seed)
        self._seen: Sequence[EndpointView] | None = None
        self._canary: tuple[EndpointView, ...] = ()
        self._others: tuple[EndpointView, ...] = ()

    def filter(self, request: RequestView, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        if endpoints is not self._seen:  # split once per sequence (the chain hands the same until EDS changes)
            self._seen = endpoints
            self._canary = tuple(e for e in endpoints if e.id == self.params.endpoint)
            self._others = tuple(e for e in endpoints if e.id != self.params.endpoint)
        if not self._canary or not self._others:
            return endpoints  # no canary to split off, or nothing else left: no split
        return self._canary if self._rng.random() < self.params.share else self._others
