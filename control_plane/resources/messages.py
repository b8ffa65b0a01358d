"""Small protobuf constructors every resource builder needs.

Kept in one place so that every builder writes a duration, a packed ``Any``
or an ADS config source the same way: the xDS server versions resources by
the hash of their deterministic bytes, and ``pack`` is where determinism is
asked for.
"""

from __future__ import annotations

from google.protobuf import any_pb2, duration_pb2, wrappers_pb2
from google.protobuf.message import Message

from envoy.config.core.v3 import address_pb2, config_source_pb2


def duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(round(seconds * 1e9))
    return value


def pack(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message, deterministic=True)
    return packed


def u32(value: int) -> wrappers_pb2.UInt32Value:
    return wrappers_pb2.UInt32Value(value=value)


def ads() -> config_source_pb2.ConfigSource:
    """A config source that says: over the same ADS stream."""
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(), resource_api_version=config_source_pb2.V3,
    )


def socket_address(address: str, port: int) -> address_pb2.Address:
    return address_pb2.Address(socket_address=address_pb2.SocketAddress(address=address, port_value=port))
