"""Faults under open-loop load, the short form of ``inferlb bench faults`` (issue 20): the real stack (Envoy, the
control plane, ext_proc, simulated workers), one fresh stack and one fault per test, bounded in requests
(baseline, tail) and time (``max_run_s``). Every step of the harness waits on a condition with a deadline;
every process is stopped by its ``ProcessGroup`` even when a test fails. No timing thresholds: the tests
assert what clients got and that the stack reacted and came back.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from inferlb.bench.reliability.faults_live import FaultRunner
from inferlb.bench.reliability.faults_plan import FaultPlan
from inferlb.bench.reliability.faults_stores import PIN_WHEN_BACK

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy]

PLAN = FaultPlan(load=0.7, baseline=40, tail=40, max_run_s=60.0, react_timeout_s=20.0)


def run_fault(tmp_path: Path, name: str) -> dict[str, Any]:
    lines: list[str] = []
    row = asyncio.run(FaultRunner(PLAN, tmp_path, lines.append).run_fault(name))
    assert row["sent"] == row["succeeded"] + row["failed"], row
    assert row["back_s"] is not None, f"{name}: routing never came back: {row}\n" + "\n".join(lines)
    return row


def test_kill_9_a_worker_is_retried_elsewhere_and_it_returns(tmp_path: Path) -> None:
    row = run_fault(tmp_path, "worker_kill")
    assert row["reacted_s"] is not None  # it left Envoy's healthy set
    assert row["failed"] == 0, row  # in-flight and refused requests were retried on other workers
    assert row["spread"].get(row["target"], 0) > 0  # restarted, it served again


def test_sigstop_then_sigcont_a_worker_loses_no_request(tmp_path: Path) -> None:
    row = run_fault(tmp_path, "worker_stop")
    assert row["reacted_s"] is not None  # health checks timed out: it left Envoy's healthy set
    assert row["failed"] == 0, row  # its in-flight requests finished after SIGCONT


def test_killed_ext_proc_fails_open_then_routes_again(tmp_path: Path) -> None:
    row = run_fault(tmp_path, "ext_proc_kill")
    assert row["reacted_s"] is not None  # a request was served without ext_proc's pick
    assert row["failed"] == 0, row


def test_killed_control_plane_leaves_serving_untouched_and_clients_resync(tmp_path: Path) -> None:
    row = run_fault(tmp_path, "control_plane_kill")
    assert row["reacted_s"] is not None  # the baseline's count served again without it
    assert row["failed"] == 0, row  # back_s: Envoy and ext_proc ACKed the restarted one's config


def test_restarted_envoy_is_configured_from_xds_alone(tmp_path: Path) -> None:
    row = run_fault(tmp_path, "envoy_restart")
    # Nothing listened while it was down: those connections failed, but no request got an HTTP error.
    assert set(row["statuses"]) == {"200"}, row
    assert set(row["error_kinds"]) <= {"ClientConnectorError", "ServerDisconnectedError", "ClientOSError"}, row


def test_a_worker_answering_500_fast_is_ejected_and_clients_see_no_error(tmp_path: Path) -> None:
    row = run_fault(tmp_path, "worker_500")
    assert row["reacted_s"] is not None  # outlier detection ejected it
    assert row["failed"] == 0, row  # its 500s were retried on other workers
    assert row["retried"] > 0


def test_a_delayed_worker_gets_less_traffic(tmp_path: Path) -> None:
    row = run_fault(tmp_path, "worker_delay")  # a delaying TCP proxy in front of it (500 ms on what it is sent)
    assert row["failed"] == 0, row
    # While delayed (150 requests answered) its share is under a fair one: its requests stay in flight longer,
    # so ext_proc's outstanding work there is higher.
    assert row["target_share_while_held"] < 1 / PLAN.workers, row
    assert row["spread"].get(row["target"], 0) > 0  # delay removed, it serves again (back_s)


@pytest.mark.redis
def test_redis_down_fails_quotas_open_and_breaks_nothing_else(tmp_path: Path) -> None:
    row = run_fault(tmp_path, "redis_down")
    assert row["reacted_s"] is not None, row  # quota checks failed open
    assert row["failed"] == 0, row  # admitted without their quota; cache lookups in Redis missed
    # ext_proc picked a worker for every answer its memory cache did not give (routing is untouched), but
    # for those Envoy served without it after its message timeout (a stalled host, not Redis: its calls are
    # bounded by 50 ms; Envoy counts them)
    unpicked = row["statuses_while_held"]["200"] - row["picked_while_held"] - row["cache_hits_while_held"]
    assert row["picked_while_held"] > 0 and 0 <= unpicked <= row["ext_proc_timeouts"], row
    assert row["ext_proc_while_held"].get("cache:redis:miss", 0) > 0, row  # the shared cache level missed


@pytest.mark.redis
def test_redis_down_fails_quotas_closed_when_so_configured(tmp_path: Path) -> None:
    row = run_fault(tmp_path, "redis_down_closed")
    assert row["reacted_s"] is not None, row
    assert set(row["statuses"]) <= {"200", "503"} and row["statuses"].get("503", 0) > 0, row  # refused, clearly
    assert row["ext_proc_while_held"].get("quota:failed_closed", 0) > 0, row
    # Once Redis answered again, no call failed on a stale pooled connection (fixed in quota_redis), so no
    # request was refused; unless a check was slower than the store's 50 ms timeout (a stalled host), which
    # fails the next half second closed, by design
    after_back = row["store_unanswered_after_back"]
    assert "store:error" not in after_back, row
    assert row["failed_after_back"] == 0 or after_back.get("store:timeout", 0) > 0, row


@pytest.mark.redis
def test_slow_redis_fails_quotas_open_and_breaks_nothing_else(tmp_path: Path) -> None:
    row = run_fault(tmp_path, "redis_slow")  # a delaying proxy in front of Redis, past ext_proc's 50 ms timeout
    assert row["reacted_s"] is not None, row
    assert row["failed"] == 0, row


def test_a_nacked_config_leaves_serving_on_the_last_good_one_and_shows_in_the_admin_api(tmp_path: Path) -> None:
    row = run_fault(tmp_path, "config_nack")  # the control plane made to send Envoy an endpoint it cannot parse
    assert row["reacted_s"] is not None, row  # GET /v1/xds/clients: Envoy's EDS nack_count
    assert "malformed IP address" in (row["last_nack"] or ""), row  # Envoy's own words
    assert row["in_sync_while_held"] is False and row["envoy_update_rejected"] >= 1, row
    assert row["failed"] == 0, row  # served on the last good config; back_s: the good one ACKed


@pytest.mark.postgres
def test_postgres_down_under_two_replicas_refuses_mutations_clearly_and_they_converge_after(tmp_path: Path) -> None:
    row = run_fault(tmp_path, "postgres_down")  # two control-plane replicas on a throwaway PostgreSQL, shut down
    assert row["failed"] == 0, row  # serving never needs the store
    assert row["reacted_s"] is not None, row  # each replica refused a pin
    down = row["mutations_while_down"]
    assert {m["replica"] for m in down} == {"a", "b"}, down
    # every mutation while it was down: 503 store_unavailable in the admin API's error shape (no 500, no hang)
    assert all(m["status"] == 503 and m["code"] == "store_unavailable" and m["error_shape"] for m in down), down
    assert row["pinned_while_down"] == {"a": None, "b": None}, row  # and nothing changed
    # back_s: a pin through replica B, once PostgreSQL answered again, shown by replica A and applied by its Envoy
    assert row["pinned_after"] == {"a": PIN_WHEN_BACK, "b": PIN_WHEN_BACK}, row
