"""The servicer's live state, as the metrics endpoint reads it at each scrape."""

from __future__ import annotations

import math

from .metrics import LiveState
from .pick.outstanding import OutstandingLoad
from .pick.router import Router
from .xds.fleet_view import ViewSource


def live_state(router: Router, source: ViewSource, policy: str, active_streams: int) -> LiveState:
    view = source.view
    outstanding = router.outstanding.snapshot()  # a fresh dict of frozen loads
    if view is not None:
        for endpoint in view.by_id:
            outstanding.setdefault(endpoint, OutstandingLoad())
    mape = router.cost.mape()
    return LiveState(
        outstanding=outstanding,
        mape=mape if math.isfinite(mape) else None,
        mape_by_endpoint=router.cost.mape_by_endpoint(),
        observations=router.cost.observations,
        leaked=router.outstanding.leaked,
        xds_connected=source.connected,
        view_version=view.version if view is not None else None,
        endpoints=len(view.endpoints) if view is not None else 0,
        routable=len(view.routable) if view is not None else 0,
        policy=policy,
        active_streams=active_streams,
        partition=router.partition.partition,
    )
