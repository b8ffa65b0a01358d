"""The ``slow_start`` filter: a newly routable endpoint takes a share of the requests that ramps up.

Why: a worker that just joined (scaled out, restarted, back from a failed
health check) has an empty queue, so every least-completion-time pick wants it
at once, while its caches and its ONNX session's arenas are cold and its cost
model is still the prior. Envoy's own slow start does not apply to ext_proc's
picks (override_host bypasses the load balancer), so ext_proc ramps it:
during ``window_s`` after ext_proc saw the endpoint routable, each request
leaves it out of the candidates with probability ``1 - share``, the share
growing linearly from ``min_share`` to 1. Left out only if others remain.

The endpoints of ext_proc's first view are not ramped: they were serving
before this ext_proc started. An endpoint that stops being routable and comes
back ramps again (as Envoy's slow start does after a health flap).

The window is ext_proc's own configuration (``slow_start_s``): one instance
per ext_proc, put in every chain the registry builds, so a policy switch
does not restart the ramps. Per request it costs nothing unless an endpoint
is ramping; then a random draw per ramping endpoint and one pass over the pool.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence

from inferlb_runtime.pick_chain import SlowStartParams

from ..model import EndpointView, RequestView
from .catalogue import ModelCatalogue


class SlowStart:
    """Ramps newly routable endpoints' share of the candidates over ``window_s``."""

    name = "slow_start"
    kind = "filter"
    Params = SlowStartParams

    def __init__(self, params: SlowStartParams = SlowStartParams(), clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.params = params
        self._clock = clock
        self._rng = rng or random.Random(params.seed)
        self._since: dict[str, float] | None = None  # endpoint id -> when it turned routable; None: no view yet
        self._ramping: dict[str, float] = {}  # the endpoints still in their window

    def new_view(self, routable: Sequence[EndpointView], catalogue: ModelCatalogue) -> None:
        now = self._clock()
        ids = [e.id for e in routable]
        if self._since is None:  # the first view: serving already
            self._since = dict.fromkeys(ids, -math.inf)
        else:
            since = self._since
            self._since = {i: since.get(i, now) for i in ids}  # those that left forget: they ramp again
        window = self.params.window_s
        self._ramping = {i: t for i, t in self._since.items() if now - t < window}

    def share(self, endpoint_id: str) -> float:
        """The share of requests the endpoint may take now (1 once its window is over)."""
        started = self._since.get(endpoint_id) if self._since is not None else None
        window = self.params.window_s
        if started is None or window <= 0:
            return 1.0
        elapsed = self._clock() - started
        return 1.0 if elapsed >= window else self._ramp(elapsed)

    def _ramp(self, elapsed: float) -> float:
        low = self.params.min_share
        return low + (1.0 - low) * max(0.0, elapsed) / self.params.window_s

    def filter(self, request: RequestView, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        ramping = self._ramping
        if not ramping:
            return endpoints
        now = self._clock()
        window = self.params.window_s
        left_out = set()
        for endpoint_id, started in list(ramping.items()):
            elapsed = now - started
            if elapsed >= window:
                del ramping[endpoint_id]
            elif self._rng.random() >= self._ramp(elapsed):
                left_out.add(endpoint_id)
        if not left_out:
            return endpoints
        kept = [e for e in endpoints if e.id not in left_out]
        return kept if kept and len(kept) < len(endpoints) else endpoints
