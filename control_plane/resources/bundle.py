"""Every resource of one node group, by type URL: what the controller turns into a snapshot.

Why a module of its own: the split between what depends on the settings alone (CDS, LDS, RDS:
the same for every node group, rebuilt only when the settings change) and what depends on the
fleet (EDS, per node group) is the reason a weight change re-sends EDS and nothing else.
"""

from __future__ import annotations

from google.protobuf.message import Message

from .. import type_urls
from ..model import DataPlaneSettings, FleetState
from .clusters import build_collector_cluster, build_ext_proc_cluster, build_workers_cluster
from .endpoints import build_load_assignment
from .listener import build_listener
from .routes import build_route_configuration


def build_static_resources(settings: DataPlaneSettings) -> dict[str, dict[str, Message]]:
    """CDS, LDS and RDS: what depends on the settings alone (the same for every node group)."""
    clusters: dict[str, Message] = {settings.workers_cluster: build_workers_cluster(settings)}
    if settings.ext_proc.enabled:  # disabled: no filter calls it, so no cluster either
        clusters[settings.ext_proc_cluster] = build_ext_proc_cluster(settings)
    if settings.tracing is not None:  # before the listener that names it (Envoy takes CDS before LDS)
        clusters[settings.tracing_cluster] = build_collector_cluster(settings)
    return {
        type_urls.CLUSTER: clusters,
        type_urls.LISTENER: {settings.listener_name: build_listener(settings)},
        type_urls.ROUTE: {settings.route_name: build_route_configuration(settings)},
    }


def build_resources(state: FleetState, *, ext_proc: bool = False) -> dict[str, dict[str, Message]]:
    """Type URL -> resource name -> message: the whole snapshot of one node group for one state.

    ``ext_proc=False``: the Envoys' snapshot; ``ext_proc=True``: ext_proc's (the rich EDS).
    """
    resources = build_static_resources(state.settings)
    resources[type_urls.ENDPOINT] = {state.settings.workers_cluster: build_load_assignment(state, ext_proc=ext_proc)}
    return resources
