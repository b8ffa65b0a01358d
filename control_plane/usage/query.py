"""``GET /v1/usage``: the query's parameters checked, and the store's buckets as the API's answer.

Times are RFC 3339 with an offset (``2026-11-25T10:00:00Z``); ``from``
counts from the start of its minute, ``to`` is exclusive; by default the
last 24 hours. Buckets are aligned to UTC minutes, hours or days, so the
first may start before ``from``. A bad parameter is a :class:`BadUsageQuery`
naming it (the admin API's 422).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ..api_models import TenantUsage, UsageBucketOut, UsageCounts, UsageReport
from ..store import COUNTER_COLUMNS, OperatorStore, UsageBucket

Granularity = Literal["minute", "hour", "day"]
STEP_S: dict[str, int] = {"minute": 60, "hour": 3600, "day": 86400}
DEFAULT_SPAN = dt.timedelta(days=1)
MAX_BUCKETS = 10_000  # per tenant: a year by the hour, a week by the minute
_INDEX = {column: i for i, column in enumerate(COUNTER_COLUMNS)}


class BadUsageQuery(ValueError):
    """A parameter of the query is wrong; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class UsageQuery:
    tenant: str | None
    start: int  # unix seconds, a whole minute
    end: int  # unix seconds, exclusive
    granularity: Granularity

    @property
    def step(self) -> int:
        return STEP_S[self.granularity]


def parse_time(text: str, param: str) -> dt.datetime:
    """An RFC 3339 time (with its offset), as UTC."""
    try:
        value = dt.datetime.fromisoformat(text)
    except ValueError:
        raise BadUsageQuery(param, f"{param}: {text!r} is not an RFC 3339 time such as 2026-11-25T10:00:00Z") \
            from None
    if value.tzinfo is None:
        raise BadUsageQuery(param, f"{param}: {text!r} has no offset; RFC 3339 needs one (Z for UTC)")
    return value.astimezone(dt.timezone.utc)


def usage_query(tenant: str | None, from_text: str | None, to_text: str | None, granularity: Granularity,
                now: dt.datetime) -> UsageQuery:
    """The checked query (``now``: an aware datetime)."""
    end = parse_time(to_text, "to") if to_text is not None else now
    start = parse_time(from_text, "from") if from_text is not None else end - DEFAULT_SPAN
    if start >= end:
        raise BadUsageQuery("from", f"from ({start.isoformat()}) must be before to ({end.isoformat()})")
    start_s, end_s = int(start.timestamp() // 60) * 60, int(end.timestamp())
    buckets = (end_s - 1) // STEP_S[granularity] - start_s // STEP_S[granularity] + 1
    if buckets > MAX_BUCKETS:
        raise BadUsageQuery("granularity", f"from..to spans {buckets} {granularity}s; at most {MAX_BUCKETS} "
                                           "buckets: a coarser granularity or a shorter span")
    return UsageQuery(tenant, start_s, end_s, granularity)


def _counts(increases: Sequence[int]) -> UsageCounts:
    of = lambda column: increases[_INDEX[column]]  # noqa: E731
    return UsageCounts(
        requests=sum(of(f"requests_{o}") for o in ("served", "failed", "rate_limited", "shed", "unauthenticated")),
        tokens=of("tokens_served"), errors=of("requests_failed"), sheds=of("requests_shed"),
        rate_limited=of("requests_rate_limited"), unauthenticated=of("requests_unauthenticated"))


def _utc(seconds: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc)


def report(query: UsageQuery, buckets: Sequence[UsageBucket]) -> UsageReport:
    """The answer: per tenant (by name), its totals and its non-empty buckets (in time order)."""
    by_tenant: dict[str, list[UsageBucket]] = {}
    for bucket in buckets:
        if any(bucket.counters):  # rows that only restate a count (a control plane restarted) add nothing
            by_tenant.setdefault(bucket.tenant, []).append(bucket)
    tenants = []
    for tenant, rows in sorted(by_tenant.items()):
        totals = [sum(column) for column in zip(*(b.counters for b in rows))]
        tenants.append(TenantUsage(tenant=tenant, totals=_counts(totals), buckets=[
            UsageBucketOut(start=_utc(b.start), **_counts(b.counters).model_dump()) for b in rows]))
    return UsageReport(from_=_utc(query.start), to=_utc(query.end), granularity=query.granularity,
                       tenant=query.tenant, tenants=tenants)


async def usage_report(store: OperatorStore, query: UsageQuery) -> UsageReport:
    return report(query, await store.usage_buckets(query.tenant, query.start, query.end, query.step))
