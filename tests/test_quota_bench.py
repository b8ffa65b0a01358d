"""inferlb bench quota: a tiny run against the suite's Redis and one with its own throwaway redis-server,
and bad arguments refused with why."""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

import psutil
import pytest

from inferlb.bench.quota.quota_bench import Row, render

if TYPE_CHECKING:
    from .redis_server import RedisServer

pytest_plugins = ("tests.redis_server",)  # the redis_server and redis_url fixtures

ROWS = ("key lookup (sha256 + dict)", "quota acquire + release, in process", "key lookup + quota, in process",
        "key lookup + quota, Redis: per-minute limits (1 round trip)",
        "key lookup + quota, Redis: with tokens in flight (2 round trips)")


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inferlb.cli", "bench", "quota", *args], capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.subprocess
def test_a_tiny_run_against_a_given_redis(redis_url: str, tmp_path) -> None:
    result = bench("--calls", "200", "--redis-calls", "50", "--keys", "20", "--redis-url", redis_url,
                   "--json", str(tmp_path / "quota.json"))
    assert result.returncode == 0, result.stderr
    for row in ROWS:
        assert f"| {row} |" in result.stdout
    assert "key lookup + quota check in process:" in result.stdout
    assert (tmp_path / "quota.json").read_text().count('"cpu_us"') == len(ROWS)


@pytest.mark.subprocess
def test_a_run_with_its_own_redis_leaves_nothing_running(redis_server: RedisServer) -> None:
    """(redis_server: only so the test is skipped, with why, where redis-server is not installed.)"""
    before = {p.pid for p in psutil.process_iter() if p.name() == "redis-server"}
    result = bench("--calls", "100", "--redis-calls", "20", "--keys", "5")
    assert result.returncode == 0, result.stderr
    assert "Redis: per-minute limits" in result.stdout
    after = {p.pid for p in psutil.process_iter() if p.name() == "redis-server"}
    assert after <= before


@pytest.mark.subprocess
@pytest.mark.parametrize("args", [("--calls", "0"), ("--keys", "-1"), ("--redis-calls", "0")])
def test_bad_arguments_exit_saying_why(args: tuple[str, ...]) -> None:
    result = bench(*args, "--no-redis")
    assert result.returncode != 0 and "must be > 0" in result.stderr


def test_the_verdict() -> None:
    rows = [Row("key lookup + quota, in process", 12.5)]
    assert "12.5 µs of CPU per request (target <= 100 µs: met)" in render(rows)
    assert "MISSED" in render([Row("key lookup + quota, in process", 100.1)])
