"""The ``failing`` filter: an endpoint whose answers are mostly errors gets only probe requests.

Why: a worker that answers 500 at once looks idle and fast to every least-work
scorer (nothing queued, tiny response times), so it attracts the picks, and
each one costs the client a retry. Envoy's outlier detection ejects it, but
ext_proc's pick reaches it anyway (override_host bypasses the load balancer),
so ext_proc must leave it out itself. The signal is the control plane's
``error_rate`` telemetry (5xx and 429 over requests, per scrape window).

Left out only while others remain. A small share of requests (``probe_share``)
still considers it: the control plane updates ``error_rate`` only from windows
that had requests, so a worker sent nothing could never show it has recovered.
The set of failing endpoints is computed once per view; a request costs one
emptiness test unless some endpoint is failing.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from inferlb_runtime.pick_chain import FailingParams

from ..model import EndpointView, RequestView
from .catalogue import ModelCatalogue


class FailingFilter:
    """Leaves out the endpoints whose ``error_rate`` is over ``max_error_rate``, but for probes."""

    name = "failing"
    kind = "filter"
    Params = FailingParams

    def __init__(self, params: FailingParams = FailingParams(), rng: random.Random | None = None) -> None:
        self.params = params
        self._rng = rng or random.Random(params.seed)
        self._failing: frozenset[str] = frozenset()

    def new_view(self, routable: Sequence[EndpointView], catalogue: ModelCatalogue) -> None:
        limit = self.params.max_error_rate
        self._failing = frozenset(e.id for e in routable if e.telemetry.get("error_rate", 0.0) > limit)

    @property
    def failing(self) -> frozenset[str]:
        return self._failing

    def filter(self, request: RequestView, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        failing = self._failing
        if not failing or self._rng.random() < self.params.probe_share:
            return endpoints
        kept = [e for e in endpoints if e.id not in failing]
        return kept or endpoints
