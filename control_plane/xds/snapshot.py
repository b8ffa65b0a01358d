"""Immutable, pre-serialised xDS snapshots.

A snapshot is the whole configuration one node group should converge to. Every
resource is serialised exactly once, here, into a ``google.protobuf.Any``: a
thousand streams pushing the same 10,000-endpoint ClusterLoadAssignment only
copy bytes, never re-encode it.

Versions are content hashes prefixed with a per-process *epoch*. The hash makes
an unchanged resource keep its version across snapshots (so a weight-only
change touches EDS alone, and Delta clients are not sent what they have); the
epoch makes versions from different control-plane processes never collide, so
an Envoy that reconnects after a restart is never told "you already have this"
about configuration another process built.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping

from envoy.config.cluster.v3 import cluster_pb2
from google.protobuf import any_pb2
from google.protobuf.message import Message

from control_plane.type_urls import CLUSTER, ENDPOINT, PUSH_ORDER

_TYPE_URL_PREFIX = "type.googleapis.com/"
_HASH_HEX = 16


def make_epoch() -> str:
    """A token that differs on every process start (nanosecond wall clock, hex).

    Choose it once at start-up and pass it to every ``Snapshot.from_resources``.
    """
    return f"{time.time_ns():x}"


@dataclass(frozen=True, slots=True)
class VersionedResource:
    """One resource, serialised once; ``version`` changes iff its bytes change."""

    name: str
    version: str
    any: any_pb2.Any


def _digest(parts: Iterable[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for name, version in parts:
        h.update(name.encode())
        h.update(b"\0")
        h.update(version.encode())
        h.update(b"\n")
    return h.hexdigest()[:_HASH_HEX]


def _resource_name(type_url: str, message: Message) -> str:
    # ClusterLoadAssignment names itself by cluster_name; the others by name.
    return message.cluster_name if type_url == ENDPOINT else message.name  # type: ignore[attr-defined]


def _eds_name(cluster: cluster_pb2.Cluster) -> str | None:
    """The ClusterLoadAssignment an EDS cluster waits for while warming, else None."""
    if cluster.WhichOneof("cluster_discovery_type") != "type" or cluster.type != cluster_pb2.Cluster.EDS:
        return None
    return cluster.eds_cluster_config.service_name or cluster.name


@dataclass(frozen=True)
class Snapshot:
    """What one node group should have, per type URL: name -> VersionedResource.

    Build it with :meth:`from_resources`. Never mutate it: streams share it.
    """

    epoch: str
    by_type: Mapping[str, Mapping[str, VersionedResource]]
    versions: Mapping[str, str]
    # Cluster name -> the ClusterLoadAssignment name that cluster needs (EDS clusters only).
    # The server uses it to resend EDS after a cluster changes: Envoy finishes warming
    # an updated cluster only when it receives a ClusterLoadAssignment for it.
    eds_names: Mapping[str, str]

    @classmethod
    def from_resources(cls, resources: Mapping[str, Mapping[str, Message]], epoch: str) -> "Snapshot":
        """Serialise and version every resource.

        This is CPU work (about 2 ms per 10,000 endpoints plus hashing): call it
        in a worker thread, ``await asyncio.to_thread(Snapshot.from_resources, ...)``,
        then hand the result to ``SnapshotCache.set_snapshot`` on the event loop.

        Raises ``ValueError`` for an unknown type URL, a message of the wrong type,
        or a mapping key that differs from the resource's own name (all builder bugs
        that Envoy would otherwise NACK much later).
        """
        unknown = set(resources) - set(PUSH_ORDER)
        if unknown:
            raise ValueError(f"unsupported type URLs: {sorted(unknown)}")
        by_type: dict[str, Mapping[str, VersionedResource]] = {}
        versions: dict[str, str] = {}
        eds_names: dict[str, str] = {}
        for type_url in PUSH_ORDER:
            items: dict[str, VersionedResource] = {}
            for name, message in resources.get(type_url, {}).items():
                if _TYPE_URL_PREFIX + message.DESCRIPTOR.full_name != type_url:
                    raise ValueError(f"{name!r}: a {message.DESCRIPTOR.full_name} is not a {type_url}")
                if _resource_name(type_url, message) != name:
                    raise ValueError(f"{type_url}: key {name!r} differs from the resource's name "
                                     f"{_resource_name(type_url, message)!r}")
                data = message.SerializeToString(deterministic=True)
                version = f"{epoch}.{hashlib.sha256(data).hexdigest()[:_HASH_HEX]}"
                items[name] = VersionedResource(name, version, any_pb2.Any(type_url=type_url, value=data))
                if type_url == CLUSTER:
                    eds = _eds_name(message)  # type: ignore[arg-type]
                    if eds is not None:
                        eds_names[name] = eds
            by_type[type_url] = MappingProxyType(items)
            versions[type_url] = f"{epoch}.{_digest(sorted((n, r.version) for n, r in items.items()))}"
        return cls(epoch, MappingProxyType(by_type), MappingProxyType(versions), MappingProxyType(eds_names))

    def resources(self, type_url: str) -> Mapping[str, VersionedResource]:
        return self.by_type.get(type_url, MappingProxyType({}))

    def version(self, type_url: str) -> str:
        """The SotW version of one type: the epoch plus a hash of its (name, version) pairs."""
        return self.versions.get(type_url, "")

    def changed_types(self, previous: "Snapshot | None") -> frozenset[str]:
        """The type URLs whose content differs from ``previous`` (all of them if None)."""
        if previous is None:
            return frozenset(PUSH_ORDER)
        return frozenset(t for t in PUSH_ORDER if self.version(t) != previous.version(t))


def changed_types(old: Snapshot | None, new: Snapshot) -> frozenset[str]:
    """Which types differ between two snapshots (e.g. a weight-only change: EDS alone)."""
    return new.changed_types(old)


def digest_names(resources: Mapping[str, VersionedResource]) -> str:
    """A short hash of a set of resources, used to version transitional SotW responses."""
    return _digest(sorted((n, r.version) for n, r in resources.items()))
