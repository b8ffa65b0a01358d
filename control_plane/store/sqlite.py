"""Operator state that survives a restart, in SQLite (stdlib ``sqlite3``): the embedded default.

What is stored is described in ``base``. One process owns the file: with
several control-plane replicas use the PostgreSQL store (``postgres``).

* **One writer.** One connection, opened and used only by one dedicated
  thread (a single-thread executor): every read and write goes through it, in
  order, off the event loop. ``await store.set_pin(...)`` returns once the
  change is committed.
* **WAL** journal, ``synchronous=FULL``: a committed change survives a crash
  of the process or the machine.
* **Versioned schema.** ``PRAGMA user_version`` is the number of migrations
  applied; ``MIGRATIONS`` are ordered functions, each run in its own
  transaction. A database written by a newer inferlb (a higher version) is
  refused, never downgraded.
* **Loud failures.** A file that is not a database, fails the integrity
  check, or cannot be created or written raises :class:`StoreError` naming
  the file and the problem; ``python -m control_plane`` turns it into a
  startup error (exit code 2). Nothing is ever deleted or recreated to get
  past an error.

At startup :meth:`Store.load` returns an :class:`OperatorState` and
:func:`restore` folds it into the controller's initial ``FleetState``, before
the first xDS push: Envoy never sees a moment of unpinned or undrained state.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from ..model import MAX_WEIGHT, MIN_WEIGHT, Endpoint
from ..private_files import ensure_private_file, make_private_dir
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

DB_NAME = "control-plane.db"
SIDE_FILES = ("-wal", "-shm")  # SQLite's write-ahead log and its shared-memory index, next to the database
T = TypeVar("T")


# --- schema ----------------------------------------------------------------------------------------


def _migration_1(db: sqlite3.Connection) -> None:
    db.execute("""
        CREATE TABLE endpoints (
            id         TEXT PRIMARY KEY,
            address    TEXT NOT NULL,
            port       INTEGER NOT NULL CHECK (port BETWEEN 1 AND 65535),
            created_at REAL NOT NULL
        )""")
    db.execute(f"""
        CREATE TABLE endpoint_overrides (
            id            TEXT PRIMARY KEY,
            pinned_weight INTEGER CHECK (pinned_weight IS NULL OR pinned_weight BETWEEN {MIN_WEIGHT} AND {MAX_WEIGHT}),
            draining      INTEGER NOT NULL DEFAULT 0 CHECK (draining IN (0, 1)),
            updated_at    REAL NOT NULL
        )""")
    db.execute("""
        CREATE TABLE policies (
            kind       TEXT PRIMARY KEY CHECK (kind IN ('weight', 'pick')),
            name       TEXT NOT NULL,
            params     TEXT NOT NULL,
            updated_at REAL NOT NULL
        )""")
    db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")


def _migration_2(db: sqlite3.Connection) -> None:
    """API keys (issue 14): the key's SHA-256, never the key."""
    db.execute("""
        CREATE TABLE api_keys (
            id                   TEXT PRIMARY KEY,
            tenant               TEXT NOT NULL,
            key_hash             TEXT NOT NULL UNIQUE CHECK (length(key_hash) = 64),
            key_hint             TEXT NOT NULL,
            name                 TEXT,
            priority             TEXT NOT NULL CHECK (priority IN ('critical', 'standard', 'sheddable')),
            weight               REAL NOT NULL CHECK (weight > 0 AND weight <= 1000),
            tokens_per_minute    INTEGER CHECK (tokens_per_minute IS NULL OR tokens_per_minute > 0),
            requests_per_minute  INTEGER CHECK (requests_per_minute IS NULL OR requests_per_minute > 0),
            max_tokens_in_flight INTEGER CHECK (max_tokens_in_flight IS NULL OR max_tokens_in_flight > 0),
            created_at           REAL NOT NULL,
            revoked_at           REAL
        )""")


def _migration_3(db: sqlite3.Connection) -> None:
    """Usage for billing (issue 14): cumulative counters per ext_proc instance, tenant and minute (``usage``)."""
    for statement in usage.create_statements("sqlite"):
        db.execute(statement)


def _migration_4(db: sqlite3.Connection) -> None:
    """Model rollouts (issue 15): each alias's split and the one it replaced (``rollouts``)."""
    for statement in rollouts.create_statements("sqlite"):
        db.execute(statement)


# Ordered: MIGRATIONS[i] takes the schema from version i to i + 1. Append only.
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_migration_1, _migration_2, _migration_3,
                                                                 _migration_4)
SCHEMA_VERSION = len(MIGRATIONS)


_API_KEY_SELECT = f"SELECT {API_KEY_COLUMNS}, created_at, revoked_at FROM api_keys"


# --- the store -------------------------------------------------------------------------------------


