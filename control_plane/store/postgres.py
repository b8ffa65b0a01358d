"""Operator state shared by control-plane replicas, in PostgreSQL (psycopg 3).

Same contract and schema as the SQLite store (``sqlite``), for several
processes at once (``INFERLB_STORE=postgresql://user@host:port/db``):

* **Queries on one thread.** A synchronous connection, used only by one
  dedicated thread (a single-thread executor), as the SQLite store does: off
  the event loop, in order. A connection that broke (the server restarted) is
  replaced and the statement retried once: every write is an idempotent
  upsert or delete. A write that still fails raises :class:`StoreError`, so
  the admin API answers 503 and changes nothing.
* **Every write notifies.** In the write's own transaction, ``pg_notify`` on
  ``inferlb_operator_state`` with ``{"replica", "revision"}`` (the revision is
  a sequence): PostgreSQL delivers it only if and when the change commits.
* **A change feed** (:meth:`PostgresStore.changes`): a second, asyncio
  connection that LISTENs. It yields ``connected`` on every (re)connection
  (notifications sent while it was away are lost: the reader reloads
  everything), ``notified`` per notification, and ``periodic`` every
  ``reload_interval_s`` as a safety net; it reconnects with backoff forever.
  Receivers reload the state from the tables: the payload only says "look".
* **Migrations** under a transaction-scoped advisory lock, all in one
  transaction: replicas starting together migrate once, the others wait and
  find it done. ``schema_version`` holds the number applied; a newer one is
  refused, never downgraded.
* Outages are logged once per change of state (down, then back), not once
  per failed statement.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import unquote

import psycopg
from psycopg import conninfo

from ..model import MAX_WEIGHT, MIN_WEIGHT, Endpoint
from . import rollouts, usage
from .base import (
    API_KEY_COLUMNS,
    OneThreadStore,
    OperatorState,
    Override,
    PolicyKind,
    StoreChange,
    StoredApiKey,
    StoredPolicy,
    StoredRollout,
    StoreError,
    api_key_from_row,
    api_key_row,
)

log = logging.getLogger("inferlb.control_plane.store")

CHANNEL = "inferlb_operator_state"
# pg_advisory_xact_lock key that serialises migrations ("inferlb" in ASCII).
MIGRATION_LOCK = int.from_bytes(b"inferlb", "big")
SCHEMES = ("postgresql://", "postgres://")
RECONNECT_MIN_S = 0.2
RECONNECT_MAX_S = 5.0
T = TypeVar("T")


def _migration_1(cur: psycopg.Cursor[Any]) -> None:
    cur.execute("""
        CREATE TABLE endpoints (
            id         text PRIMARY KEY,
            address    text NOT NULL,
            port       integer NOT NULL CHECK (port BETWEEN 1 AND 65535),
            created_at timestamptz NOT NULL DEFAULT clock_timestamp()
        )""")
    cur.execute(f"""
        CREATE TABLE endpoint_overrides (
            id            text PRIMARY KEY,
            pinned_weight integer CHECK (pinned_weight IS NULL OR pinned_weight BETWEEN {MIN_WEIGHT} AND {MAX_WEIGHT}),
            draining      boolean NOT NULL DEFAULT false,
            updated_at    timestamptz NOT NULL DEFAULT clock_timestamp()
        )""")
    cur.execute("""
        CREATE TABLE policies (
            kind       text PRIMARY KEY CHECK (kind IN ('weight', 'pick')),
            name       text NOT NULL,
            params     jsonb NOT NULL,
            updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
        )""")
    cur.execute("CREATE TABLE meta (key text PRIMARY KEY, value text NOT NULL)")
    cur.execute("CREATE SEQUENCE operator_state_revision")


def _migration_2(cur: psycopg.Cursor[Any]) -> None:
    """API keys (issue 14): the key's SHA-256, never the key."""
    cur.execute("""
        CREATE TABLE api_keys (
            id                   text PRIMARY KEY,
            tenant               text NOT NULL,
            key_hash             text NOT NULL UNIQUE CHECK (length(key_hash) = 64),
            key_hint             text NOT NULL,
            name                 text,
            priority             text NOT NULL CHECK (priority IN ('critical', 'standard', 'sheddable')),
            weight               double precision NOT NULL CHECK (weight > 0 AND weight <= 1000),
            tokens_per_minute    bigint CHECK (tokens_per_minute IS NULL OR tokens_per_minute > 0),
            requests_per_minute  bigint CHECK (requests_per_minute IS NULL OR requests_per_minute > 0),
            max_tokens_in_flight bigint CHECK (max_tokens_in_flight IS NULL OR max_tokens_in_flight > 0),
            created_at           timestamptz NOT NULL,
            revoked_at           timestamptz
        )""")


