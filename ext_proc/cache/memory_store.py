"""The gateway cache's in-process level: whole worker answers by request key, bounded in bytes, LRU, TTL.

Why here: a repeated request answered by ext_proc never takes a worker's time, nor a trip through the
fleet. Entries carry the model version that produced them, so a catalogue that no longer lists a version
drops its answers at once (a new version never serves old vectors; the key has the version too).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

# What an entry costs beyond its body and key (the dict slot, the tuple, the dataclass): an estimate, so
# many tiny answers cannot overrun the byte bound unseen.
ENTRY_OVERHEAD_BYTES = 256


@dataclass(frozen=True)
class CachedResponse:
    """A worker's 200 answer, as the client got it."""

    body: bytes
    content_type: str
    version: str  # the model version that served (x-inferlb-model)

    @property
    def size(self) -> int:
        return len(self.body) + len(self.content_type) + len(self.version) + ENTRY_OVERHEAD_BYTES


@dataclass(frozen=True)
class _Entry:
    response: CachedResponse
    expires: float


class ResponseCache:
    """LRU by bytes with a TTL; one per ext_proc process, used on its event loop only (no lock)."""

    def __init__(self, max_bytes: int, ttl_s: float, max_entry_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_bytes <= 0 or ttl_s <= 0 or max_entry_bytes <= 0:
            raise ValueError("max_bytes, ttl_s and max_entry_bytes must be positive")
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.max_entry_bytes = min(max_entry_bytes, max_bytes)
        self._clock = clock
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self.bytes = 0
        self.evictions = 0  # entries dropped for room (not expiries, not version drops)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> CachedResponse | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires <= self._clock():
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return entry.response

    def fits(self, size: int) -> bool:
        """Whether an answer of ``size`` body bytes may be stored (the per-entry cap)."""
        return size + ENTRY_OVERHEAD_BYTES <= self.max_entry_bytes

    def put(self, key: bytes, response: CachedResponse) -> bool:
        """Store (replacing an entry under the key); False when over the per-entry cap. Evicts the least
        recently used entries until it fits."""
        size = response.size + len(key)
        if size > self.max_entry_bytes:
            return False
        if key in self._entries:
            self._drop(key)
        while self.bytes + size > self.max_bytes and self._entries:
            self._drop(next(iter(self._entries)))
            self.evictions += 1
        self._entries[key] = _Entry(response, self._clock() + self.ttl_s)
        self.bytes += size
        return True

    def retain_versions(self, versions: Collection[str]) -> int:
        """Drop the answers of versions not in ``versions`` (the catalogue changed); how many went."""
        gone = [k for k, e in self._entries.items() if e.response.version not in versions]
        for key in gone:
            self._drop(key)
        return len(gone)

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.response.size + len(key)
