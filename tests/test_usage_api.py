"""``GET /v1/usage`` over real HTTP (``python -m control_plane``), from usage stored in its SQLite database.

The rows are written into the data directory's store before the control plane starts (what ingestion
writes: cumulative counters per instance, tenant and minute; tests/test_usage_store.py); the API answers
their differences per tenant and bucket. Filters, granularity, RFC 3339 times with offsets, the admin
token for reads, a 422 naming each bad parameter. Ingestion through the wire: tests/test_usage_wire.py.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from control_plane.store import Store, UsageRow

from .stack import ControlPlane, running_control_plane
from .test_admin_api import Admin, assert_error
from .test_usage_store import counters

pytestmark = [pytest.mark.slow, pytest.mark.servers]

HOUR = 3600
DAY = 24 * HOUR


def _base(now: float) -> int:
    """Three hours before ``now``, on the hour (within the report's default 24 h), moved earlier when the two
    hours of rows after it would cross midnight UTC: the by-the-day report expects them in one day."""
    base = (int(now) // HOUR - 3) * HOUR
    return min(base, base // DAY * DAY + DAY - 3 * HOUR)


BASE = _base(time.time())
ZERO = {"requests": 0, "tokens": 0, "errors": 0, "sheds": 0, "rate_limited": 0, "unauthenticated": 0}


def at(seconds: int) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def rows() -> list[UsageRow]:
    def row(instance: str, tenant: str, minute: int, **values: int) -> UsageRow:
        return UsageRow(instance, tenant, BASE + minute * 60, counters(**values))
    return [
        row("ext-proc-a@1.00", "acme", 0, requests_served=5, tokens_served=50),
        row("ext-proc-a@1.00", "acme", 1, requests_served=8, tokens_served=80),
        row("ext-proc-a@1.00", "acme", 65, requests_served=10, tokens_served=100, requests_failed=1, tokens_failed=9),
        row("ext-proc-b@1.00", "acme", 65, requests_served=1, tokens_served=7),
        row("ext-proc-a@1.00", "beta", 3, requests_shed=2, tokens_shed=20, requests_rate_limited=1),
        row("ext-proc-a@1.00", "anonymous", 3, requests_unauthenticated=3),
    ]


def seeded(data: Path) -> Path:
    """A data directory whose store holds :func:`rows`."""
    store = Store.open(data)
    try:
        asyncio.run(store.record_usage(rows()))
    finally:
        store.close()
    return data


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    base = tmp_path_factory.mktemp("usage-api")
    with running_control_plane(base, endpoints=[], data_dir=seeded(base / "data")) as cp:
        yield cp


@pytest.fixture()
def admin(control_plane: ControlPlane) -> Admin:
    return Admin(control_plane)


def usage(admin: Admin, **params: str) -> dict:
    return admin.ok("GET", "/v1/usage", params=params)


def test_default_is_the_last_day_by_the_hour_for_every_tenant(admin: Admin) -> None:
    report = usage(admin)
    assert report["granularity"] == "hour" and report["tenant"] is None
    span = dt.datetime.fromisoformat(report["to"]) - dt.datetime.fromisoformat(report["from"])
    assert dt.timedelta(hours=24) <= span < dt.timedelta(hours=24, minutes=1)  # from: its minute's start
    tenants = {t["tenant"]: t for t in report["tenants"]}
    assert list(tenants) == ["acme", "anonymous", "beta"]  # by name
    acme = tenants["acme"]
    assert acme["buckets"] == [
        {**ZERO, "start": at(BASE), "requests": 8, "tokens": 80},
        {**ZERO, "start": at(BASE + HOUR), "requests": 2 + 1 + 1, "tokens": 20 + 7, "errors": 1},
    ]
    assert acme["totals"] == {**ZERO, "requests": 12, "tokens": 107, "errors": 1}
    assert tenants["beta"]["totals"] == {**ZERO, "requests": 3, "sheds": 2, "rate_limited": 1}
    assert tenants["anonymous"]["totals"] == {**ZERO, "requests": 3, "unauthenticated": 3}


def test_one_tenant_by_the_minute_between_times_with_offsets(admin: Admin) -> None:
    plus_two = dt.timezone(dt.timedelta(hours=2))
    start = dt.datetime.fromtimestamp(BASE + 30, plus_two).isoformat()  # counts from the start of its minute
    report = usage(admin, tenant="acme", granularity="minute", to=at(BASE + 2 * 60), **{"from": start})
    assert report["from"] == at(BASE) and report["to"] == at(BASE + 120) and report["tenant"] == "acme"
    assert [t["tenant"] for t in report["tenants"]] == ["acme"]
    assert [(b["start"], b["requests"], b["tokens"]) for b in report["tenants"][0]["buckets"]] == [
        (at(BASE), 5, 50), (at(BASE + 60), 3, 30)]
    # from after the first row: the difference is taken from the row before the window
    later = usage(admin, tenant="acme", granularity="minute", to=at(BASE + HOUR), **{"from": at(BASE + 60)})
    assert later["tenants"][0]["totals"]["requests"] == 3
    assert usage(admin, tenant="nobody")["tenants"] == []


def test_the_rows_start_on_the_hour_at_least_three_hours_ago_and_within_one_day() -> None:
    for now in (dt.datetime(2026, 11, 29, h, 30, tzinfo=dt.timezone.utc).timestamp() for h in range(24)):
        base = _base(now)
        assert base % HOUR == 0 and now - 24 * HOUR < base <= now - 3 * HOUR
        assert base // DAY == (base + 2 * HOUR) // DAY


def test_by_the_day(admin: Admin) -> None:
    report = usage(admin, granularity="day", to=at(BASE + 2 * HOUR), **{"from": at(BASE)})
    acme = next(t for t in report["tenants"] if t["tenant"] == "acme")
    day = BASE // 86400 * 86400
    assert [(b["start"], b["requests"]) for b in acme["buckets"]] == [(at(day), 12)]


def test_usage_needs_the_token_for_reads(admin: Admin) -> None:
    for token in (None, "wrong-token"):
        assert_error(admin.call("GET", "/v1/usage", token=token), 401, "unauthorized")


@pytest.mark.parametrize(("params", "param"), [
    ({"from": "2026-11-25T10:00:00Z", "to": "2026-11-25T09:00:00Z"}, "from"),
    ({"from": "2026-11-25T10:00:00Z", "to": "2026-11-25T10:00:00Z"}, "from"),
    ({"from": "yesterday"}, "from"),
    ({"to": "2026-11-25T10:00:00"}, "to"),  # no offset
    ({"to": "2026-13-25T10:00:00Z"}, "to"),
    ({"granularity": "week"}, "granularity"),
    ({"granularity": "minute", "from": "2020-01-01T00:00:00Z"}, "granularity"),  # too many buckets
    ({"tenant": "Acme"}, "tenant"),
    ({"tenant": "acme\n"}, "tenant"),
    ({"from": "x" * 65}, "from"),
])
def test_a_bad_parameter_is_a_422_naming_it(admin: Admin, params: dict, param: str) -> None:
    error = assert_error(admin.call("GET", "/v1/usage", params=params), 422, "validation_error")
    assert [d["loc"] for d in error["detail"]] == [["query", param]], error


def test_usage_survives_a_restart(tmp_path: Path) -> None:
    data = seeded(tmp_path / "data")
    answers = []
    for _ in range(2):
        with running_control_plane(tmp_path, endpoints=[], data_dir=data) as cp:
            answers.append(usage(Admin(cp), to=at(BASE + 2 * HOUR), **{"from": at(BASE)}))
    assert answers[0] == answers[1] and answers[0]["tenants"]