class Store(OneThreadStore):
    """The control plane's SQLite database; see the module docstring. Use :meth:`open`."""

    def __init__(self, path: Path) -> None:
        super().__init__("inferlb-store")
        self.path = path
        self._replica_id = f"sqlite-{os.getpid()}"
        self._db: sqlite3.Connection | None = None

    @classmethod
    def open(cls, data_dir: Path | str, name: str = DB_NAME) -> Store:
        """Open (creating the directory and the file when missing), check and migrate; or StoreError."""
        data_dir = Path(data_dir)
        store = cls(data_dir / name)
        store._open_with(lambda: store._open(data_dir))
        return store

    def _disconnect(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    @property
    def location(self) -> str:
        return str(self.path)

    @property
    def replica_id(self) -> str:
        return self._replica_id

    async def changes(self, reload_interval_s: float = 30.0) -> AsyncIterator[StoreChange]:
        """Nothing: one process owns the file, so nobody else changes it."""
        return
        yield  # an async generator that ends at once

    # -- plumbing: everything runs on the store's one thread (``OneThreadStore``) -------------------

    def _guarded(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except StoreError:
            raise
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: {exc}") from exc
        except OSError as exc:
            raise StoreError(f"{self.path}: {exc.strerror or exc}") from exc

    def _write(self, statements: Callable[[sqlite3.Connection], None]) -> None:
        db = self._conn()
        db.execute("BEGIN IMMEDIATE")
        try:
            statements(db)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreError(f"{self.path}: the store is closed")
        return self._db

    def _open(self, data_dir: Path) -> None:
        try:
            make_private_dir(data_dir)
        except OSError as exc:
            raise StoreError(f"{self.path}: cannot create the data directory {data_dir}: "
                             f"{exc.strerror or exc}") from exc
        if self.path.exists() and not self.path.is_file():
            raise StoreError(f"{self.path}: exists and is not a file")
        # Tenants, key hashes, quotas and usage: the owner's only. Created 0600 before SQLite opens it (SQLite
        # gives its -wal and -shm files the database's mode); files left by an older version are tightened.
        try:
            ensure_private_file(self.path, log)
            for suffix in SIDE_FILES:
                ensure_private_file(self.path.with_name(self.path.name + suffix), log, create=False)
        except OSError as exc:
            raise StoreError(f"{self.path}: cannot make the database private: {exc.strerror or exc}") from exc
        try:
            db = sqlite3.connect(self.path, isolation_level=None, timeout=10.0)
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: cannot open the database: {exc}") from exc
        self._db = db
        try:
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            db.execute("PRAGMA synchronous=FULL")
            db.execute("PRAGMA foreign_keys=ON")
            check = db.execute("PRAGMA quick_check").fetchall()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path}: not a usable SQLite database ({exc}); "
                             "move it away to start from empty state") from exc
        if [row[0] for row in check] != ["ok"]:
            problems = "; ".join(str(row[0]) for row in check[:5])
            raise StoreError(f"{self.path}: the database is corrupt ({problems}); "
                             "move it away to start from empty state")
        if str(mode).lower() != "wal":
            log.warning("SQLite did not switch to WAL", extra={"path": str(self.path), "journal_mode": mode})
        self._migrate(db)
        # A write on every start: a read-only file or directory fails here, at startup, not at the first PUT.
        try:
            self._write(lambda c: c.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('opened_at', ?)",
                                            (repr(time.time()),)))
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: the database is not writable: {exc}") from exc

    def _migrate(self, db: sqlite3.Connection) -> None:
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(f"{self.path}: schema version {version} was written by a newer inferlb; this one "
                             f"knows versions up to {SCHEMA_VERSION} and will not downgrade it")
        for target in range(version + 1, SCHEMA_VERSION + 1):
            def step(c: sqlite3.Connection, target: int = target) -> None:
                MIGRATIONS[target - 1](c)
                c.execute(f"PRAGMA user_version = {int(target)}")
            try:
                self._write(step)
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: migration to schema version {target} failed: {exc}") from exc
            log.info("store migrated", extra={"path": str(self.path), "schema_version": target})

    # -- reading ----------------------------------------------------------------------------------

    def schema_version(self) -> int:
        return self._call(lambda: self._conn().execute("PRAGMA user_version").fetchone()[0])

    def load(self) -> OperatorState:
        """Everything stored (call at startup, before the first push)."""
        return self._call(self._load)

    async def aload(self) -> OperatorState:
        return await self._acall(self._load)

    def _load(self) -> OperatorState:
        db = self._conn()
        endpoints = tuple((str(a), int(p)) for a, p in
                          db.execute("SELECT address, port FROM endpoints ORDER BY created_at, id"))
        overrides = {str(i): Override(None if w is None else int(w), bool(d)) for i, w, d in
                     db.execute("SELECT id, pinned_weight, draining FROM endpoint_overrides ORDER BY id")}
        policies: dict[str, StoredPolicy] = {}
        for kind, name, params in db.execute("SELECT kind, name, params FROM policies"):
            try:
                decoded = json.loads(params)
            except ValueError as exc:
                raise StoreError(f"{self.path}: stored {kind} policy parameters are not JSON: {exc}") from exc
            if not isinstance(decoded, dict):
                raise StoreError(f"{self.path}: stored {kind} policy parameters are not an object")
            policies[kind] = StoredPolicy(str(name), decoded)
        api_keys = tuple(api_key_from_row(row, str(self.path)) for row in
                         db.execute(f"{_API_KEY_SELECT} ORDER BY created_at, id"))
        stored_rollouts = rollouts.from_rows(db.execute(rollouts.SELECT).fetchall(), str(self.path))
        return OperatorState(endpoints, overrides, policies.get("weight"), policies.get("pick"), api_keys,
                             stored_rollouts)

    # -- writing (each returns once committed) ----------------------------------------------------

    async def add_endpoint(self, address: str, port: int) -> None:
        endpoint_id = Endpoint(address=address, port=port).id

        def statements(db: sqlite3.Connection) -> None:
            db.execute("INSERT OR REPLACE INTO endpoints (id, address, port, created_at) VALUES (?, ?, ?, ?)",
                       (endpoint_id, address, port, time.time()))
            db.execute("DELETE FROM endpoint_overrides WHERE id = ?", (endpoint_id,))

        await self._acall(lambda: self._write(statements))

    async def remove_endpoint(self, endpoint_id: str) -> None:
        """Forget a registration and its pin and drain."""
        def statements(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM endpoints WHERE id = ?", (endpoint_id,))
            db.execute("DELETE FROM endpoint_overrides WHERE id = ?", (endpoint_id,))

        await self._acall(lambda: self._write(statements))

    async def set_override(self, endpoint_id: str, pinned_weight: int | None, draining: bool) -> None:
        """The endpoint's pin and drain state, both (a row with neither is deleted)."""
        def statements(db: sqlite3.Connection) -> None:
            if pinned_weight is None and not draining:
                db.execute("DELETE FROM endpoint_overrides WHERE id = ?", (endpoint_id,))
            else:
                db.execute("INSERT OR REPLACE INTO endpoint_overrides (id, pinned_weight, draining, updated_at) "
                           "VALUES (?, ?, ?, ?)", (endpoint_id, pinned_weight, int(draining), time.time()))

        await self._acall(lambda: self._write(statements))

    async def set_policies(self, policies: Mapping[PolicyKind, StoredPolicy]) -> None:
        """Set the weight and/or pick policy, together in one transaction."""
        rows = [(kind, p.name, json.dumps(dict(p.params), sort_keys=True, allow_nan=False), time.time())
                for kind, p in policies.items()]

        def statements(db: sqlite3.Connection) -> None:
            db.executemany("INSERT OR REPLACE INTO policies (kind, name, params, updated_at) VALUES (?, ?, ?, ?)",
                           rows)

        await self._acall(lambda: self._write(statements))

    async def add_api_key(self, key: StoredApiKey) -> None:
        row = (*api_key_row(key), key.created_at)

        def statements(db: sqlite3.Connection) -> None:
            db.execute(f"INSERT INTO api_keys ({API_KEY_COLUMNS}, created_at) "
                       f"VALUES ({', '.join('?' * len(row))})", row)

        await self._acall(lambda: self._write(statements))

    async def revoke_api_key(self, key_id: str, at: float) -> StoredApiKey | None:
        def revoke() -> StoredApiKey | None:
            self._write(lambda db: db.execute(
                "UPDATE api_keys SET revoked_at = COALESCE(revoked_at, ?) WHERE id = ?", (at, key_id)))
            row = self._conn().execute(f"{_API_KEY_SELECT} WHERE id = ?", (key_id,)).fetchone()
            return None if row is None else api_key_from_row(row, str(self.path))

        return await self._acall(revoke)

    async def set_rollout(self, record: StoredRollout) -> None:
        values = (*rollouts.row(record), time.time())
        await self._acall(lambda: self._write(lambda db: db.execute(rollouts.upsert_sql("sqlite"), values)))

    async def delete_rollout(self, alias: str) -> None:
        await self._acall(lambda: self._write(lambda db: db.execute(rollouts.delete_sql("sqlite"), (alias,))))

    # -- usage for billing (``usage``: idempotent upserts, differences taken when read) -------------

    async def record_usage(self, rows: Sequence[usage.UsageRow]) -> None:
        params = usage.upsert_params(rows)
        await self._acall(lambda: self._write(lambda db: db.executemany(usage.upsert_sql("sqlite"), params)))

    async def usage_buckets(self, tenant: str | None, start: int, end: int, step: int) -> list[usage.UsageBucket]:
        sql, params = usage.query_sql("sqlite", tenant is not None), usage.query_params(tenant, start, end, step)
        return await self._acall(lambda: usage.buckets_from(self._conn().execute(sql, params).fetchall()))

    async def prune_usage(self, cutoff: int) -> int:
        """Forget usage before ``cutoff`` (unix seconds) but the baselines; the rows deleted."""
        deleted: list[int] = []

        def statements(db: sqlite3.Connection) -> None:
            mark, delete = usage.prune_statements("sqlite")
            db.execute(mark, {"cutoff": cutoff})
            deleted.append(db.execute(delete, {"cutoff": cutoff}).rowcount)

        await self._acall(lambda: self._write(statements))
        return deleted[0]
