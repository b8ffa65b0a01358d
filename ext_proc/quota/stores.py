"""Open the quota store the configuration names: ``memory`` (one replica) or a Redis URL (shared)."""

from __future__ import annotations

from . import FailureMode, QuotaObserver, QuotaStore, check_store_url
from .memory_store import MemoryQuotaStore
from .redis_store import RedisQuotaStore


def open_quota_store(url: str, failure_mode: FailureMode = "open", timeout_s: float = 0.05,
                     lease_ttl_s: float = 300.0, observer: QuotaObserver | None = None) -> QuotaStore:
    """The store ``url`` names; a Redis store connects at its first check (so start-up never waits on it)."""
    if check_store_url(url) == "memory":
        return MemoryQuotaStore(lease_ttl_s=lease_ttl_s, observer=observer)
    return RedisQuotaStore.from_url(url, failure_mode=failure_mode, timeout_s=timeout_s,
                                    lease_ttl_s=lease_ttl_s, observer=observer)
