"""Usage for billing in the store: the table and the SQL both stores run (SQLite and PostgreSQL).

A row holds, for one ext_proc instance (its node id and process start), one
tenant and one minute, the **cumulative** counters that instance exported,
as last seen in that minute. Writes are upserts that keep the larger value
of each counter (``max`` in SQLite, ``GREATEST`` in PostgreSQL), so writing
the same observation twice, or two control-plane replicas writing what they
each scraped, changes nothing: the rows are a fact about the replica, not
about who wrote them. Usage is computed when read, as differences between
an instance's consecutive rows (``LAG``): the first row of an instance counts
its whole value (its counters started at zero when the process started), and
a value below the previous one is a reset whose new value is the increase,
as Prometheus's ``increase()`` takes it.

Retention deletes rows older than the cutoff, except the newest old row of
an instance that still has newer rows: that one stays, marked ``baseline``,
as the reference the next row's difference is taken from, and counts
nothing itself.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

# ext_proc's outcomes of a tenant's request (label ``outcome`` of inferlb_ext_proc_tenant_*_total).
OUTCOMES = ("served", "failed", "rate_limited", "shed", "unauthenticated")
KINDS = ("requests", "tokens")
# The counter columns, in the order every tuple of counters in this package uses.
COUNTER_COLUMNS = tuple(f"{kind}_{outcome}" for kind in KINDS for outcome in OUTCOMES)

Dialect = Literal["sqlite", "postgres"]


@dataclass(frozen=True)
class UsageRow:
    """One observation: an instance's cumulative counters for one tenant, seen in ``minute`` (unix seconds,
    a multiple of 60), in :data:`COUNTER_COLUMNS` order."""

    instance: str
    tenant: str
    minute: int
    counters: tuple[int, ...]


@dataclass(frozen=True)
class UsageBucket:
    """A tenant's increases over one bucket starting at ``start`` (unix seconds), in :data:`COUNTER_COLUMNS`
    order, summed over the instances."""

    tenant: str
    start: int
    counters: tuple[int, ...]


def create_statements(dialect: Dialect) -> list[str]:
    """The migration that adds the table (schema version 3 in both stores)."""
    integer = "INTEGER" if dialect == "sqlite" else "bigint"
    counters = ",\n".join(f"    {c} {integer} NOT NULL CHECK ({c} >= 0)" for c in COUNTER_COLUMNS)
    return [
        f"""CREATE TABLE usage_counters (
    instance TEXT NOT NULL,
    tenant   TEXT NOT NULL,
    minute   {integer} NOT NULL CHECK (minute % 60 = 0),
    baseline INTEGER NOT NULL DEFAULT 0 CHECK (baseline IN (0, 1)),
{counters},
    PRIMARY KEY (instance, tenant, minute)
)""",
        "CREATE INDEX usage_counters_by_tenant ON usage_counters (tenant, minute)",
        "CREATE INDEX usage_counters_by_minute ON usage_counters (minute)",
    ]


def _params(sql: str, dialect: Dialect) -> str:
    """``:name`` placeholders as the driver wants them (sqlite3 takes them; psycopg wants ``%(name)s``)."""
    return sql if dialect == "sqlite" else re.sub(r":([a-z_]+)", r"%(\1)s", sql)


def upsert_sql(dialect: Dialect) -> str:
    greatest = "max" if dialect == "sqlite" else "GREATEST"
    columns = ", ".join(COUNTER_COLUMNS)
    values = ", ".join(f":{c}" for c in COUNTER_COLUMNS)
    keep = ", ".join(f"{c} = {greatest}(usage_counters.{c}, excluded.{c})" for c in COUNTER_COLUMNS)
    return _params(f"INSERT INTO usage_counters (instance, tenant, minute, {columns}) "
                   f"VALUES (:instance, :tenant, :minute, {values}) "
                   f"ON CONFLICT (instance, tenant, minute) DO UPDATE SET {keep}", dialect)


def upsert_params(rows: Sequence[UsageRow]) -> list[dict[str, Any]]:
    return [{"instance": r.instance, "tenant": r.tenant, "minute": r.minute, **dict(zip(COUNTER_COLUMNS, r.counters))}
            for r in rows]


def query_sql(dialect: Dialect, by_tenant: bool) -> str:
    """Increases per tenant and bucket over minutes in [:start, :end), buckets of :step seconds (UTC-aligned)."""
    tenant = " AND tenant = :tenant" if by_tenant else ""
    columns = ", ".join(COUNTER_COLUMNS)
    u_columns = ", ".join(f"u.{c}" for c in COUNTER_COLUMNS)
    lags = ", ".join(f"{c}, LAG({c}) OVER w AS prev_{c}" for c in COUNTER_COLUMNS)
    sums = ", ".join(f"SUM(CASE WHEN baseline = 1 THEN 0 WHEN prev_{c} IS NULL OR {c} < prev_{c} THEN {c} "
                     f"ELSE {c} - prev_{c} END)" for c in COUNTER_COLUMNS)
    return _params(f"""
WITH win AS (
    SELECT instance, tenant, minute, baseline, {columns} FROM usage_counters
    WHERE minute >= :start AND minute < :end{tenant}
), prev AS (  -- each instance's row before the window: the reference of its first difference
    SELECT u.instance, u.tenant, u.minute, u.baseline, {u_columns}
    FROM (SELECT DISTINCT instance, tenant FROM win) g JOIN usage_counters u
      ON u.instance = g.instance AND u.tenant = g.tenant
     AND u.minute = (SELECT max(p.minute) FROM usage_counters p
                     WHERE p.instance = g.instance AND p.tenant = g.tenant AND p.minute < :start)
), seen AS (
    SELECT * FROM win UNION ALL SELECT * FROM prev
), lagged AS (
    SELECT tenant, minute, baseline, {lags} FROM seen
    WINDOW w AS (PARTITION BY instance, tenant ORDER BY minute)
)
SELECT tenant, (minute / :step) * :step AS bucket, {sums}
FROM lagged WHERE minute >= :start
GROUP BY tenant, bucket ORDER BY tenant, bucket""", dialect)


def query_params(tenant: str | None, start: int, end: int, step: int) -> dict[str, Any]:
    params: dict[str, Any] = {"start": start, "end": end, "step": step}
    if tenant is not None:
        params["tenant"] = tenant
    return params


def buckets_from(rows: Sequence[Sequence[Any]]) -> list[UsageBucket]:
    """The query's rows as buckets (PostgreSQL's SUM of bigint is numeric: made int here)."""
    return [UsageBucket(str(r[0]), int(r[1]), tuple(int(v) for v in r[2:])) for r in rows]


def prune_statements(dialect: Dialect) -> list[str]:
    """Retention, in one transaction, with :cutoff: mark each instance's newest row before the cutoff as its
    baseline when it has newer rows, then delete every other row before the cutoff."""
    same = "p.instance = usage_counters.instance AND p.tenant = usage_counters.tenant"
    return [_params(sql, dialect) for sql in (
        f"""UPDATE usage_counters SET baseline = CASE
            WHEN minute = (SELECT max(p.minute) FROM usage_counters p WHERE {same} AND p.minute < :cutoff)
             AND EXISTS (SELECT 1 FROM usage_counters p WHERE {same} AND p.minute >= :cutoff) THEN 1 ELSE 0 END
            WHERE minute < :cutoff""",
        "DELETE FROM usage_counters WHERE minute < :cutoff AND baseline = 0",
    )]
