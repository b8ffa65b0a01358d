"""inferlb bench quota-accuracy, in small: the same code through the real processes (a control plane issuing the
key, two ext_proc replicas sharing the suite's Redis, ten clients playing Envoy's messages over gRPC).

The real run is made certain rather than timed: the quota is fresh (a new tenant) and the load starts where the
whole run fits in one window of Redis's clock, so there is no previous window to weigh and the window's count
is all the algorithm looks at. Three quotas are offered over the run, so requests are refused, and a refusal
means the window then held more than the quota minus that request: the window must end between the quota
minus the largest request and the quota, whatever the machine's speed.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from inferlb.bench.quota.quota_accuracy import Settings, render, run, tally
from inferlb.bench.quota.quota_accuracy_load import WINDOW_MS, LoadRun, Sent, duration_ms, plan_load

pytest_plugins = ("tests.redis_server",)  # the redis_server and redis_url fixtures

QUOTA = 3_000


@pytest.mark.slow
def test_two_replicas_on_one_redis_admit_the_quota_and_never_more(redis_url: str, tmp_path: Path) -> None:
    settings = Settings(tokens_per_minute=QUOTA, load=18.0, seconds=10.0, sentences=(1, 8), redis_url=redis_url,
                        fit_window=True)  # 18 quotas a minute for 10 s: three quotas offered
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    result = asyncio.run(run(settings, lambda line: None, tmp_path))
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children  # everything stopped

    print(render(result))
    assert set(result.outcomes) <= {"admitted", "rate_limited"}, result.outcomes
    first = result.windows[0]
    assert first.refused_requests > 0
    assert QUOTA - result.largest_request_tokens <= first.admitted_tokens <= QUOTA
    assert result.over_quota_windows == []
    # ext_proc's own count is the bodies' exact one, and every admitted request named its window.
    assert result.count_mismatches == 0 and result.without_reset_header == 0
    # The replicas' metrics agree with what the clients saw.
    admitted = sum(r.admitted_tokens for r in result.windows)
    assert sum(f["tenant_tokens"]["served"] for f in result.replicas) == admitted
    assert sum(f["quota_decisions"]["admitted"] for f in result.replicas) == result.outcomes["admitted"]
    assert sum(f["quota_decisions"]["limited"] for f in result.replicas) == result.outcomes["rate_limited"]
    assert all(f["quota_decisions"]["admitted"] > 0 for f in result.replicas)  # both replicas took part
    assert sum(f["quota_store_errors"] for f in result.replicas) == 0


def _sent(sent_ms: float, tokens: int, outcome: str, reset_ms: int | None = None) -> Sent:
    return Sent(0, tokens, sent_ms, sent_ms + 2, outcome, tokens if outcome == "admitted" else None, reset_ms)


def test_admitted_tokens_go_to_the_window_their_check_ran_in() -> None:
    """A stream that straddles a boundary: the reset time (2 windows - elapsed) says which side the check was."""
    boundary = 1_000 * WINDOW_MS
    before = _sent(boundary - 1, 10, "admitted", reset_ms=WINDOW_MS + 1)  # checked 1 ms before the boundary
    after = _sent(boundary - 1, 20, "admitted", reset_ms=2 * WINDOW_MS - 1)  # checked 1 ms after it
    assert (before.decision_window, after.decision_window) == (999, 1000)
    load = LoadRun([before, after], 2, 0, 0, 0.0, boundary - 30_000, boundary + 90_000)
    rows, verdict, over = tally(load, 25, 0.02)
    assert [(r.window, r.full, r.offered_tokens, r.admitted_tokens) for r in rows] == [
        (999, False, 30, 10), (1000, True, 0, 20)]
    assert verdict == "MISSED" and over == []  # 20 of 25 is 80%


def test_the_verdict_judges_full_windows_only_and_never_allows_more_than_the_quota() -> None:
    start = 10 * WINDOW_MS
    sent = [_sent(start + 1_000, 990, "admitted", 2 * WINDOW_MS - 1_000),  # window 10: full, 99%
            _sent(start + WINDOW_MS + 5, 500, "admitted", 2 * WINDOW_MS - 5),  # window 11: partial, 50%
            _sent(start + WINDOW_MS + 9, 700, "rate_limited")]
    rows, verdict, over = tally(LoadRun(sent, 3, 0, 0, 0.0, start, start + WINDOW_MS + 30_000), 1_000, 0.02)
    assert verdict == "met" and [r.full for r in rows] == [True, False] and rows[1].refused_requests == 1
    sent.append(_sent(start + WINDOW_MS + 20, 600, "admitted", 2 * WINDOW_MS - 20))  # the partial one: 110%
    assert tally(LoadRun(sent, 4, 0, 0, 0.0, start, start + WINDOW_MS + 30_000), 1_000, 0.02)[1:] == ("MISSED", [11])
    short = LoadRun(sent[:1], 1, 0, 0, 0.0, start + 1, start + 30_000)
    assert tally(short, 1_000, 0.02)[1].startswith("not judged")


@pytest.mark.parametrize("text, ms", [("0s", 0), ("250ms", 250), ("1s", 1000), ("59.5s", 59_500),
                                      ("1m23.456s", 83_456), ("1h0m0s", 3_600_000)])
def test_openai_reset_durations(text: str, ms: int) -> None:
    assert duration_ms(text) == ms


@pytest.mark.parametrize("text", ["", "soon", "1x", "-1s"])
def test_a_bad_reset_duration_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        duration_ms(text)


def test_the_schedule_offers_the_load_in_exact_tokens() -> None:
    schedules = plan_load(60_000, 3.0, 60.0, 10, (1, 64), (8, 24), seed=7)
    assert len(schedules) == 10
    offered = sum(p.tokens for s in schedules for p in s)
    assert math.isclose(offered, 180_000, rel_tol=0.1)  # 3 quotas in a minute, Poisson and uniform sizes
    assert all(0 <= p.at_s < 60 for s in schedules for p in s)
    assert schedules == plan_load(60_000, 3.0, 60.0, 10, (1, 64), (8, 24), seed=7)  # seeded


@pytest.mark.subprocess
@pytest.mark.parametrize("args, message", [
    (("--minutes", "0"), "--minutes must be > 0"), (("--quota", "0"), "--quota must be >= 1"),
    (("--sentences", "9-3"), "LOW <= HIGH"), (("--sentence-tokens", "2-8"), "more than 2"),
    (("--tolerance", "1"), "--tolerance must be in (0, 1)"), (("--quota", "100000000"), "requests"),
])
def test_bad_arguments_exit_saying_why(args: tuple[str, ...], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "inferlb.cli", "bench", "quota-accuracy", *args,
                             "--redis-url", "redis://127.0.0.1:1/0"], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_help_names_the_target() -> None:
    from inferlb.bench.quota import quota_accuracy

    parser = argparse.ArgumentParser()
    quota_accuracy.add_arguments(parser)
    assert "within 2% of the quota" in quota_accuracy.DESCRIPTION
    assert parser.parse_args([]).minutes == 3
