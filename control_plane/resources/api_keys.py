"""ext_proc's API key table as one xDS resource: live keys in, a ``google.protobuf.Struct`` out.

Why a Struct and not a message of our own: ext_proc already speaks ADS and
xds-protos ships Struct, so no new .proto has to be compiled and kept in step
on both sides; the content is :func:`inferlb_runtime.api_keys.encode_table`'s,
so the control plane and ext_proc share one encoder and one decoder. Only
ext_proc's node group is served it: Envoy has no use for the type.

Pure: the same entries always give the same bytes (keys sorted by id, Struct
maps serialised deterministically), so an unchanged table keeps its version
and nothing is pushed.
"""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf import struct_pb2

from inferlb_runtime.api_keys import API_KEYS_RESOURCE, KEYS_TYPE_URL, KeyEntry, encode_table

from ..xds.snapshot import Encoded


def build_api_keys(entries: Iterable[KeyEntry]) -> Encoded:
    """The resource ``API_KEYS_RESOURCE`` for these (live) keys."""
    table = struct_pb2.Struct()
    table.update(encode_table(entries))
    return Encoded(KEYS_TYPE_URL, API_KEYS_RESOURCE, table.SerializeToString(deterministic=True))
