"""The API keys ext_proc knows: the table the control plane pushes, and the lookup of a client's key.

The control plane sends the live keys as one ``google.protobuf.Struct``
resource (``inferlb_runtime.api_keys``): hashes, never keys. A
:class:`KeyTable` is one accepted table, frozen and replaced as a whole (an
attribute swap on the event loop), so a request never sees half an update;
:meth:`KeyTable.lookup` hashes the bearer key a client sent and finds its
entry in a dict, so a lookup costs one SHA-256 whatever the table's size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from google.protobuf import json_format, struct_pb2
from google.protobuf.message import DecodeError

from inferlb_runtime.api_keys import InvalidKeyTable, KeyEntry, decode_table, hash_key


@dataclass(frozen=True)
class KeyTable:
    """The live keys at one version, by hash. Never mutated: replaced."""

    version: str
    by_hash: Mapping[str, KeyEntry]

    @classmethod
    def of(cls, version: str, entries: Iterable[KeyEntry]) -> KeyTable:
        """A table of ``entries``; :class:`InvalidKeyTable` if two share a hash (one key, two meanings)."""
        by_hash: dict[str, KeyEntry] = {}
        for entry in entries:
            if entry.hash in by_hash:
                raise InvalidKeyTable(f"api key table: keys {by_hash[entry.hash].id} and {entry.id} have the "
                                      "same hash")
            by_hash[entry.hash] = entry
        return cls(version, MappingProxyType(by_hash))

    @classmethod
    def empty(cls, version: str = "") -> KeyTable:
        return cls(version, MappingProxyType({}))

    def lookup(self, key: str) -> KeyEntry | None:
        """The entry of the key a client presented (``api_keys.bearer_key``), or None: unknown or revoked."""
        return self.by_hash.get(hash_key(key))

    def __len__(self) -> int:
        return len(self.by_hash)


def parse_key_table(data: bytes, version: str) -> KeyTable:
    """The table a serialised Struct holds; :class:`InvalidKeyTable` (the NACK's reason) if unusable."""
    struct = struct_pb2.Struct()
    try:
        struct.ParseFromString(data)
    except DecodeError as exc:
        raise InvalidKeyTable(f"api key table does not parse as a Struct: {exc}") from None
    return KeyTable.of(version, decode_table(json_format.MessageToDict(struct)))
