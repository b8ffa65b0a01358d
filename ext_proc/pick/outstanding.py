"""What this ext_proc has in flight on each endpoint: requests, tokens and predicted seconds.

Why its own module: every stream must release what it began exactly once,
whether the response came back, the client hung up or the upstream reset.
``finish`` is therefore idempotent and keyed by the caller's request key,
and a safety net drops entries older than ``max_age_s`` (counted in
``leaked``) so that a bug elsewhere skews routing for a bounded time only.

All operations are O(1) amortised: per-endpoint totals are kept
incrementally, and entries sit in insertion (= start time) order, so the
sweep only ever looks at the oldest ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from ..model import SIZE_BOUNDS, size_bucket

Clock = Callable[[], float]


@dataclass(frozen=True)
class OutstandingLoad:
    """In-flight work on one endpoint (or all of them)."""

    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0  # sum of the predicted service seconds of those requests


_IDLE = OutstandingLoad()


class _Entry:
    __slots__ = ("endpoint_id", "tokens", "predicted_s", "started")

    def __init__(self, endpoint_id: str, tokens: int, predicted_s: float, started: float) -> None:
        self.endpoint_id = endpoint_id
        self.tokens = tokens
        self.predicted_s = predicted_s
        self.started = started


class _Totals:
    __slots__ = ("requests", "tokens", "seconds")

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0
        self.seconds = 0.0


class Outstanding:
    """In-flight accounting per endpoint; not thread-safe (one asyncio loop owns it)."""

    def __init__(self, max_age_s: float = 300.0, sweep_interval_s: float = 1.0, clock: Clock = time.monotonic) -> None:
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
        self.max_age_s = max_age_s
        self.sweep_interval_s = sweep_interval_s
        self._clock = clock
        self._entries: dict[Hashable, _Entry] = {}
        self._totals: dict[str, _Totals] = {}
        self._next_sweep = clock() + sweep_interval_s
        self.leaked = 0  # entries dropped by the safety net
        self.seconds = 0.0  # the predicted seconds of everything in flight (O(1) for admission's room)
        # The same by request size (tokens, SIZE_BOUNDS): the work a worker serving least-attained-service
        # first runs before a new request is about the work of requests no larger than it.
        self.seconds_by_size = [0.0] * (len(SIZE_BOUNDS) + 1)

    def begin(self, request_key: Hashable, endpoint_id: str, tokens: int, predicted_s: float) -> None:
        """Count a request as in flight on ``endpoint_id``; a key already in flight is moved, not doubled."""
        now = self._clock()
        if now >= self._next_sweep:
            self.sweep(now)
        if request_key in self._entries:
            self._release(request_key)
        tokens = int(tokens) if tokens > 0 else 0
        predicted_s = float(predicted_s) if predicted_s > 0.0 else 0.0
        self._entries[request_key] = _Entry(endpoint_id, tokens, predicted_s, now)
        totals = self._totals.get(endpoint_id)
        if totals is None:
            totals = self._totals[endpoint_id] = _Totals()
        totals.requests += 1
        totals.tokens += tokens
        totals.seconds += predicted_s
        self.seconds += predicted_s
        self.seconds_by_size[size_bucket(tokens)] += predicted_s

    def finish(self, request_key: Hashable) -> bool:
        """Release a request; True the first time, False for an unknown or already finished key."""
        if request_key not in self._entries:
            return False
        self._release(request_key)
        return True

    def of(self, endpoint_id: str) -> OutstandingLoad:
        totals = self._totals.get(endpoint_id)
        if totals is None:
            return _IDLE
        return OutstandingLoad(totals.requests, totals.tokens, totals.seconds)

    def load_of(self, endpoint_id: str) -> "_Totals | OutstandingLoad":
        """The hot-path form of :meth:`of`: the live totals (``requests``, ``tokens``, ``seconds``),
        not a copy. Read them at once; never keep or change them."""
        totals = self._totals.get(endpoint_id)
        return totals if totals is not None else _IDLE

    def requests_of(self, endpoint_id: str) -> int:
        """The hot-path shortcut for ``of(e).requests``."""
        totals = self._totals.get(endpoint_id)
        return totals.requests if totals is not None else 0

    def total(self) -> OutstandingLoad:
        requests = tokens = 0
        seconds = 0.0
        for t in self._totals.values():
            requests += t.requests
            tokens += t.tokens
            seconds += t.seconds
        return OutstandingLoad(requests, tokens, seconds)

    def seconds_up_to(self, tokens: int) -> float:
        """The predicted seconds in flight of requests no larger than ``tokens`` (by SIZE_BOUNDS' buckets)."""
        return sum(self.seconds_by_size[: size_bucket(tokens) + 1])

    def snapshot(self) -> dict[str, OutstandingLoad]:
        """Every endpoint with work in flight (for metrics at scrape time)."""
        return {e: OutstandingLoad(t.requests, t.tokens, t.seconds) for e, t in self._totals.items()}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_key: object) -> bool:
        return request_key in self._entries

    def sweep(self, now: float | None = None) -> int:
        """Drop entries older than ``max_age_s``; returns how many (also added to ``leaked``)."""
        now = self._clock() if now is None else now
        self._next_sweep = now + self.sweep_interval_s
        cutoff = now - self.max_age_s
        dropped = 0
        while self._entries:
            key = next(iter(self._entries))
            if self._entries[key].started > cutoff:
                break
            self._release(key)
            dropped += 1
        self.leaked += dropped
        return dropped

    def _release(self, request_key: Hashable) -> None:
        entry = self._entries.pop(request_key)
        if self._entries:
            self.seconds -= entry.predicted_s
            self.seconds_by_size[size_bucket(entry.tokens)] -= entry.predicted_s
        else:  # none left: no float drift
            self.seconds = 0.0
            self.seconds_by_size = [0.0] * (len(SIZE_BOUNDS) + 1)
        totals = self._totals[entry.endpoint_id]
        totals.requests -= 1
        if totals.requests <= 0:
            del self._totals[entry.endpoint_id]  # also resets float drift to exactly zero
        else:
            totals.tokens -= entry.tokens
            totals.seconds -= entry.predicted_s
