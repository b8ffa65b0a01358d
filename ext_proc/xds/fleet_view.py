"""What the per-request path reads of the fleet: one immutable :class:`FleetView`, and where it comes from.

A view is replaced as a whole on each accepted update (an attribute swap is
atomic on the event loop): a decision never sees half an update; the same for
the :class:`~ext_proc.xds.tenants.KeyTable`. A :class:`ViewSource` hands out the
latest of both and calls listeners after each swap: the xDS client
(:mod:`ext_proc.xds.client`) in production, a :class:`StaticViewSource` in
tests and without a control plane.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Generic, Mapping, Protocol, Sequence, TypeVar

from inferlb_runtime.model_routing import Rollout

from ..model import EndpointView
from ..pick.catalogue import ModelCatalogue
from .tenants import KeyTable

log = logging.getLogger("inferlb.ext_proc.xds")


@dataclass(frozen=True)
class PickPolicySpec:
    """The pick policy the control plane asks for (locality metadata ``inferlb.pick_policy``)."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FleetView:
    """Everything ext_proc knows of the fleet at one moment. Never mutated: replaced.

    ``routable`` (healthy and not draining, in EDS order) and ``pick_values``
    (endpoint id -> the ``ip:port`` text override_host matches) are derived
    once here, not per request.
    """

    version: str
    endpoints: tuple[EndpointView, ...]
    pick_policy: PickPolicySpec | None = None
    received_at: float = 0.0  # time.monotonic()
    partition: tuple[int, int] = (0, 1)  # (our index, replicas) in the control plane's ext_proc_replicas
    rollouts: Mapping[str, Rollout] = field(default_factory=dict)  # by alias
    rollouts_error: str | None = None  # why the locality's rollout table was ignored, if it was
    routable: tuple[EndpointView, ...] = field(init=False)
    by_id: Mapping[str, EndpointView] = field(init=False)
    pick_values: Mapping[str, str] = field(init=False)
    catalogue: ModelCatalogue = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "routable", tuple(e for e in self.endpoints if e.routable))
        object.__setattr__(self, "catalogue", ModelCatalogue.of(self.endpoints, self.rollouts))
        object.__setattr__(self, "by_id", MappingProxyType({e.id: e for e in self.endpoints}))
        object.__setattr__(self, "pick_values", MappingProxyType({e.id: pick_value(e) for e in self.endpoints}))


def pick_value(endpoint: EndpointView) -> str:
    """``ip:port`` as Envoy's override_host parses it (IPv6 in brackets)."""
    if ":" in endpoint.address:
        return f"[{endpoint.address}]:{endpoint.port}"
    return f"{endpoint.address}:{endpoint.port}"


def static_view(endpoints: Sequence[EndpointView], pick_policy: PickPolicySpec | None = None,
                version: str = "static", rollouts: Sequence[Rollout] = ()) -> FleetView:
    return FleetView(version, tuple(endpoints), pick_policy, time.monotonic(),
                     rollouts=MappingProxyType({r.alias: r for r in rollouts}))


ViewListener = Callable[[FleetView], None]
KeyTableListener = Callable[[KeyTable], None]
T = TypeVar("T")


class ViewSource(Protocol):
    """Where the server gets its view: the xDS client in production, a static one in tests."""

    @property
    def view(self) -> FleetView | None: ...

    def add_listener(self, listener: ViewListener) -> None: ...

    @property
    def connected(self) -> bool: ...

    @property
    def key_table(self) -> KeyTable | None:
        """The API keys, or None until a table has arrived (or if the control plane serves none)."""
        ...

    def add_key_listener(self, listener: KeyTableListener) -> None: ...


class Listeners(Generic[T]):
    """Listeners called on the loop after each swap; one that raises is logged, never fatal."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._listeners: list[Callable[[T], None]] = []
        self._first = asyncio.Event()

    def add(self, listener: Callable[[T], None]) -> None:
        self._listeners.append(listener)

    def fire(self, value: T) -> None:
        self._first.set()
        for listener in self._listeners:
            try:
                listener(value)
            except Exception:
                log.exception("%s listener failed", self._what)

    async def wait_first(self) -> None:
        await self._first.wait()


class StaticViewSource:
    """A view (and a key table) set by hand: for tests, and for running without a control plane."""

    def __init__(self, view: FleetView | None = None, key_table: KeyTable | None = None) -> None:
        self._view: FleetView | None = None
        self._listeners: Listeners[FleetView] = Listeners("view")
        self._key_table = key_table
        self._key_listeners: Listeners[KeyTable] = Listeners("key table")
        if view is not None:
            self.set(view)

    @property
    def key_table(self) -> KeyTable | None:
        return self._key_table

    def add_key_listener(self, listener: KeyTableListener) -> None:
        self._key_listeners.add(listener)

    def set_key_table(self, table: KeyTable) -> None:
        self._key_table = table
        self._key_listeners.fire(table)

    @property
    def view(self) -> FleetView | None:
        return self._view

    @property
    def connected(self) -> bool:
        return self._view is not None

    def add_listener(self, listener: ViewListener) -> None:
        self._listeners.add(listener)

    def set(self, view: FleetView) -> None:
        self._view = view
        self._listeners.fire(view)

    async def wait_ready(self, timeout: float | None = None) -> FleetView:
        await asyncio.wait_for(self._listeners.wait_first(), timeout)
        assert self._view is not None
        return self._view
