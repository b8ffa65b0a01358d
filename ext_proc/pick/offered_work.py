"""How fast ext_proc routes work to each endpoint: predicted work seconds per second of wall time.

The ``shed`` plugin needs it to predict a sheddable request's time on workers that serve by class: every
critical or standard request that arrives meanwhile is served first, so the time is not the work there
now, ``B + c``, but the busy period that work starts::

    T = B + c + rho * T   ->   T = (B + c) / (1 - rho)

with ``rho`` the utilisation the higher classes offer that endpoint (a priority queue's busy period).
``rho`` is measured here as an exponentially weighted rate of the predicted seconds routed there (time
constant ``window_s``): ``sum(c_i * exp(-(now - t_i) / window_s)) / window_s``, an unbiased estimate of a
steady rate that follows a change within about one window, kept as one decayed level per endpoint
(O(1) per update and per read, no timers).

Only this ext_proc's own decisions are counted: with several replicas each sees its share of the rate,
so each under-estimates ``rho`` (it admits more than one replica would). A fresh instance (a new ext_proc,
or a policy switch that rebuilds the chain) starts from zero and under-estimates for about one window.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class DecayedRate:
    """One endpoint's rate: ``level`` (work seconds per second) as it stood at ``at``."""

    level: float = 0.0
    at: float = 0.0


class OfferedWork:
    """Per endpoint, the predicted work seconds routed there per second, averaged over ``window_s``."""

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._clock = clock
        self._rates: dict[str, DecayedRate] = {}

    def add(self, endpoint_id: str, seconds: float) -> None:
        """``seconds`` of predicted work were just routed to ``endpoint_id``."""
        now = self._clock()
        rate = self._rates.get(endpoint_id)
        if rate is None:
            self._rates[endpoint_id] = DecayedRate(seconds / self.window_s, now)
            return
        rate.level = rate.level * math.exp((rate.at - now) / self.window_s) + seconds / self.window_s
        rate.at = now

    def rate(self, endpoint_id: str) -> float:
        """The work seconds per second routed to ``endpoint_id`` lately (0 for one never routed to)."""
        rate = self._rates.get(endpoint_id)
        if rate is None:
            return 0.0
        return rate.level * math.exp((rate.at - self._clock()) / self.window_s)

    def keep(self, endpoint_ids: Iterable[str]) -> None:
        """Forget the endpoints not in ``endpoint_ids`` (gone from the view): the ledger stays the fleet's size."""
        ids = set(endpoint_ids)
        for gone in [e for e in self._rates if e not in ids]:
            del self._rates[gone]
