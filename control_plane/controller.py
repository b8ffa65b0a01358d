"""The control loop: state in, snapshots out.

Scrape results and operator actions change the ``FleetState``; every change
marks the debouncer; a flush builds the resources and the snapshots in a
thread (serialising 10,000 endpoints must not stall the xDS streams) and sets
them in the cache on the loop. The controller owns the state; everything it
calls is a pure function of it.

Two snapshots per state: the Envoys' (the cache's default, lean EDS: address,
health, weight) and ext_proc's (node group
``DataPlaneSettings.ext_proc_node_cluster``: the same CDS/LDS/RDS, EDS with
the telemetry and pick-policy metadata). A telemetry-only change leaves the
Envoys' one unchanged: nothing is pushed to Envoys. ext_proc's also carries
the API key table (``resources.api_keys``); a created or revoked key replaces
just that in ext_proc's current snapshot, at once (``set_api_keys``), without
waiting for a publish.

Envoys first: when the Envoys' EDS changed, ext_proc's snapshot is built only
once every Envoy has acknowledged it (or after ``ENVOYS_FIRST_MAX_WAIT_S``;
a stream that never answered an EDS is not waited for, and one that misses
that deadline not again until it answers, so a client that never ACKs cannot
slow publishes: ``SnapshotCache.wait_default_settled``).
Make before break: ext_proc never picks an endpoint its Envoy does not know
yet (override_host would fall back). And building the rich EDS is pure Python
that holds the GIL: run while Envoys are being pushed to, it slowed their
convergence about twofold (10,000 endpoints).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Callable, Iterable, Mapping, Sequence

from inferlb_runtime.api_keys import KeyEntry

from .config import ControlPlaneConfig, parse_endpoint
from .debounce import Debouncer
from .discovery.model import DiscoverySnapshot, DiscoverySource
from .discovery.reconcile import Override, Reconciled, SourceMemory, reconcile
from .metrics import ControlPlaneMetrics
from .model import Endpoint, FleetState, Health
from .policies.contract import WeightPolicy, fleet_view
from .policies.guard import WeightPolicyGuard
from .policies.registry import WeightPolicyRegistry
from .resources import EndpointMemo, build_api_keys, build_static_resources, encode_load_assignment
from .telemetry.scraper import ScrapeResult, apply_scrape_results
from .type_urls import ENDPOINT, KEYS
from .xds import Snapshot, SnapshotCache, make_epoch
from .xds.snapshot import Encoded

log = logging.getLogger("inferlb.control_plane")

# How long ext_proc's snapshot waits for the Envoys to acknowledge a new EDS (see above).
ENVOYS_FIRST_MAX_WAIT_S = 0.5


def _eds(state: FleetState, ext_proc: bool, memo: EndpointMemo | None,
         replicas: Sequence[str] = ()) -> dict[str, Encoded]:
    name = state.settings.workers_cluster
    return {name: Encoded(ENDPOINT, name, encode_load_assignment(state, ext_proc=ext_proc, memo=memo,
                                                                 replicas=replicas))}


def build_snapshot(state: FleetState, epoch: str, memo: EndpointMemo | None = None) -> Snapshot:
    """The Envoys' snapshot of ``state`` (CPU work: run it in a thread). ``memo``: see ``EndpointMemo``."""
    resources = {**build_static_resources(state.settings), ENDPOINT: _eds(state, False, memo)}
    return Snapshot.from_resources(resources, epoch)


