"""ext_proc's view of the fleet, kept live over ADS from the control plane.

ext_proc is an xDS client like Envoy: it subscribes to EDS for the ``workers``
ClusterLoadAssignment, and to the API key table (``inferlb-api-keys``, a
``google.protobuf.Struct``: :mod:`ext_proc.xds.tenants`) on the same stream. Three
modules share the work:

* :mod:`ext_proc.xds.fleet_view`: the :class:`FleetView` the per-request path
  reads, and the :class:`ViewSource` protocol it is read through;
* :mod:`ext_proc.xds.eds_view`: building a view from the control plane's rich
  ClusterLoadAssignment (telemetry, pick policy, partition, model routing);
* :mod:`ext_proc.xds.ads_stream`: the stream itself (Delta or state of the world,
  resume, ACK/NACK framing, mTLS, reconnects with backoff).

This module is what they serve: :class:`XdsClient` holds the latest accepted
view and key table, judges each response the stream hands it and tells the
listeners. A view (or table) is replaced as a whole on each accepted update:
a decision never sees half an update. ``key_table`` is None until the first
arrives; a control plane that does not serve the type never sends one. While
the control plane is unreachable the last view and table stay in force;
ext_proc keeps routing. A response that cannot be turned into a view (or a
key table) is NACKed with the reason in ``error_detail``, and the previous one
is kept (as Envoy does). A malformed rollout table is not a reason to refuse
the endpoints: the view is taken without rollouts and the reason logged (once
per distinct reason).

Every name of the three modules that callers use is importable from here.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Callable, TypeVar

from envoy.service.discovery.v3 import discovery_pb2
from google.protobuf import any_pb2

from inferlb_runtime.api_keys import API_KEYS_RESOURCE, KEYS_TYPE_URL, InvalidKeyTable

from .ads_stream import REMOVED, USER_AGENT, AdsStream, NoObserver, XdsClientSettings, XdsObserver
from .eds_view import ENDPOINT_TYPE, METADATA_NAMESPACE, ForeignResource, InvalidResource, parse_load_assignment
from .fleet_view import (FleetView, KeyTableListener, Listeners, PickPolicySpec, StaticViewSource, ViewListener,
                         ViewSource, pick_value, static_view)
from .tenants import KeyTable, parse_key_table

__all__ = [
    "ENDPOINT_TYPE", "METADATA_NAMESPACE", "USER_AGENT", "FleetView", "ForeignResource", "InvalidResource",
    "KeyTableListener", "PickPolicySpec", "StaticViewSource", "ViewListener", "ViewSource", "XdsClient",
    "XdsClientSettings", "XdsObserver", "parse_load_assignment", "pick_value", "static_view",
]

log = logging.getLogger("inferlb.ext_proc.xds")

# Parse big ClusterLoadAssignments in a thread: the loop keeps answering Envoy meanwhile.
_PARSE_INLINE_BYTES = 64 * 1024
_SUBSCRIBED = "ext_proc subscribes to EDS and the API key table only"
T = TypeVar("T")


def _shape(view: FleetView) -> tuple[object, ...]:
    """What makes an update worth an INFO line: who is there, who is routable, which policy."""
    return (tuple(e.id for e in view.endpoints), tuple(e.id for e in view.routable), view.pick_policy,
            view.catalogue.names(), tuple(view.rollouts.items()))


async def _parse(parse: Callable[..., T], data: bytes, *args: str) -> T:
    """``parse(data, *args)``, in a thread when ``data`` is big (the loop keeps answering Envoy meanwhile)."""
    if len(data) <= _PARSE_INLINE_BYTES:
        return parse(data, *args)
    return await asyncio.to_thread(parse, data, *args)


class XdsClient:
    """EDS and the API key table over ADS, reconnecting for ever; :attr:`view` and :attr:`key_table` are the
    latest accepted ones."""

    def __init__(self, settings: XdsClientSettings, observer: XdsObserver | None = None,
                 rng: random.Random | None = None) -> None:
        self.settings = settings
        self._observer = observer or NoObserver()
        self._view: FleetView | None = None
        self._key_table: KeyTable | None = None
        self._listeners: Listeners[FleetView] = Listeners("view")
        self._key_listeners: Listeners[KeyTable] = Listeners("key table")
        self._stream = AdsStream(settings, self, self._observer, rng)
        self.accepted = 0  # responses ACKed
        self.rejected = 0  # responses NACKed
        self.last_error: str | None = None  # the last NACK's reason

    # -- the view ------------------------------------------------------------
    @property
    def view(self) -> FleetView | None:
        return self._view

    @property
    def connected(self) -> bool:
        return self._stream.connected

    def add_listener(self, listener: ViewListener) -> None:
        self._listeners.add(listener)

    @property
    def key_table(self) -> KeyTable | None:
        """The latest accepted API key table; None until the first (never, from a control plane without one)."""
        return self._key_table

    def add_key_listener(self, listener: KeyTableListener) -> None:
        """Call ``listener(table)`` on the loop after each accepted table."""
        self._key_listeners.add(listener)

    async def wait_ready(self, timeout: float | None = None) -> FleetView:
        """The first view (raises TimeoutError after ``timeout``)."""
        await asyncio.wait_for(self._listeners.wait_first(), timeout)
        assert self._view is not None
        return self._view

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> None:
        self._stream.start()

    async def stop(self) -> None:
        await self._stream.stop()

    async def __aenter__(self) -> "XdsClient":
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- what the stream hands us (ads_stream.Subscriber) ---------------------
    def held_version(self, type_url: str) -> str | None:
        held = self._view if type_url == ENDPOINT_TYPE else self._key_table
        return held.version if held is not None else None

    def _accept(self, view: FleetView) -> None:
        previous = self._view
        self._view = view
        self.accepted += 1
        self._observer.xds_update(True)
        if view.rollouts_error is not None and (previous is None or previous.rollouts_error != view.rollouts_error):
            log.error("rollout table ignored; routing by version and alias only",
                      extra={"version": view.version, "error": view.rollouts_error})
        # Telemetry changes every scrape: INFO only when membership, routability or the policy change.
        changed = previous is None or _shape(previous) != _shape(view)
        (log.info if changed else log.debug)("eds update", extra={
            "version": view.version, "endpoints": len(view.endpoints), "routable": len(view.routable),
            "pick_policy": view.pick_policy.name if view.pick_policy else None,
            "previous_version": previous.version if previous else None,
        })
        self._listeners.fire(view)

    def _accept_keys(self, table: KeyTable) -> None:
        previous = self._key_table
        self._key_table = table
        self.accepted += 1
        self._observer.xds_update(True)
        log.info("api key table update", extra={"version": table.version, "keys": len(table),
                                                "previous_version": previous.version if previous else None})
        self._key_listeners.fire(table)

    def _reject(self, version: str, error: str, type_url: str = ENDPOINT_TYPE) -> None:
        self.rejected += 1
        self.last_error = error
        self._observer.xds_update(False)
        kept = self._view if type_url == ENDPOINT_TYPE else self._key_table
        log.warning("eds update rejected" if type_url == ENDPOINT_TYPE else "api key table update rejected",
                    extra={"version": version, "error": error, "kept_version": kept.version if kept else None})

    async def apply_delta(self, response: discovery_pb2.DeltaDiscoveryResponse) -> str | None:
        """Apply a Delta response; the NACK reason, or None to ACK."""
        if response.type_url == KEYS_TYPE_URL:
            return await self._apply_delta_keys(response)
        cluster = self.settings.cluster
        if response.type_url != ENDPOINT_TYPE:
            return f"unexpected type {response.type_url}: {_SUBSCRIBED}"
        for resource in response.resources:
            if resource.name != cluster:
                continue  # not ours (nothing to apply; the spec lets us ignore it)
            try:
                view = await _parse(parse_load_assignment, resource.resource.value, cluster, resource.version,
                                    self.settings.node_id)
            except InvalidResource as exc:
                self._reject(resource.version, str(exc))
                return str(exc)
            self._accept(view)
        if cluster in response.removed_resources:
            # The control plane has no such assignment: no endpoints (503s) rather than stale ones.
            self._accept(FleetView(f"{REMOVED}{response.system_version_info}", (),
                                   self._view.pick_policy if self._view else None, time.monotonic()))
        return None

    async def _apply_delta_keys(self, response: discovery_pb2.DeltaDiscoveryResponse) -> str | None:
        for resource in response.resources:
            if resource.name != API_KEYS_RESOURCE:
                continue
            error = await self._apply_keys(resource.resource, resource.version)
            if error is not None:
                return error
        if API_KEYS_RESOURCE in response.removed_resources:
            # The control plane has no table: no key is valid (rather than keys it may have revoked).
            self._accept_keys(KeyTable.empty(f"{REMOVED}{response.system_version_info}"))
        return None

    async def _apply_keys(self, resource: any_pb2.Any, version: str) -> str | None:
        """Accept one key table; the NACK reason if it is unusable (the previous table stays)."""
        try:
            if resource.type_url != KEYS_TYPE_URL:
                raise InvalidKeyTable(f"the api key table is a {resource.type_url}, not a {KEYS_TYPE_URL}")
            table = await _parse(parse_key_table, resource.value, version)
        except InvalidKeyTable as exc:
            self._reject(version, str(exc), KEYS_TYPE_URL)
            return str(exc)
        self._accept_keys(table)
        return None

    async def apply_sotw(self, response: discovery_pb2.DiscoveryResponse) -> str | None:
        """Apply a state-of-the-world response; the NACK reason, or None to ACK."""
        if response.type_url == KEYS_TYPE_URL:
            if len(response.resources) > 1:  # a Struct has no name: one subscribed name, at most one resource
                return f"an api key table response carries {len(response.resources)} resources, expected one"
            for table in response.resources:
                return await self._apply_keys(table, response.version_info)
            return None
        cluster = self.settings.cluster
        if response.type_url != ENDPOINT_TYPE:
            return f"unexpected type {response.type_url}: {_SUBSCRIBED}"
        mine = [r for r in response.resources if r.type_url == ENDPOINT_TYPE]
        if len(mine) != len(response.resources):
            return "a resource in an EDS response is not a ClusterLoadAssignment"
        for resource in mine:
            try:
                view = await _parse(parse_load_assignment, resource.value, cluster, response.version_info,
                                    self.settings.node_id)
            except ForeignResource:
                continue  # someone else's assignment: not an error for us
            except InvalidResource as exc:
                self._reject(response.version_info, str(exc))
                return str(exc)
            self._accept(view)
        return None
