"""Coalesce bursts of state changes into one push.

Telemetry changes every scrape and operators click fast; pushing each change
would flood every Envoy. A change is published ``delay`` after the last one
in a burst (trailing edge), but never later than ``max_delay`` after the
first, so a steady stream of changes still goes out at least once a second.

A flush that fails is supervised (``inferlb_runtime.supervision``): logged
with its traceback, counted (``task_failed(task)``, "publisher" for the
controller's) and retried with backoff until one succeeds; marks that
arrive meanwhile are folded into the retry (the flush publishes the latest
state). :attr:`Debouncer.publishing` says whether flushing is failing now,
for ``/readyz``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from inferlb_runtime.backoff import Backoff
from inferlb_runtime.supervision import FailureObserver, Supervised

log = logging.getLogger("inferlb.control_plane")

class Debouncer:
    def __init__(self, flush: Callable[[], Awaitable[None]], *, delay: float = 0.1, max_delay: float = 1.0,
                 task: str = "publisher", observer: FailureObserver | None = None,
                 backoff: Backoff | None = None) -> None:
        self._flush = flush
        self.delay = delay
        self.max_delay = max_delay
        self._first: float | None = None
        self._last = 0.0
        self._pending = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.publishing = Supervised(task, backoff=backoff or Backoff(initial_s=0.1, max_s=5.0), observer=observer,
                                     logger=log)

    def mark(self) -> None:
        """Note a change; the flush follows within ``delay`` .. ``max_delay``."""
        now = time.monotonic()
        if self._first is None:
            self._first = now
        self._last = now
        self._pending.set()

    def deadline(self) -> float | None:
        if self._first is None:
            return None
        return min(self._last + self.delay, self._first + self.max_delay)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="debouncer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await self._pending.wait()
            while (deadline := self.deadline()) is not None and (remaining := deadline - time.monotonic()) > 0:
                await asyncio.sleep(remaining)  # a timer, re-armed by marks that arrive meanwhile
            self._first = None
            self._pending.clear()
            await self.publishing.run(self._flush)
