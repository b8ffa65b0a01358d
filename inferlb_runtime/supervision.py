"""Supervised steps: no background task dies silently.

A task that lets one exception escape is gone for good, and nothing says so
until someone notices that what it did has stopped (the control plane's
debounced publisher once stopped publishing on one error while ``/readyz``
still said ready). :class:`Supervised` runs a step until it succeeds: each
failure is logged with its traceback, counted through an observer (a
Prometheus counter), and retried after a jittered exponential backoff. While
the step keeps failing, :attr:`Supervised.failing` and
:attr:`Supervised.last_error` say so, for a readiness probe.

Cancellation is not a failure: ``CancelledError`` goes straight through.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol, TypeVar

from .backoff import Backoff

T = TypeVar("T")

_log = logging.getLogger("inferlb_runtime.supervision")


class FailureObserver(Protocol):
    def task_failed(self, task: str) -> None: ...


class Supervised:
    """One named kind of step (``task`` labels the log lines and the metric), retried until it succeeds.

    An instance keeps the health of the steps it runs (one at a time): ``failing``
    from a failure until the next success.
    """

    def __init__(self, task: str, *, backoff: Backoff | None = None, observer: FailureObserver | None = None,
                 logger: logging.Logger | None = None) -> None:
        self.task = task
        self.backoff = backoff or Backoff(initial_s=0.1, max_s=5.0)
        self.observer = observer
        self.log = logger or _log
        self.failing = False
        self.consecutive_failures = 0
        self.last_error: str | None = None

    async def run(self, step: Callable[[], Awaitable[T]], context: Mapping[str, object] | None = None) -> T:
        """``await step()`` until it returns; ``context`` goes into every log line (e.g. the endpoint)."""
        while True:
            try:
                result = await step()
            except Exception as exc:  # noqa: BLE001 - that is the point: log, count, retry
                delay = self._failed(exc, context)
                await asyncio.sleep(delay)
                continue
            self._succeeded(context)
            return result

    def _failed(self, exc: Exception, context: Mapping[str, object] | None) -> float:
        self.failing = True
        self.consecutive_failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        delay = self.backoff.delay(self.consecutive_failures)
        if self.observer is not None:
            self.observer.task_failed(self.task)
        self.log.error("background task failed; retrying", exc_info=exc, extra={
            **(context or {}), "task": self.task, "error": self.last_error,
            "consecutive_failures": self.consecutive_failures, "retry_in_s": round(delay, 3)})
        return delay

    def _succeeded(self, context: Mapping[str, object] | None) -> None:
        if self.failing:
            self.log.info("background task recovered", extra={
                **(context or {}), "task": self.task, "after_failures": self.consecutive_failures})
        self.failing = False
        self.consecutive_failures = 0
        self.last_error = None