def build_ext_proc_snapshot(state: FleetState, envoy_snapshot: Snapshot, memo: EndpointMemo | None = None,
                            replicas: Sequence[str] = (), api_keys: Encoded | None = None) -> Snapshot:
    """ext_proc's snapshot: ``envoy_snapshot`` (built from the same ``state``) with the rich EDS
    (``replicas``: the connected ext_proc node ids, which they partition a large fleet by) and the API key
    table (``resources.build_api_keys``; None: an empty one)."""
    keys = api_keys if api_keys is not None else build_api_keys(())
    return envoy_snapshot.replace_types({ENDPOINT: _eds(state, True, memo, replicas), KEYS: {keys.name: keys}})


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
        policy: WeightPolicy | None = None,
        api_keys: Iterable[KeyEntry] = (),
    ) -> None:
        self.config = config
        self.cache = cache
        self.metrics = metrics
        self.state = state if state is not None else initial_state(config)
        if policy is None:
            policy = WeightPolicyRegistry(config.policy_allowlist).make(config.weight_policy, config.weight_params)
        # The active policy, contained: a failing, garbage-returning or slow one gets the default's weights.
        self.guard = WeightPolicyGuard(policy)
        self.epoch = make_epoch()
        self.snapshot: Snapshot | None = None  # the Envoys' (the cache's default)
        self.ext_proc_snapshot: Snapshot | None = None
        self.published_state: FleetState | None = None  # the state the Envoys' current snapshot was built from
        self.published_replicas: tuple[str, ...] = ()  # the ext_proc node ids ext_proc's snapshot lists
        self.api_keys: tuple[KeyEntry, ...] = tuple(api_keys)  # the live keys ext_proc is told of
        self._api_keys_resource = build_api_keys(self.api_keys)
        self._active_replicas: frozenset[str] = frozenset()  # those that carried traffic at the last look
        self._memos = (EndpointMemo(), EndpointMemo())  # Envoys', ext_proc's: used under _publish_lock only
        self.published = asyncio.Event()
        self._debouncer = Debouncer(self.publish, delay=config.debounce_s, max_delay=config.debounce_max_s,
                                    observer=metrics)
        # Failing now? (a failed publish is logged, counted and retried; /readyz says not ready meanwhile)
        self.publishing = self._debouncer.publishing
        self._publish_lock = asyncio.Lock()
        self._listeners: list[Callable[[FleetState], None]] = []  # see add_listener
        self._discovery: dict[DiscoverySource, SourceMemory] = {}  # per discovery source
        if metrics is not None:
            metrics.count_laggards(lambda: len(cache.laggards()))

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
            for listener in self._listeners:
                listener(new)
        return new

    async def set_api_keys(self, entries: Iterable[KeyEntry]) -> None:
        """Make ``entries`` the live API keys and push them to ext_proc now (not after the debounce: a
        revoked key should stop working at once); returns once ext_proc's snapshot has them."""
        keys = tuple(entries)
        if keys == self.api_keys:
            return
        self.api_keys = keys
        self._api_keys_resource = resource = await asyncio.to_thread(build_api_keys, keys)
        async with self._publish_lock:  # a publish under way builds from the table it read: replace after it
            current = self.ext_proc_snapshot
            if current is None or self._api_keys_resource is not resource:
                return  # the first publish carries it, or a later call already replaced it
            started = time.perf_counter()
            snapshot = await asyncio.to_thread(current.replace_type, KEYS, {resource.name: resource})
            self.cache.set_snapshot(self.state.settings.ext_proc_node_cluster, snapshot)
            self.ext_proc_snapshot = snapshot
            if self.metrics is not None:
                self.metrics.snapshot_published(snapshot.changed_types(current), time.perf_counter() - started)
            log.info("API key table pushed", extra={"keys": len(keys), "version": snapshot.version(KEYS)})

    def add_listener(self, listener: Callable[[FleetState], None]) -> None:
        """Call ``listener(state)`` on every real change (another data plane, e.g. NGINX, follows the state)."""
        self._listeners.append(listener)

    def on_scrape_results(self, results: Mapping[str, ScrapeResult]) -> None:
        """Fold a scrape round in, then let the weight policy recompute the weights."""
        now = time.monotonic()

        not_ready = self.discovery_not_ready()
        if not_ready:  # discovery holds these unhealthy: a scrape must not make them routable
            results = {k: v for k, v in results.items() if k not in not_ready}

        def change(state: FleetState) -> FleetState:
            endpoints = apply_scrape_results(state.endpoints, results, unhealthy_after=self.config.unhealthy_after)
            weights = self.guard.compute(fleet_view(endpoints, now, self.config.stale_after_s), self.metrics)
            endpoints = tuple(
                dataclasses.replace(e, computed_weight=weights[e.id])
                if e.id in weights and weights[e.id] != e.computed_weight
                else e
                for e in endpoints
            )
            return dataclasses.replace(state, endpoints=endpoints)

        before = {e.id: e for e in self.state.endpoints}
        if self.ext_proc_replicas() != self.published_replicas:  # one joined or left: re-publish the list
            self._debouncer.mark()
        after = self.update(change)
        for e in after.endpoints:
            old = before.get(e.id)
            if old is None:
                continue
            if old.health != e.health:  # back to healthy is good news (INFO); anything else needs a look
                level = logging.INFO if e.health is Health.HEALTHY else logging.WARNING
                log.log(level, "endpoint health changed", extra={"endpoint": e.id, "health": e.health.value})
            if (old.models, old.model_aliases, old.pool) != (e.models, e.model_aliases, e.pool):
                log.info("endpoint models changed", extra={"endpoint": e.id, "models": list(e.models),
                                                           "model_aliases": list(e.model_aliases), "pool": e.pool})

    @property
    def policy(self) -> WeightPolicy:
        """The active weight policy."""
        return self.guard.policy

    def set_policy(self, policy: WeightPolicy) -> None:
        """Make ``policy`` the active one, with a guard of its own (its failure record starts clean)."""
        if policy is not self.guard.policy:
            self.guard = WeightPolicyGuard(policy)

    # -- discovery (control_plane.discovery) ----------------------------------
    def seed_discovery_overrides(self, source: DiscoverySource, overrides: Mapping[str, Override]) -> None:
        """Stored pins/drains for endpoints ``source`` has not found yet: applied when it does."""
        self._discovery[source] = self._discovery.get(source, SourceMemory()).seed(overrides)

    def sync_source(self, snapshot: DiscoverySnapshot) -> Reconciled:
        """Make the endpoints of ``snapshot.source`` exactly ``snapshot.endpoints`` (see ``discovery.reconcile``)."""
        memory = self._discovery.get(snapshot.source, SourceMemory())
        result = reconcile(self.state.endpoints, snapshot.source, snapshot.endpoints, memory)
        self._discovery[snapshot.source] = result.memory
        self.update(lambda state: dataclasses.replace(state, endpoints=result.endpoints))
        if result.added or result.removed or result.changed:
            log.info("discovered endpoints changed", extra={
                "source": snapshot.source, "added": list(result.added), "removed": list(result.removed),
                "changed": list(result.changed), "not_ready": sorted(result.memory.not_ready)})
        return result

    def discovery_not_ready(self) -> frozenset[str]:
        return frozenset().union(*(m.not_ready for m in self._discovery.values()))

    # -- publishing ---------------------------------------------------------
    def ext_proc_replicas(self) -> tuple[str, ...]:
        """The ext_proc replicas a large fleet is partitioned among, sorted (as of now; published with the
        next snapshot): the connected ones that carry traffic, or every connected one when none does
        (``replica_activity``)."""
        connected = self.cache.node_ids(self.state.settings.ext_proc_node_cluster)
        active = tuple(node for node in connected if node in self._active_replicas)
        return active or connected

    def ext_proc_targets(self) -> Mapping[str, tuple[str, int]]:
        """The connected ext_proc replicas' /metrics (node id -> peer IP, port)."""
        return self.cache.metrics_targets(self.state.settings.ext_proc_node_cluster)

    def set_active_replicas(self, active: frozenset[str]) -> None:
        """The replicas that carried traffic since the last look; re-publish when the partitions change."""
        if active != self._active_replicas:
            log.info("ext_proc replicas carrying traffic changed", extra={"active": sorted(active)})
            self._active_replicas = active
        if self.ext_proc_replicas() != self.published_replicas:
            self._debouncer.mark()

    async def publish(self) -> None:
        """Build and set the Envoys' snapshot, then ext_proc's (metrics: the union of their changes)."""
        async with self._publish_lock:
            state = self.state
            started = time.perf_counter()
            snapshot = await asyncio.to_thread(build_snapshot, state, self.epoch, self._memos[0])
            changed = snapshot.changed_types(self.snapshot)
            self.cache.set_default_snapshot(snapshot)
            self.snapshot = snapshot
            self.published_state = state
            if ENDPOINT in changed:
                await self.cache.wait_default_settled(ENDPOINT, ENVOYS_FIRST_MAX_WAIT_S)
            replicas = self.ext_proc_replicas()
            ext_proc = await asyncio.to_thread(build_ext_proc_snapshot, state, snapshot, self._memos[1], replicas,
                                               self._api_keys_resource)
            self.published_replicas = replicas
            ext_proc_changed = ext_proc.changed_types(self.ext_proc_snapshot)
            self.cache.set_snapshot(state.settings.ext_proc_node_cluster, ext_proc)
            self.ext_proc_snapshot = ext_proc
            self.published.set()
            seconds = time.perf_counter() - started
            if self.metrics is not None:
                self.metrics.snapshot_published(changed | ext_proc_changed, seconds)
            if changed or ext_proc_changed:
                log.debug("snapshot published", extra={"changed": sorted(changed),
                                                       "ext_proc_changed": sorted(ext_proc_changed),
                                                       "build_s": round(seconds, 4)})
