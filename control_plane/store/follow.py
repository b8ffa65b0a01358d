"""Apply what other control-plane replicas change in the shared store.

The change feed (``OperatorStore.changes``) only says "look": every change
that is not this replica's own notification makes ``reload`` read the whole
operator state and fold it in (``AdminService.reload_from_store``: the same
``reconcile`` for pins, drains, registrations, deregistrations and policies).
A reload that fails (the store is down) is counted and logged; the state
already applied stays, xDS keeps serving it, and the next change (the
feed's reconnection at the latest) tries again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from .base import OperatorStore, StoreError

log = logging.getLogger("inferlb.control_plane.store")

DEFAULT_RELOAD_INTERVAL_S = 30.0


class FollowObserver(Protocol):
    def store_change(self, reason: str) -> None: ...

    def store_reload(self, ok: bool) -> None: ...


async def follow(store: OperatorStore, reload: Callable[[], Awaitable[bool]],
                 observer: FollowObserver | None = None,
                 reload_interval_s: float = DEFAULT_RELOAD_INTERVAL_S) -> None:
    """Until cancelled: reload on every change made by another replica (``reload`` says if anything changed)."""
    failing = False
    async with contextlib.aclosing(store.changes(reload_interval_s)) as changes:
        async for change in changes:
            own = change.reason == "notified" and change.origin == store.replica_id
            if observer is not None:
                observer.store_change("own" if own else change.reason)
            if own:
                continue  # already applied when it was made
            try:
                changed = await reload()
            except Exception as exc:  # noqa: BLE001 - the store down (StoreError) or a bug: keep following
                if observer is not None:
                    observer.store_reload(False)
                if not failing or not isinstance(exc, StoreError):
                    log.error("reloading the operator state failed: keeping the state applied",
                              extra={"error": str(exc) if isinstance(exc, StoreError) else repr(exc),
                                     "reason": change.reason})
                failing = True
                continue
            if observer is not None:
                observer.store_reload(True)
            if failing:
                log.info("operator state reloaded again", extra={"reason": change.reason})
            failing = False
            if changed:
                log.info("operator state changed by another replica: applied",
                         extra={"reason": change.reason, "origin": change.origin, "revision": change.revision})
