"""The canonical protobuf encoding of ``google.protobuf.Struct`` values, written by hand.

Why by hand: the ext_proc variant of the ClusterLoadAssignment carries a metadata Struct per
endpoint, and building those as messages in Python took most of a second for 10,000 endpoints.
These functions give the very bytes protobuf's deterministic serialisation gives (tests check it),
with bounded ``functools.lru_cache``s on pure functions: the same input always gives the same
bytes, a miss only costs time. (One exception: Struct keys are sorted in code-point order, as C++
protobuf does, while upb puts "ab" before "a"; only pick-policy params could have such keys, and
the bytes are deterministic either way.)
"""

from __future__ import annotations

import enum
import functools
import struct
from collections.abc import Mapping, Sequence

from inferlb_runtime.protowire import len_field, varint

# Enough for two or three generations of a 10,000-endpoint fleet.
CACHE_SIZE = 1 << 15




# Struct / Value / ListValue (google/protobuf/struct.proto), canonical encoding.
FIXED64 = struct.Struct("<d").pack
_STRUCT_FIELDS = b"\x0a"  # Struct.fields = 1 (map entries: key = 1, value = 2)
_VALUE_NULL = b"\x08\x00"  # Value.null_value = 1 (NULL_VALUE = 0)
VALUE_NUMBER = b"\x11"  # Value.number_value = 2 (double)
_VALUE_STRING = b"\x1a"  # Value.string_value = 3
_VALUE_TRUE, _VALUE_FALSE = b"\x20\x01", b"\x20\x00"  # Value.bool_value = 4
_VALUE_STRUCT = b"\x2a"  # Value.struct_value = 5
_VALUE_LIST = b"\x32"  # Value.list_value = 6
_LIST_VALUES = b"\x0a"  # ListValue.values = 1


@functools.lru_cache(maxsize=1024)
def map_key(key: str) -> bytes:
    return len_field(b"\x0a", key.encode())


@functools.lru_cache(maxsize=1024)
def number_entry_prefix(key: str) -> bytes:
    """A Struct map entry holding a number is this prefix plus the 8 bytes of the double."""
    key_field = map_key(key)
    return b"\x0a" + varint(len(key_field) + 11) + key_field + b"\x12\x09" + VALUE_NUMBER


def _value_entry(key: str, value: bytes) -> bytes:
    return len_field(_STRUCT_FIELDS, map_key(key) + len_field(b"\x12", value))


@functools.lru_cache(maxsize=1024, typed=True)
def _constant_entry(key: str, item: bool | None) -> bytes:
    return _value_entry(key, _encode_value(item))


@functools.lru_cache(maxsize=CACHE_SIZE)
def _string_entry(key: str, item: str) -> bytes:
    return _value_entry(key, len_field(_VALUE_STRING, item.encode()))


def struct_entry(key: str, item: object) -> bytes:
    """One ``Struct.fields`` map entry."""
    cls = item.__class__
    if cls is float or cls is int:  # the common case (never a bool)
        return number_entry_prefix(key) + FIXED64(item)
    if cls is str:  # ids, health: few distinct values
        return _string_entry(key, item)  # type: ignore[arg-type]
    if item is None or item is True or item is False:
        return _constant_entry(key, item)
    return len_field(_STRUCT_FIELDS, map_key(key) + len_field(b"\x12", _encode_value(item)))


def _encode_value(obj: object) -> bytes:
    """JSON-like Python value -> the bytes of a ``google.protobuf.Value``; anything else is a caller bug."""
    if obj is None:
        return _VALUE_NULL
    if isinstance(obj, bool):
        return _VALUE_TRUE if obj else _VALUE_FALSE
    if isinstance(obj, (int, float)):
        return VALUE_NUMBER + FIXED64(float(obj))
    if isinstance(obj, str):
        return len_field(_VALUE_STRING, obj.encode())
    if isinstance(obj, enum.Enum):
        return _encode_value(obj.value)
    if isinstance(obj, Mapping):
        return len_field(_VALUE_STRUCT, encode_struct(obj))
    if isinstance(obj, Sequence):
        return len_field(_VALUE_LIST, b"".join(len_field(_LIST_VALUES, _encode_value(item)) for item in obj))
    raise TypeError(f"cannot put {type(obj).__name__} into EDS metadata: {obj!r}")


def encode_struct(mapping: Mapping[object, object]) -> bytes:
    """The bytes of a ``google.protobuf.Struct``, map entries sorted by key (code points)."""
    fields = {str(key): item for key, item in mapping.items()}
    return b"".join([struct_entry(key, fields[key]) for key in sorted(fields)])
