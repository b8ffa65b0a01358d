"""Endpoint actions: register, deregister (drain, then remove), pin a weight, drain.

Deregistration (``DELETE /v1/endpoints/{id}``) drains first: the endpoint is
marked draining at once (Envoy stops sending it new requests; ext_proc stops
picking it), and removed once the Envoys acknowledged the drain and a later
scrape shows nothing in flight or queued there, or it is unhealthy, or after
``deregistration_drain_s`` (default 10 s) at the latest. The registration
is deleted from the store at once, so a restart during the drain does not
bring it back. Meanwhile it shows ``removing: true``. The drain-then-remove
task is supervised: a failure is logged, counted
(``inferlb_cp_task_failures_total{task="deregister"}``) and retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import time
from typing import Any

from inferlb_runtime.supervision import Supervised

from ..api_models import EndpointCreate, EndpointList, EndpointOut
from ..config import parse_endpoint
from ..model import Endpoint, Health
from ..type_urls import ENDPOINT
from .actions import Actions, replace_endpoint
from .errors import ApiError
from .views import endpoint_out

log = logging.getLogger("inferlb.control_plane.admin")

DEFAULT_DEREGISTRATION_DRAIN_S = 10.0
# A drained endpoint counts as idle when its smoothed in-flight and queue figures are below this.
IDLE_BELOW = 0.5


class EndpointActions:
    """The endpoints' views and actions, and the deregistrations under way."""

    def __init__(self, actions: Actions, deregistration_drain_s: float = DEFAULT_DEREGISTRATION_DRAIN_S) -> None:
        self.actions = actions
        self.controller = actions.controller
        self.deregistration_drain_s = deregistration_drain_s
        self.removals: dict[str, asyncio.Task[None]] = {}  # endpoint id -> its drain-then-remove task

    async def stop(self) -> None:
        tasks = list(self.removals.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- reading ----------------------------------------------------------------------------------

    def endpoint_out(self, e: Endpoint, now: float | None = None) -> EndpointOut:
        return endpoint_out(e, removing=e.id in self.removals, now=time.monotonic() if now is None else now,
                            stale_after_s=self.controller.config.stale_after_s)

    def endpoints(self) -> EndpointList:
        now = time.monotonic()
        ordered = sorted(self.controller.state.endpoints, key=lambda e: e.id)
        return EndpointList(endpoints=[self.endpoint_out(e, now) for e in ordered])

    def find(self, endpoint_id: str) -> Endpoint:
        """The endpoint by id (``host:port``; IPv6 hosts with or without brackets), or 404."""
        state = self.controller.state
        endpoint = state.endpoint(endpoint_id)
        if endpoint is None:
            with contextlib.suppress(ValueError):
                host, port = parse_endpoint(endpoint_id)
                endpoint = state.endpoint(f"{ipaddress.ip_address(host)}:{port}")
        if endpoint is None:
            raise ApiError(404, "endpoint_not_found", f"no endpoint {endpoint_id!r}")
        return endpoint

    def get(self, endpoint_id: str) -> EndpointOut:
        return self.endpoint_out(self.find(endpoint_id))

    def _current(self, endpoint_id: str) -> EndpointOut:
        endpoint = self.controller.state.endpoint(endpoint_id)
        if endpoint is None:  # removed meanwhile (cannot happen under the lock, but never a 500)
            raise ApiError(404, "endpoint_not_found", f"no endpoint {endpoint_id!r}")
        return self.endpoint_out(endpoint)

    # -- acting -------------------------------------------------------------------------------------

    async def register(self, body: EndpointCreate) -> EndpointOut:
        endpoint = Endpoint(address=body.address, port=body.port, source="api")
        async with self.actions.lock:
            existing = self.controller.state.endpoint(endpoint.id)
            if existing is not None:
                what = "is being deregistered" if existing.id in self.removals else "exists"
                raise ApiError(409, "endpoint_exists", f"endpoint {endpoint.id} {what}",
                               {"source": existing.source})
            await self.actions.commit(lambda s: s.add_endpoint(endpoint.address, endpoint.port))
            self.controller.update(lambda state: dataclasses.replace(
                state, endpoints=(*state.endpoints, endpoint)) if state.endpoint(endpoint.id) is None else state)
            log.info("endpoint registered", extra={"endpoint": endpoint.id})
            return self._current(endpoint.id)

    async def deregister(self, endpoint_id: str) -> EndpointOut:
        async with self.actions.lock:
            endpoint = self.find(endpoint_id)
            if endpoint.source != "api":
                raise ApiError(409, "static_endpoint",
                               f"endpoint {endpoint.id} comes from the {endpoint.source} config, not the API; "
                               "drain it instead, or remove it from the config", {"source": endpoint.source})
            if endpoint.id not in self.removals:
                await self.actions.commit(lambda s: s.remove_endpoint(endpoint.id))
                self.start_removal(endpoint.id)
                log.info("endpoint deregistered: draining", extra={"endpoint": endpoint.id})
            return self._current(endpoint.id)

    def start_removal(self, endpoint_id: str) -> None:
        """Drain now; then remove, in a supervised task: a failure is logged, counted and retried (the drain
        deadline stays the first attempt's); the endpoint shows ``removing`` until it is gone."""
        self.controller.update(replace_endpoint(endpoint_id, draining=True))
        supervised = Supervised("deregister", observer=self.controller.metrics, logger=log)
        deadline = asyncio.get_running_loop().time() + self.deregistration_drain_s

        async def remove() -> None:
            try:
                await supervised.run(lambda: self._drain_then_remove(endpoint_id, deadline),
                                     {"endpoint": endpoint_id})
            finally:
                self.removals.pop(endpoint_id, None)

        self.removals[endpoint_id] = asyncio.create_task(remove(), name=f"deregister {endpoint_id}")

    async def _drain_then_remove(self, endpoint_id: str, deadline: float) -> None:
        controller = self.controller
        loop = asyncio.get_running_loop()
        poll = min(0.5, max(0.05, controller.config.scrape_interval_s / 2))
        drain_seen_at: float | None = None  # monotonic time the Envoys had the drain
        reason = "drain period over"
        while loop.time() < deadline:
            current = controller.state.endpoint(endpoint_id)
            if current is None:
                return
            published = controller.published_state
            pushed = published is not None and (p := published.endpoint(endpoint_id)) is not None \
                and p.draining
            if drain_seen_at is None and pushed and controller.cache.default_settled(ENDPOINT):
                drain_seen_at = time.monotonic()
            if drain_seen_at is not None:
                if current.health is Health.UNHEALTHY:
                    reason = "unhealthy"
                    break
                t = current.telemetry
                if t is not None and t.observed_at > drain_seen_at and t.inflight < IDLE_BELOW \
                        and t.queue_depth < IDLE_BELOW:
                    reason = "idle"
                    break
            await asyncio.sleep(poll)
        async with self.actions.lock:
            controller.update(lambda state: dataclasses.replace(
                state, endpoints=tuple(e for e in state.endpoints if e.id != endpoint_id)))
            log.info("endpoint removed", extra={"endpoint": endpoint_id, "reason": reason})

    async def _set_override(self, endpoint_id: str, **changes: Any) -> EndpointOut:
        async with self.actions.lock:
            endpoint = self.find(endpoint_id)
            if endpoint.id in self.removals:
                raise ApiError(409, "endpoint_removing", f"endpoint {endpoint.id} is being deregistered")
            updated = dataclasses.replace(endpoint, **changes)
            await self.actions.commit(lambda s: s.set_override(endpoint.id, updated.pinned_weight, updated.draining))
            self.controller.update(replace_endpoint(endpoint.id, **changes))
            log.info("endpoint changed", extra={"endpoint": endpoint.id, **changes})
            return self._current(endpoint.id)

    async def pin(self, endpoint_id: str, weight: int | None) -> EndpointOut:
        return await self._set_override(endpoint_id, pinned_weight=weight)

    async def drain(self, endpoint_id: str, draining: bool) -> EndpointOut:
        return await self._set_override(endpoint_id, draining=draining)
