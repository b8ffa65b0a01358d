"""Operator state that survives restarts and is shared by control-plane replicas.

* ``base``: what is stored (``OperatorState``), the ``OperatorStore`` contract,
  and how stored state folds into the fleet (``restore``, ``reconcile``).
* ``sqlite``: the embedded default, one process (``Store``).
* ``postgres``: the shared store for several replicas (``PostgresStore``),
  with a LISTEN/NOTIFY change feed.
* ``opening``: which one, from the ``store`` setting (``INFERLB_STORE``).
* ``follow``: apply the changes other replicas make.
* ``usage``: usage for billing, its table and the SQL both stores run.
* ``rollouts``: model rollouts, their table and row codec (both stores).
"""

from .base import (
    OperatorState,
    OperatorStore,
    Override,
    PolicyKind,
    StoreChange,
    StoredApiKey,
    StoredPolicy,
    StoredRollout,
    StoreError,
    live_key_entries,
    reconcile,
    restore,
)
from .opening import open_store
from .sqlite import DB_NAME, MIGRATIONS, SCHEMA_VERSION, Store
from .usage import COUNTER_COLUMNS, OUTCOMES, UsageBucket, UsageRow

__all__ = [
    "COUNTER_COLUMNS",
    "OUTCOMES",
    "UsageBucket",
    "UsageRow",
    "DB_NAME",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "OperatorState",
    "OperatorStore",
    "Override",
    "PolicyKind",
    "Store",
    "StoreChange",
    "StoreError",
    "StoredApiKey",
    "StoredPolicy",
    "StoredRollout",
    "live_key_entries",
    "open_store",
    "reconcile",
    "restore",
]
