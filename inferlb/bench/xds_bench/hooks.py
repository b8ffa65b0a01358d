"""Server-side hooks: the moment a snapshot becomes current, and the moment every client ACKed its EDS.

One clock, in the control-plane process: no cross-process timing. The cache is
the production ``SnapshotCache``; the metrics hook is the server's XdsMetrics.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Callable

from control_plane.type_urls import ENDPOINT, PUSH_ORDER, SHORT_NAMES
from control_plane.xds import Snapshot, SnapshotCache
from control_plane.xds.clients import NoopMetrics


class BenchCache(SnapshotCache):
    """The production cache; ``on_set`` sees each snapshot just before it becomes current."""

    on_set: Callable[[Snapshot], None] | None = None

    def set_default_snapshot(self, snapshot: Snapshot) -> None:
        if self.on_set is not None:
            self.on_set(snapshot)
        super().set_default_snapshot(snapshot)


class Watcher(NoopMetrics):
    """The server's XdsMetrics hook (the hooks it does not need are NoopMetrics'): stamps the moment every client has ACKed a target EDS version."""

    def __init__(self, cache: SnapshotCache, expected: int) -> None:
        self.cache = cache
        self.expected = expected
        self.changed = asyncio.Event()  # any connect / disconnect / ACK / NACK
        self.done = asyncio.Event()
        self.target: str | None = None
        self.eds_acks = 0
        self.done_at: float | None = None
        self.done_cpu = 0.0
        self.pushes: Counter[str] = Counter()
        self.nacks: Counter[str] = Counter()
        self.disconnects = 0

    def arm(self, version: str) -> None:
        self.target, self.eds_acks, self.done_at = version, 0, None
        self.pushes.clear()
        self.done.clear()

    def converged(self, version: str) -> bool:
        clients = self.cache.clients()
        return len(clients) >= self.expected and all(
            (t := c.types.get(ENDPOINT)) is not None and t.acked_version == version for c in clients)

    def synced(self, snapshot: Snapshot) -> bool:
        clients = self.cache.clients()
        return len(clients) >= self.expected and all(
            (t := c.types.get(u)) is not None and t.acked_version == snapshot.version(u)
            for c in clients for u in PUSH_ORDER)

    # XdsMetrics
    def on_connect(self, mode: str) -> None:
        self.changed.set()

    def on_disconnect(self, mode: str) -> None:
        self.disconnects += 1
        self.changed.set()

    def on_push(self, type_url: str, seconds: float) -> None:
        self.pushes[SHORT_NAMES.get(type_url, type_url)] += 1

    def on_ack(self, type_url: str) -> None:
        self.changed.set()
        if self.target is not None and type_url == ENDPOINT:
            self.eds_acks += 1
            if self.eds_acks >= self.expected and self.converged(self.target):
                self.done_at = time.monotonic()
                self.done_cpu = time.process_time()
                self.target = None
                self.done.set()

    def on_nack(self, type_url: str) -> None:
        self.nacks[SHORT_NAMES.get(type_url, type_url)] += 1
        self.changed.set()
