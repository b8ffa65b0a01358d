"""inferlb's ADS server: snapshots (what to serve), a cache per node group
(who gets which), and the protocol (when and how it goes out: ``protocol``,
shared by ``sotw`` and ``delta``; ``server`` admits the streams and serves them).

Wiring, in the control plane::

    cache = SnapshotCache()
    server = await serve_xds(cache, "127.0.0.1:18000", metrics=my_prometheus_metrics)
    epoch = make_epoch()
    snapshot = await asyncio.to_thread(Snapshot.from_resources, resources, epoch)
    cache.set_snapshot("inferlb", snapshot)
    ...
    cache.clients()          # for GET /v1/xds/clients
    await stop_xds(server, cache)
"""

from .cache import NodeGroup, SnapshotCache, Watch, XdsCounters, default_node_group
from .clients import ClientStatus, Mode, NackInfo, NoopMetrics, TypeStatus, XdsMetrics
from .server import AggregatedDiscoveryServer, serve_xds, stop_xds
from .snapshot import Snapshot, VersionedResource, changed_types, make_epoch

__all__ = [
    "AggregatedDiscoveryServer",
    "ClientStatus",
    "Mode",
    "NackInfo",
    "NodeGroup",
    "NoopMetrics",
    "Snapshot",
    "SnapshotCache",
    "TypeStatus",
    "VersionedResource",
    "Watch",
    "XdsCounters",
    "XdsMetrics",
    "changed_types",
    "default_node_group",
    "make_epoch",
    "serve_xds",
    "stop_xds",
]
