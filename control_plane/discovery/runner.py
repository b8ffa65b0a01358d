"""Run one provider: apply its snapshots to the controller, count and log its failures.

Logging is per state change (in sync -> failing, one error -> another, failing
-> in sync), not per round: a resolver that fails for an hour logs once.
"""

from __future__ import annotations

import logging
import time
from typing import AsyncIterator, Callable, Protocol

from .model import DiscoveryFailure, DiscoverySnapshot, DiscoverySource, DiscoveryUpdate

log = logging.getLogger("inferlb.control_plane.discovery")


class Provider(Protocol):
    source: DiscoverySource

    def updates(self) -> AsyncIterator[DiscoveryUpdate]: ...


class DiscoveryObserver(Protocol):
    """Where the control plane's metrics learn about discovery rounds."""

    def discovery_synced(self, source: str, endpoints: int, at: float) -> None: ...

    def discovery_failed(self, source: str) -> None: ...


async def run_provider(provider: Provider, apply: Callable[[DiscoverySnapshot], object],
                       observer: DiscoveryObserver | None = None) -> None:
    """Until cancelled: every snapshot goes to ``apply``; a failure applies only its ``partial``."""
    status: str | None = None  # "ok", or the last error logged
    async for update in provider.updates():
        if isinstance(update, DiscoveryFailure):
            if update.partial is not None:
                apply(update.partial)
            if observer is not None:
                observer.discovery_failed(update.source)
            if status != update.error:
                log.warning("discovery failing: keeping the last known endpoints",
                            extra={"source": update.source, "error": update.error})
                status = update.error
            continue
        apply(update)
        if observer is not None:
            observer.discovery_synced(update.source, len(update.endpoints), time.time())
        if status != "ok":
            log.info("discovery in sync", extra={"source": update.source, "endpoints": len(update.endpoints)})
            status = "ok"
