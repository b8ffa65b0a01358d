"""Which store: the ``store`` setting (``INFERLB_STORE``) names PostgreSQL; unset, SQLite in the data directory."""

from __future__ import annotations

from pathlib import Path

from .base import OperatorStore
from .sqlite import Store


def open_store(url: str | None, data_dir: Path | str) -> OperatorStore:
    """Open the configured store, migrated and writable, or raise StoreError saying why.

    ``url``: ``postgresql://user[:password]@host[:port]/database`` (shared by
    every replica), or None for ``<data_dir>/control-plane.db`` (one process).
    """
    if url is None or not url.strip():
        return Store.open(data_dir)
    from .postgres import PostgresStore  # psycopg is needed only here

    return PostgresStore.open(url.strip())
