"""Rollouts in the store: the table and the row codec both stores use (SQLite and PostgreSQL).

One row per alias: the current split (``versions``, JSON ``[{"model", "percent"}, ...]`` in the order
given, as ``encode_rollouts`` writes it, and ``sticky``) and the split it replaced (``previous_*``,
null when there is none), which ``POST /v1/rollouts/{alias}/rollback`` puts back. Rows are read back
through the contract's own decoder (``decode_rollouts``), so a row that breaks the contract (edited by
hand, or written by a newer inferlb) is refused with the store's name, never half applied.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from inferlb_runtime.model_routing import STICKY_MODES, InvalidRollouts, Rollout, decode_rollouts, encode_rollouts

from .base import StoredRollout, StoreError

Dialect = Literal["sqlite", "postgres"]
COLUMNS = "alias, versions, sticky, previous_versions, previous_sticky"
SELECT = f"SELECT {COLUMNS} FROM rollouts ORDER BY alias"


def create_statements(dialect: Dialect) -> list[str]:
    """The migration that adds the table (schema version 4 in both stores)."""
    text, json_type = ("TEXT", "TEXT") if dialect == "sqlite" else ("text", "jsonb")
    updated = "REAL NOT NULL" if dialect == "sqlite" else "timestamptz NOT NULL DEFAULT clock_timestamp()"
    modes = ", ".join(f"'{m}'" for m in STICKY_MODES)
    return [f"""CREATE TABLE rollouts (
    alias             {text} PRIMARY KEY,
    versions          {json_type} NOT NULL,
    sticky            {text} NOT NULL CHECK (sticky IN ({modes})),
    previous_versions {json_type},
    previous_sticky   {text} CHECK (previous_sticky IS NULL OR previous_sticky IN ({modes})),
    updated_at        {updated},
    CHECK ((previous_versions IS NULL) = (previous_sticky IS NULL))
)"""]


def _versions(rollout: Rollout | None) -> str | None:
    return None if rollout is None else json.dumps(encode_rollouts([rollout])[rollout.alias]["versions"])


def row(record: StoredRollout) -> tuple[Any, ...]:
    """The values of :data:`COLUMNS`."""
    previous = record.previous
    return (record.alias, _versions(record.rollout), record.rollout.sticky, _versions(previous),
            None if previous is None else previous.sticky)


def _decode(alias: str, versions: Any, sticky: Any) -> Rollout:
    if isinstance(versions, str):  # SQLite keeps text; psycopg decodes jsonb
        versions = json.loads(versions)
    return decode_rollouts({alias: {"versions": versions, "sticky": sticky}})[alias]


def from_rows(rows: Sequence[Sequence[Any]], where: str) -> tuple[StoredRollout, ...]:
    """The records of :data:`SELECT`'s rows; :class:`StoreError` naming ``where`` for a bad row."""
    records = []
    for alias, versions, sticky, previous_versions, previous_sticky in rows:
        try:
            current = _decode(str(alias), versions, sticky)
            previous = None if previous_versions is None else _decode(str(alias), previous_versions,
                                                                      previous_sticky)
        except (InvalidRollouts, ValueError) as exc:
            raise StoreError(f"{where}: stored rollout of {alias!r} is not valid: {exc}") from None
        records.append(StoredRollout(current, previous))
    return tuple(records)


def upsert_sql(dialect: Dialect) -> str:
    if dialect == "sqlite":
        return (f"INSERT OR REPLACE INTO rollouts ({COLUMNS}, updated_at) VALUES (?, ?, ?, ?, ?, ?)")
    return (f"INSERT INTO rollouts ({COLUMNS}) VALUES (%s, %s::jsonb, %s, %s::jsonb, %s) "
            "ON CONFLICT (alias) DO UPDATE SET versions = EXCLUDED.versions, sticky = EXCLUDED.sticky, "
            "previous_versions = EXCLUDED.previous_versions, previous_sticky = EXCLUDED.previous_sticky, "
            "updated_at = clock_timestamp()")


def delete_sql(dialect: Dialect) -> str:
    return "DELETE FROM rollouts WHERE alias = " + ("?" if dialect == "sqlite" else "%s")
