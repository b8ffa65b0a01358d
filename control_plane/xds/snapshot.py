"""Immutable, pre-serialised xDS snapshots.

A snapshot is the whole configuration one node group should converge to. Every
resource is serialised exactly once, here, into a ``google.protobuf.Any``: a
thousand streams pushing the same 10,000-endpoint ClusterLoadAssignment only
copy bytes, never re-encode it.

Each resource is also encoded, once, as the ``resources`` entry of a SotW
``DiscoveryResponse`` and of a ``DeltaDiscoveryResponse``: the server sends
pre-serialised responses that are these entries plus a small per-stream header
(version, type URL, nonce), so a push to many streams neither copies the big
Any into a new message per stream nor re-encodes it per stream.

Versions are content hashes prefixed with a per-process *epoch*. The hash makes
an unchanged resource keep its version across snapshots (so a weight-only
change touches EDS alone, and Delta clients are not sent what they have); the
epoch makes versions from different control-plane processes never collide, so
an Envoy that reconnects after a restart is never told "you already have this"
about configuration another process built.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterable, Mapping

from envoy.config.cluster.v3 import cluster_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2
from google.protobuf.message import Message

from ..type_urls import CLUSTER, ENDPOINT, EXTENSION_TYPES, SERVED_TYPES

_TYPE_URL_PREFIX = "type.googleapis.com/"
_HASH_HEX = 16


def make_epoch() -> str:
    """A token that differs on every process start: nanosecond wall clock and 32 random bits, hex.

    The random part keeps control-plane replicas that start in the same instant
    (or on machines whose clocks disagree) from ever sharing an epoch. Choose it
    once at start-up and pass it to every ``Snapshot.from_resources``.
    """
    return f"{time.time_ns():x}{secrets.randbits(32):08x}"


@dataclass(frozen=True, slots=True)
class Encoded:
    """A resource its builder already serialised (deterministically): used as is, never re-encoded.

    ``name`` must be the resource's own name (its ``name``, or ``cluster_name``
    for a ClusterLoadAssignment); the builder vouches for it and for the type.
    """

    type_url: str
    name: str
    data: bytes


@dataclass(frozen=True, slots=True)
class VersionedResource:
    """One resource, serialised once; ``version`` changes iff its bytes change.

    ``sotw_entry`` / ``delta_entry``: the resource encoded as one ``resources``
    entry of a ``DiscoveryResponse`` / ``DeltaDiscoveryResponse`` (empty when
    built by hand; the server then encodes it itself).
    """

    name: str
    version: str
    any: any_pb2.Any
    sotw_entry: bytes = field(default=b"", repr=False, compare=False)
    delta_entry: bytes = field(default=b"", repr=False, compare=False)

    @classmethod
    def encode(cls, type_url: str, name: str, data: bytes, epoch: str) -> "VersionedResource":
        """Version ``data`` by its hash under ``epoch`` and encode its response entries."""
        version = f"{epoch}.{hashlib.sha256(data).hexdigest()[:_HASH_HEX]}"
        packed = any_pb2.Any(type_url=type_url, value=data)
        sotw = discovery_pb2.DiscoveryResponse(resources=[packed]).SerializeToString()
        delta = discovery_pb2.DeltaDiscoveryResponse(resources=[
            discovery_pb2.Resource(name=name, version=version, resource=packed)]).SerializeToString()
        return cls(name, version, packed, sotw, delta)


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


def _versioned(type_url: str, name: str, resource: Message | Encoded, epoch: str) -> VersionedResource:
    if isinstance(resource, Encoded):
        if resource.type_url != type_url:
            raise ValueError(f"{name!r}: a {resource.type_url} is not a {type_url}")
        if resource.name != name:
            raise ValueError(f"{type_url}: key {name!r} differs from the resource's name {resource.name!r}")
        return VersionedResource.encode(type_url, name, resource.data, epoch)
    if _TYPE_URL_PREFIX + resource.DESCRIPTOR.full_name != type_url:
        raise ValueError(f"{name!r}: a {resource.DESCRIPTOR.full_name} is not a {type_url}")
    if _resource_name(type_url, resource) != name:
        raise ValueError(f"{type_url}: key {name!r} differs from the resource's name "
                         f"{_resource_name(type_url, resource)!r}")
    return VersionedResource.encode(type_url, name, resource.SerializeToString(deterministic=True), epoch)


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
    def from_resources(cls, resources: Mapping[str, Mapping[str, Message | Encoded]], epoch: str) -> "Snapshot":
        """Serialise, version and encode every resource (``Encoded`` ones are taken as they are).

        This is CPU work (a few ms per 10,000 endpoints: hashing and copying): call it
        in a worker thread, ``await asyncio.to_thread(Snapshot.from_resources, ...)``,
        then hand the result to ``SnapshotCache.set_snapshot`` on the event loop.

        Raises ``ValueError`` for an unknown type URL, a resource of the wrong type,
        or a mapping key that differs from the resource's own name (all builder bugs
        that Envoy would otherwise NACK much later).
        """
        return cls._build(resources, epoch, None)

    def replace_type(self, type_url: str, resources: Mapping[str, Message | Encoded]) -> "Snapshot":
        """This snapshot with the resources of one type replaced (the others shared, not re-encoded).

        E.g. the ext_proc group's snapshot: the Envoys' one with a richer EDS.
        """
        return self.replace_types({type_url: resources})

    def replace_types(self, resources: Mapping[str, Mapping[str, Message | Encoded]]) -> "Snapshot":
        """This snapshot with the resources of the given types replaced (or added: ext_proc's key table)."""
        return self._build(resources, self.epoch, self)

    @classmethod
    def _build(cls, resources: Mapping[str, Mapping[str, Message | Encoded]], epoch: str,
               base: "Snapshot | None") -> "Snapshot":
        unknown = set(resources) - set(SERVED_TYPES)
        if unknown:
            raise ValueError(f"unsupported type URLs: {sorted(unknown)}")
        by_type: dict[str, Mapping[str, VersionedResource]] = {}
        versions: dict[str, str] = {}
        eds_names: dict[str, str] = {}
        for type_url in SERVED_TYPES:
            if type_url not in resources:
                if base is not None and type_url in base.by_type:
                    by_type[type_url] = base.resources(type_url)
                    versions[type_url] = base.version(type_url)
                    if type_url == CLUSTER:
                        eds_names.update(base.eds_names)
                    continue
                if type_url in EXTENSION_TYPES:
                    continue  # carried only when given: a group whose snapshot lacks it is never sent it
            items: dict[str, VersionedResource] = {}
            for name, resource in resources.get(type_url, {}).items():
                items[name] = _versioned(type_url, name, resource, epoch)
                if type_url == CLUSTER:
                    if isinstance(resource, Encoded):
                        resource = cluster_pb2.Cluster.FromString(resource.data)
                    eds = _eds_name(resource)  # type: ignore[arg-type]
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
            return frozenset(self.by_type)
        return frozenset(t for t in SERVED_TYPES if self.version(t) != previous.version(t))


def changed_types(old: Snapshot | None, new: Snapshot) -> frozenset[str]:
    """Which types differ between two snapshots (e.g. a weight-only change: EDS alone)."""
    return new.changed_types(old)


def digest_names(resources: Mapping[str, VersionedResource]) -> str:
    """A short hash of a set of resources, used to version transitional SotW responses."""
    return _digest(sorted((n, r.version) for n, r in resources.items()))
