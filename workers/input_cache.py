"""The worker's per-input cache: (model version, token ids) -> the embedding computed for them.

Why per input and keyed by token ids: repeated work in embedding traffic is
mostly the same text (a popular query, a document re-indexed) inside
otherwise different requests, so a whole-request cache (ext_proc's) misses
it; and two texts that tokenise alike (case, spacing the tokenizer drops)
are the same work. The version is part of the key, so a new version never
answers with an old one's vectors.

What is stored is the float32 row exactly as the model returned it, so a hit
is bit-identical to the computation that filled the entry. That computation
is not always bit-identical to a later one of the same input: the int8
version quantises activations per batch (its output for an input moves by up
to ~1e-2 with its batch companions) and fp32's padding changes the last bits.
A hit therefore returns the FIRST computation's vector.

Bounded in bytes with least-recently-used eviction. An entry is charged its
vector's bytes plus 4 per token id of its key: an estimate of what it pins,
not Python's exact overhead.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

ID_BYTES = 4  # what a token id is charged in an entry's size


@dataclass(frozen=True)
class CacheKey:
    model: str
    ids: tuple[int, ...]

    @classmethod
    def of(cls, model: str, ids: Sequence[int]) -> CacheKey:
        return cls(model, tuple(ids))


class CacheObserver(Protocol):
    """What the cache reports; the worker's metrics implement it."""

    def cache_bytes(self, size: int) -> None: ...

    def cache_evicted(self, entries: int) -> None: ...


@dataclass
class InputCache:
    """An LRU map of ``CacheKey`` to read-only vectors, at most ``max_bytes`` in all (0: stores nothing)."""

    max_bytes: int
    observer: CacheObserver | None = None
    _entries: OrderedDict[CacheKey, np.ndarray] = field(default_factory=OrderedDict)
    _bytes: int = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: CacheKey) -> np.ndarray | None:
        """The stored vector (now the most recently used), or None."""
        vector = self._entries.get(key)
        if vector is not None:
            self._entries.move_to_end(key)
        return vector

    def put(self, key: CacheKey, vector: np.ndarray) -> None:
        """Store a copy of ``vector`` (a row of a batch must not pin the whole batch), evicting the least
        recently used entries to fit; an entry larger than the whole cache is not stored."""
        cost = _cost(key, vector)
        if cost > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= _cost(key, old)
        stored = np.array(vector, copy=True)  # as computed: same dtype, same bits
        stored.flags.writeable = False
        self._entries[key] = stored
        self._bytes += cost
        evicted = 0
        while self._bytes > self.max_bytes:
            victim, victim_vector = self._entries.popitem(last=False)
            self._bytes -= _cost(victim, victim_vector)
            evicted += 1
        if self.observer is not None:
            if evicted:
                self.observer.cache_evicted(evicted)
            self.observer.cache_bytes(self._bytes)


def _cost(key: CacheKey, vector: np.ndarray) -> int:
    return int(vector.nbytes) + ID_BYTES * len(key.ids)
