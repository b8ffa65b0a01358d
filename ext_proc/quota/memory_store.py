"""The in-process quota store: the default for one ext_proc replica.

Each check runs :func:`ext_proc.quota.algorithm.acquire` on the tenant's state
and stores the new state, with no ``await`` in between, so coroutines that
interleave on the event loop never see half a check and no lock is needed.
Tenants whose counters have all run out are dropped once a window, so idle
tenants leave nothing behind. The clock is monotonic (a wall-clock step
cannot empty or refill a window) and injectable for tests.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from inferlb_runtime.api_keys import Quota

from . import algorithm as algorithm
from . import ADMITTED, Lease, NoQuotaObserver, QuotaObserver, QuotaOutcome, decision_result

DEFAULT_LEASE_TTL_S = 300.0


def monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class MemoryQuotaStore:
    """Counters in a dict of immutable per-tenant states."""

    def __init__(self, lease_ttl_s: float = DEFAULT_LEASE_TTL_S, observer: QuotaObserver | None = None,
                 clock_ms: Callable[[], int] = monotonic_ms) -> None:
        self._lease_ttl_ms = round(lease_ttl_s * 1000)
        self._observer = observer or NoQuotaObserver()
        self._clock_ms = clock_ms
        self._tenants: dict[str, algorithm.TenantState] = {}
        self._ids = itertools.count(1)
        self._swept_window = -1

    async def acquire(self, tenant: str, quota: Quota, tokens: int) -> QuotaOutcome:
        if quota.unlimited:
            self._observer.quota_decision("admitted")
            return ADMITTED
        now = self._clock_ms()
        self._sweep(now)
        lease_id = str(next(self._ids))
        state, decision = algorithm.acquire(self._tenants.get(tenant, _EMPTY), quota, tokens, now,
                                            self._lease_ttl_ms, lease_id)
        self._tenants[tenant] = state
        outcome = algorithm.to_outcome(decision, quota, tenant, tokens, lease_id)
        self._observer.quota_decision(decision_result(outcome, "open"))
        return outcome

    async def release(self, lease: Lease, served: bool) -> None:
        state = self._tenants.get(lease.tenant)
        if state is not None:
            self._tenants[lease.tenant] = algorithm.release(state, lease, served, self._clock_ms())

    async def aclose(self) -> None:
        self._tenants.clear()

    def __len__(self) -> int:
        """Tenants with state (for tests: idle ones are dropped)."""
        return len(self._tenants)

    def _sweep(self, now_ms: int) -> None:
        """Once a window, forget the tenants with nothing left to count."""
        window = now_ms // algorithm.WINDOW_MS
        if window == self._swept_window:
            return
        self._swept_window = window
        for tenant in [t for t, s in self._tenants.items() if algorithm.idle(s, now_ms)]:
            del self._tenants[tenant]


_EMPTY = algorithm.TenantState()
