"""Envoy's own answer times read from its JSON access log (``inferlb.bench.load.gateway_log``): the lines the bench
keeps, the ones it skips, and the wait for Envoy's timed flush."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone
from pathlib import Path

from inferlb.bench.load.gateway_log import answer_times, log_size, wait_for_answers

SINCE = datetime(2026, 11, 26, 18, 0, 0, tzinfo=timezone.utc)


def line(status: int, duration_ms: int, ts: str = "2026-11-26T18:00:01.250Z") -> str:
    return json.dumps({"ts": ts, "component": "envoy", "status": status, "duration_ms": duration_ms})


def test_only_the_status_asked_after_the_start_and_access_log_lines_count() -> None:
    lines = [
        line(429, 1), line(429, 3), line(200, 40), line(503, 2),
        line(429, 90, ts="2026-11-26T17:59:59.999Z"),  # before the measured window: the warm-up
        "[2026-11-26 18:00:02.000][12][warning][config] Envoy's own log line",
        "{not json", json.dumps({"ts": "2026-11-26T18:00:03.000Z", "status": 429}),  # no duration
        line(429, 12),
    ]
    times = answer_times(lines, 429, SINCE)
    assert times.durations_ms == (1, 3, 12)
    assert times.summary() == {"count": 3, "p50_ms": 3.0, "p99_ms": 11.82, "max_ms": 12}
    assert answer_times([], 429, SINCE).summary() == {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}


def test_the_wait_reads_only_the_run_s_lines_and_returns_once_they_are_flushed(tmp_path: Path) -> None:
    log = tmp_path / "envoy.log"
    assert log_size(log) == 0
    log.write_text(line(429, 70) + "\n")  # an earlier run's
    offset = log_size(log)

    async def flush_later() -> None:
        await asyncio.sleep(0)  # the waiter reads first and finds nothing yet
        with open(log, "a") as f:
            f.write(line(429, 2) + "\n" + line(429, 4) + "\n")

    async def main() -> tuple[int, ...]:
        flushing = asyncio.create_task(flush_later())
        times = await wait_for_answers(log, offset, 429, SINCE, expected=2, timeout_s=30)
        await flushing
        return times.durations_ms

    assert asyncio.run(main()) == (2, 4)


def test_the_wait_gives_what_is_there_at_its_deadline(tmp_path: Path) -> None:
    log = tmp_path / "envoy.log"
    log.write_text(line(429, 2) + "\n")
    times = asyncio.run(wait_for_answers(log, 0, 429, SINCE, expected=5, timeout_s=0))
    assert times.durations_ms == (2,)