def _migration_3(cur: psycopg.Cursor[Any]) -> None:
    """Usage for billing (issue 14): cumulative counters per ext_proc instance, tenant and minute (``usage``)."""
    for statement in usage.create_statements("postgres"):
        cur.execute(statement)


def _migration_4(cur: psycopg.Cursor[Any]) -> None:
    """Model rollouts (issue 15): each alias's split and the one it replaced (``rollouts``)."""
    for statement in rollouts.create_statements("postgres"):
        cur.execute(statement)


# Ordered: MIGRATIONS[i] takes the schema from version i to i + 1. Append only.
MIGRATIONS: tuple[Callable[[psycopg.Cursor[Any]], None], ...] = (_migration_1, _migration_2, _migration_3,
                                                                  _migration_4)
# Times as unix seconds, as the SQLite store keeps them.
_API_KEY_SELECT = (f"SELECT {API_KEY_COLUMNS}, extract(epoch FROM created_at)::float8, "
                   "extract(epoch FROM revoked_at)::float8 FROM api_keys")
SCHEMA_VERSION = len(MIGRATIONS)


def check_url(url: str) -> str:
    """``url`` if it is a usable ``postgresql://`` URL, else StoreError saying what is wrong (no password)."""
    if not url.startswith(SCHEMES):
        raise StoreError(f"store URL {redact(url)!r}: expected postgresql://user@host:port/database")
    try:
        conninfo.conninfo_to_dict(url)
    except psycopg.Error as exc:
        raise StoreError(f"store URL {redact(url)!r} is not a valid PostgreSQL URL: "
                         f"{scrub(str(exc).strip(), url)}") from None
    return url


# Query parameters of a libpq URL that hold a secret (``?password=`` works like the user info's).
SECRET_PARAMETERS = ("password", "sslpassword")


