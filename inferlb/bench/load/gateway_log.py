"""Envoy's own time for answers, read from its JSON access log (``control_plane/resources/access_log.py``).

Why: a latency the load generator measures includes the generator's own lateness. On two shared cores the
generator sends p99 5-7 ms late before a byte leaves it, so a 5 ms target for the gateway's 429 cannot be
judged from the client alone. Envoy's ``duration_ms`` (``%DURATION%``: from the request's first byte to the
answer's last, whole milliseconds, truncated) is the time the gateway itself took.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

FLUSH_WAIT_S = 20.0  # Envoy flushes access logs every 10 s by default (--file-flush-interval-msec)
POLL_S = 0.25


@dataclass(frozen=True)
class GatewayTimes:
    """Envoy's durations (ms) of the answers with one status, and percentiles of them."""

    status: int
    durations_ms: tuple[int, ...]

    def percentile(self, q: float) -> float | None:
        return float(np.percentile(self.durations_ms, q)) if self.durations_ms else None

    def summary(self) -> dict[str, float | int | None]:
        return {"count": len(self.durations_ms), "p50_ms": self.percentile(50), "p99_ms": self.percentile(99),
                "max_ms": max(self.durations_ms, default=None)}


def answer_times(lines: Iterable[str], status: int, since: datetime) -> GatewayTimes:
    """The ``duration_ms`` of each access-log line with ``status`` whose request started at or after ``since``
    (timezone-aware). Lines that are not access-log JSON (Envoy's own log) are skipped."""
    found = []
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
            if int(entry["status"]) != status or datetime.fromisoformat(entry["ts"]) < since:
                continue
            found.append(int(entry["duration_ms"]))
        except (ValueError, KeyError, TypeError):
            continue
    return GatewayTimes(status, tuple(found))


def log_size(path: Path) -> int:
    """Where a run's lines will start in ``path`` (0 if it does not exist yet)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _read_from(path: Path, offset: int) -> list[str]:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace").splitlines()


async def wait_for_answers(path: Path, offset: int, status: int, since: datetime, expected: int,
                           timeout_s: float = FLUSH_WAIT_S) -> GatewayTimes:
    """``answer_times`` of the lines written to ``path`` after ``offset``, once at least ``expected`` are there
    (Envoy flushes its log on a timer) or ``timeout_s`` passed: then what is there."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = await asyncio.to_thread(_read_from, path, offset)
        times = answer_times(lines, status, since)
        if len(times.durations_ms) >= expected or time.monotonic() > deadline:
            return times
        await asyncio.sleep(POLL_S)
