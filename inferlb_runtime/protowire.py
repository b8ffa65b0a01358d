"""Protobuf's wire format, the two primitives both services write by hand on their hot paths.

The control plane encodes EDS metadata Structs for 10,000 endpoints
(``control_plane/resources/struct_wire.py``) and ext_proc its per-request answers
(``ext_proc/wire.py``) faster than building messages in Python would; both need only varints
and length-delimited fields.
"""

from __future__ import annotations

ONE_BYTE = [bytes((n,)) for n in range(128)]  # the varints of 0..127: most lengths, inlined on hot paths


def varint(value: int) -> bytes:
    """A non-negative integer as a base-128 varint."""
    if value < 0x80:
        return ONE_BYTE[value]
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def len_field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (sub-message, string, bytes): its ``tag`` (key), length, payload."""
    n = len(payload)
    return tag + (ONE_BYTE[n] if n < 128 else varint(n)) + payload