def scrub(text: str, url: str) -> str:
    """``text`` without the URL's secrets: the user info's password and ``?password=`` or ``?sslpassword=``
    (libpq quotes the URL, or a parameter's value, in some errors)."""
    userinfo = url.partition("://")[2].rpartition("@")[0]
    secrets_ = [userinfo.partition(":")[2]]
    query = url.partition("?")[2]
    secrets_ += [value for part in query.split("&") for name, _, value in [part.partition("=")]
                 if unquote(name).lower() in SECRET_PARAMETERS]
    for secret in sorted({s for raw in secrets_ for s in (raw, unquote(raw))} - {""}, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<not a URL>"
    userinfo, at, host = rest.rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + ":***"
    return f"{scheme}://{userinfo}{at}{host}".split("?", 1)[0]


class PostgresStore(OneThreadStore):
    """The shared store; see the module docstring. Use :meth:`open`."""

    def __init__(self, url: str, *, connect_timeout_s: float = 3.0, statement_timeout_s: float = 5.0,
                 replica_id: str | None = None) -> None:
        super().__init__("inferlb-pgstore")
        self._url = url
        self._location = redact(url)
        self._replica_id = replica_id or f"{os.uname().nodename}-{os.getpid()}-{secrets.token_hex(3)}"
        self._connect_timeout = max(1, round(connect_timeout_s))
        self._statement_timeout_ms = int(statement_timeout_s * 1000)
        self._conn: psycopg.Connection[Any] | None = None
        self._closed = False
        self._healthy = {"queries": True, "feed": True}  # for logging each outage once

    @classmethod
    def open(cls, url: str, **options: Any) -> PostgresStore:
        """Connect, migrate and check that the database takes writes; or StoreError."""
        store = cls(check_url(url), **options)
        store._open_with(store._open)
        return store

    @property
    def location(self) -> str:
        return self._location

    @property
    def replica_id(self) -> str:
        return self._replica_id

    def _disconnect(self) -> None:
        self._closed = True
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- plumbing: every query runs on the store's one thread (``OneThreadStore``) ------------------

    def _guarded(self, fn: Callable[[], T]) -> T:
        try:
            result = fn()
        except StoreError as exc:
            self._report("queries", exc)
            raise
        except psycopg.Error as exc:
            error = StoreError(f"{self._location}: {scrub(str(exc).strip(), self._url) or type(exc).__name__}")
            self._report("queries", error)
            raise error from exc
        self._report("queries", None)
        return result

    def _report(self, what: str, error: Exception | None) -> None:
        """Log a change of state only: the first failure, and the first success after failures."""
        if error is not None and self._healthy[what]:
            log.error("PostgreSQL store unavailable", extra={"store": self._location, "part": what,
                                                             "error": str(error)})
        elif error is None and not self._healthy[what]:
            log.info("PostgreSQL store available again", extra={"store": self._location, "part": what})
        self._healthy[what] = error is None

    def _error(self, what: str, exc: psycopg.Error) -> StoreError:
        return StoreError(f"{self._location}: {what}: {scrub(str(exc).strip(), self._url)}")

    def _connect_kwargs(self) -> dict[str, Any]:
        return {"autocommit": True, "connect_timeout": self._connect_timeout,
                "application_name": f"inferlb-control-plane {self._replica_id}"[:63]}

    def _connection(self) -> psycopg.Connection[Any]:
        if self._closed:
            raise StoreError(f"{self._location}: the store is closed")
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                conn.close()
            self._conn = None
            try:
                conn = psycopg.connect(self._url, **self._connect_kwargs())
                conn.execute(f"SET statement_timeout = {self._statement_timeout_ms}")
            except psycopg.Error as exc:
                raise self._error("cannot connect", exc) from exc
            self._conn = conn
        return conn

    def _run(self, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        """``fn`` on the connection; once more on a fresh one if the connection broke under it."""
        conn = self._connection()
        try:
            return fn(conn)
        except psycopg.OperationalError:
            if not conn.broken:
                raise
            log.info("PostgreSQL connection lost: reconnecting", extra={"store": self._location})
        return fn(self._connection())

    def _write(self, statements: Callable[[psycopg.Cursor[Any]], None]) -> int:
        """Run ``statements`` and notify the replicas, in one transaction; the new revision."""
        def transaction(conn: psycopg.Connection[Any]) -> int:
            with conn.transaction(), conn.cursor() as cur:
                statements(cur)
                row = cur.execute("SELECT nextval('operator_state_revision')").fetchone()
                revision = int(row[0]) if row else 0
                cur.execute("SELECT pg_notify(%s, %s)",
                            (CHANNEL, json.dumps({"replica": self._replica_id, "revision": revision})))
                return revision
        return self._run(transaction)

    def _open(self) -> None:
        conn = self._connection()
        with conn.transaction(), conn.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            cur.execute("CREATE TABLE IF NOT EXISTS schema_version (version integer NOT NULL)")
            row = cur.execute("SELECT version FROM schema_version").fetchone()
            version = int(row[0]) if row else 0
            if row is None:
                cur.execute("INSERT INTO schema_version (version) VALUES (0)")
            if version > SCHEMA_VERSION:
                raise StoreError(f"{self._location}: schema version {version} was written by a newer inferlb; "
                                 f"this one knows versions up to {SCHEMA_VERSION} and will not downgrade it")
            for target in range(version + 1, SCHEMA_VERSION + 1):
                MIGRATIONS[target - 1](cur)
                cur.execute("UPDATE schema_version SET version = %s", (target,))
                log.info("store migrated", extra={"store": self._location, "schema_version": target})
        # A write on every start: a read-only server (a hot standby) fails here, not at the first PUT.
        try:
            with conn.transaction():
                conn.execute("INSERT INTO meta (key, value) VALUES ('opened_at', now()::text) "
                             "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value")
        except psycopg.Error as exc:
            raise self._error("the database is not writable", exc) from exc

    # -- reading ----------------------------------------------------------------------------------

    def schema_version(self) -> int:
        def read(conn: psycopg.Connection[Any]) -> int:
            row = conn.execute("SELECT version FROM schema_version").fetchone()
            return int(row[0]) if row else 0
        return self._call(lambda: self._run(read))

    def load(self) -> OperatorState:
        """Everything stored (startup, before the first push)."""
        return self._call(lambda: self._run(self._load))

    async def aload(self) -> OperatorState:
        return await self._acall(lambda: self._run(self._load))

    def _load(self, conn: psycopg.Connection[Any]) -> OperatorState:
        with conn.transaction(), conn.cursor() as cur:  # one snapshot of all the tables
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            endpoints = tuple((str(a), int(p)) for a, p in
                              cur.execute("SELECT address, port FROM endpoints ORDER BY created_at, id"))
            overrides = {str(i): Override(None if w is None else int(w), bool(d)) for i, w, d in
                         cur.execute("SELECT id, pinned_weight, draining FROM endpoint_overrides ORDER BY id")}
            policies: dict[str, StoredPolicy] = {}
            for kind, name, params in cur.execute("SELECT kind, name, params FROM policies"):
                if not isinstance(params, dict):
                    raise StoreError(f"{self._location}: stored {kind} policy parameters are not an object")
                policies[kind] = StoredPolicy(str(name), params)
            api_keys = tuple(api_key_from_row(row, self._location) for row in
                             cur.execute(f"{_API_KEY_SELECT} ORDER BY created_at, id"))
            stored_rollouts = rollouts.from_rows(cur.execute(rollouts.SELECT).fetchall(), self._location)
        return OperatorState(endpoints, overrides, policies.get("weight"), policies.get("pick"), api_keys,
                             stored_rollouts)

    # -- writing (each returns once committed) ----------------------------------------------------

    async def add_endpoint(self, address: str, port: int) -> None:
        endpoint_id = Endpoint(address=address, port=port).id

        def statements(cur: psycopg.Cursor[Any]) -> None:
            cur.execute("INSERT INTO endpoints (id, address, port) VALUES (%s, %s, %s) ON CONFLICT (id) DO UPDATE "
                        "SET address = EXCLUDED.address, port = EXCLUDED.port, created_at = clock_timestamp()",
                        (endpoint_id, address, port))
            cur.execute("DELETE FROM endpoint_overrides WHERE id = %s", (endpoint_id,))

        await self._acall(lambda: self._write(statements))

    async def remove_endpoint(self, endpoint_id: str) -> None:
        """Forget a registration and its pin and drain."""
        def statements(cur: psycopg.Cursor[Any]) -> None:
            cur.execute("DELETE FROM endpoints WHERE id = %s", (endpoint_id,))
            cur.execute("DELETE FROM endpoint_overrides WHERE id = %s", (endpoint_id,))

        await self._acall(lambda: self._write(statements))

    async def set_override(self, endpoint_id: str, pinned_weight: int | None, draining: bool) -> None:
        """The endpoint's pin and drain state, both (a row with neither is deleted)."""
        def statements(cur: psycopg.Cursor[Any]) -> None:
            if pinned_weight is None and not draining:
                cur.execute("DELETE FROM endpoint_overrides WHERE id = %s", (endpoint_id,))
            else:
                cur.execute("INSERT INTO endpoint_overrides (id, pinned_weight, draining) VALUES (%s, %s, %s) "
                            "ON CONFLICT (id) DO UPDATE SET pinned_weight = EXCLUDED.pinned_weight, "
                            "draining = EXCLUDED.draining, updated_at = clock_timestamp()",
                            (endpoint_id, pinned_weight, draining))

        await self._acall(lambda: self._write(statements))

    async def set_policies(self, policies: Mapping[PolicyKind, StoredPolicy]) -> None:
        """Set the weight and/or pick policy, together in one transaction."""
        rows = [(kind, p.name, json.dumps(dict(p.params), sort_keys=True, allow_nan=False))
                for kind, p in policies.items()]

        def statements(cur: psycopg.Cursor[Any]) -> None:
            cur.executemany("INSERT INTO policies (kind, name, params) VALUES (%s, %s, %s::jsonb) "
                            "ON CONFLICT (kind) DO UPDATE SET name = EXCLUDED.name, params = EXCLUDED.params, "
                            "updated_at = clock_timestamp()", rows)

        await self._acall(lambda: self._write(statements))

    async def add_api_key(self, key: StoredApiKey) -> None:
        row = (*api_key_row(key), key.created_at)

        def statements(cur: psycopg.Cursor[Any]) -> None:
            cur.execute(f"INSERT INTO api_keys ({API_KEY_COLUMNS}, created_at) "
                        f"VALUES ({', '.join(['%s'] * (len(row) - 1))}, to_timestamp(%s))", row)

        await self._acall(lambda: self._write(statements))

    async def revoke_api_key(self, key_id: str, at: float) -> StoredApiKey | None:
        found: list[StoredApiKey] = []

        def statements(cur: psycopg.Cursor[Any]) -> None:
            found.clear()  # a retry on a fresh connection runs this again
            cur.execute("UPDATE api_keys SET revoked_at = COALESCE(revoked_at, to_timestamp(%s)) WHERE id = %s",
                        (at, key_id))
            row = cur.execute(f"{_API_KEY_SELECT} WHERE id = %s", (key_id,)).fetchone()
            if row is not None:
                found.append(api_key_from_row(row, self._location))

        await self._acall(lambda: self._write(statements))
        return found[0] if found else None

    async def set_rollout(self, record: StoredRollout) -> None:
        values = rollouts.row(record)
        await self._acall(lambda: self._write(lambda cur: cur.execute(rollouts.upsert_sql("postgres"), values)))

    async def delete_rollout(self, alias: str) -> None:
        await self._acall(lambda: self._write(lambda cur: cur.execute(rollouts.delete_sql("postgres"), (alias,))))

    # -- usage for billing (``usage``): no notification, nothing for the other replicas to reload -----

    async def record_usage(self, rows: Sequence[usage.UsageRow]) -> None:
        """Idempotent upserts (GREATEST), so a retry on a fresh connection and another replica's writes of
        the same observations change nothing."""
        params = usage.upsert_params(rows)

        def transaction(conn: psycopg.Connection[Any]) -> None:
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany(usage.upsert_sql("postgres"), params)

        await self._acall(lambda: self._run(transaction))

    async def usage_buckets(self, tenant: str | None, start: int, end: int, step: int) -> list[usage.UsageBucket]:
        sql, params = usage.query_sql("postgres", tenant is not None), usage.query_params(tenant, start, end, step)
        return await self._acall(lambda: self._run(lambda conn: usage.buckets_from(
            conn.execute(sql, params).fetchall())))

    async def prune_usage(self, cutoff: int) -> int:
        """Forget usage before ``cutoff`` (unix seconds) but the baselines; the rows deleted."""
        def transaction(conn: psycopg.Connection[Any]) -> int:
            mark, delete = usage.prune_statements("postgres")
            with conn.transaction(), conn.cursor() as cur:
                cur.execute(mark, {"cutoff": cutoff})
                return cur.execute(delete, {"cutoff": cutoff}).rowcount

        return await self._acall(lambda: self._run(transaction))

    # -- the change feed --------------------------------------------------------------------------

    async def changes(self, reload_interval_s: float = 30.0) -> AsyncIterator[StoreChange]:
        """Forever: ``connected`` on each (re)connection, ``notified`` per commit, ``periodic`` in between."""
        loop = asyncio.get_running_loop()
        backoff = RECONNECT_MIN_S
        while not self._closed:
            try:
                conn = await psycopg.AsyncConnection.connect(self._url, **self._connect_kwargs())
            except psycopg.Error as exc:
                self._report("feed", self._error("cannot connect", exc))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RECONNECT_MAX_S)
                continue
            try:
                async with conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    self._report("feed", None)
                    backoff = RECONNECT_MIN_S
                    yield StoreChange("connected")
                    next_reload = loop.time() + reload_interval_s
                    while True:
                        remaining = next_reload - loop.time()
                        if remaining <= 0:
                            yield StoreChange("periodic")
                            next_reload = loop.time() + reload_interval_s
                            continue
                        async for notify in conn.notifies(timeout=remaining):
                            yield parse_notification(notify.payload)
            except psycopg.Error as exc:
                self._report("feed", self._error("change feed lost", exc))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RECONNECT_MAX_S)


def parse_notification(payload: str) -> StoreChange:
    """A ``notified`` change from its payload; a payload this version cannot read still means "reload"."""
    try:
        decoded = json.loads(payload)
        return StoreChange("notified", str(decoded["replica"]), int(decoded["revision"]))
    except (ValueError, KeyError, TypeError):
        return StoreChange("notified")
