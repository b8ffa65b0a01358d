"""The control loop: state in, snapshots out.

Scrape results and operator actions change the ``FleetState``; every change
marks the debouncer; a flush builds the resources and the snapshot in a
thread (serialising 10,000 endpoints must not stall the xDS streams) and sets
it in the cache on the loop. The controller owns the state; everything it
calls is a pure function of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Callable, Mapping

from .config import ControlPlaneConfig, parse_endpoint
from .debounce import Debouncer
from .metrics import ControlPlaneMetrics
from .model import Endpoint, FleetState
from .policy import WeightPolicy, fleet_view, make_weight_policy
from .resources import build_resources
from .scraper import ScrapeResult, apply_scrape_results
from .type_urls import PUSH_ORDER
from .xds import Snapshot, SnapshotCache, make_epoch

log = logging.getLogger("inferlb.control_plane")


def build_snapshot(state: FleetState, epoch: str) -> Snapshot:
    """Resources and their serialised bytes for ``state`` (CPU work: run it in a thread)."""
    return Snapshot.from_resources(build_resources(state), epoch)


def initial_state(config: ControlPlaneConfig) -> FleetState:
    endpoints = tuple(
        Endpoint(address=host, port=port, source="static")
        for host, port in (parse_endpoint(text) for text in config.endpoints)
    )
    return FleetState(endpoints=endpoints, settings=config.data_plane.settings())


class Controller:
    def __init__(
        self,
        config: ControlPlaneConfig,
        cache: SnapshotCache,
        metrics: ControlPlaneMetrics | None = None,
        state: FleetState | None = None,
    ) -> None:
        self.config = config
        self.cache = cache
        self.metrics = metrics
        self.state = state if state is not None else initial_state(config)
        self.policy: WeightPolicy = make_weight_policy(config.weight_policy, config.weight_params)
        self.epoch = make_epoch()
        self.snapshot: Snapshot | None = None
        self.published = asyncio.Event()
        self._debouncer = Debouncer(self.publish, delay=config.debounce_s, max_delay=config.debounce_max_s)
        self._publish_lock = asyncio.Lock()

    async def start(self) -> None:
        """Publish the initial state at once (Envoy should not wait a debounce for its first config)."""
        await self.publish()
        self._debouncer.start()

    async def stop(self) -> None:
        await self._debouncer.stop()

    # -- changing the state -------------------------------------------------
    def update(self, change: Callable[[FleetState], FleetState]) -> FleetState:
        """Apply a pure change; a real change is published after the debounce."""
        new = change(self.state)
        if new != self.state:
            self.state = new
            self._debouncer.mark()
        return new

    def on_scrape_results(self, results: Mapping[str, ScrapeResult]) -> None:
        """Fold a scrape round in, then let the weight policy recompute the weights."""
        now = time.monotonic()

        def change(state: FleetState) -> FleetState:
            endpoints = apply_scrape_results(state.endpoints, results, unhealthy_after=self.config.unhealthy_after)
            weights = self.policy.compute(fleet_view(endpoints, now, self.config.stale_after_s))
            endpoints = tuple(
                dataclasses.replace(e, computed_weight=weights[e.id])
                if e.id in weights and weights[e.id] != e.computed_weight
                else e
                for e in endpoints
            )
            return dataclasses.replace(state, endpoints=endpoints)

        before = {e.id: (e.health, e.computed_weight) for e in self.state.endpoints}
        after = self.update(change)
        for e in after.endpoints:
            if e.id in before and before[e.id][0] != e.health:
                log.warning("endpoint health changed", extra={"endpoint": e.id, "health": e.health.value})

    def set_policy(self, policy: WeightPolicy) -> None:
        self.policy = policy

    # -- publishing ---------------------------------------------------------
    async def publish(self) -> None:
        async with self._publish_lock:
            state = self.state
            started = time.perf_counter()
            snapshot = await asyncio.to_thread(build_snapshot, state, self.epoch)
            changed = snapshot.changed_types(self.snapshot) if self.snapshot is not None else frozenset(PUSH_ORDER)
            self.cache.set_default_snapshot(snapshot)
            self.snapshot = snapshot
            self.published.set()
            seconds = time.perf_counter() - started
            if self.metrics is not None:
                self.metrics.snapshot_published(changed, seconds)
            if changed:
                log.debug("snapshot published", extra={"changed": sorted(changed), "build_s": round(seconds, 4)})
