"""The control plane's HTTP side on 127.0.0.1:8080 (FastAPI): the admin REST API
(``/v1/...``), probes, metrics, ``/openapi.json`` and ``/docs``.

Every operator action goes the same way: validate → check the token → commit
to the store → ``controller.update`` (a pure state change) → the debounced
publish pushes it to every Envoy and ext_proc, like any telemetry change
(100 ms trailing, at most 1 s). Store first: an action that answered 2xx is
on disk; one whose commit failed (503 ``store_unavailable``) changed nothing.
Actions are serialised by one lock, so the store and the state never
disagree about their order.

Deregistration (``DELETE /v1/endpoints/{id}``) drains first: the endpoint is
marked draining at once (Envoy stops sending it new requests; ext_proc stops
picking it), and removed once the Envoys acknowledged the drain and a later
scrape shows nothing in flight or queued there, or it is unhealthy, or after
``deregistration_drain_s`` (default 10 s) at the latest. The registration
is deleted from the store at once, so a restart during the drain does not
bring it back. Meanwhile it shows ``removing: true``. The drain-then-remove
task is supervised: a failure is logged, counted
(``inferlb_cp_task_failures_total{task="deregister"}``) and retried.

Model rollouts (``/v1/rollouts/{alias}``, issue 15) go the same way: a PUT
keeps the split it replaces as the alias's ``previous``, and a rollback swaps
the two (so a rollback of a rollback goes forward again). ext_proc gets the
rollouts on its EDS (``inferlb.rollouts``), published at once rather than
after the debounce (a rollback must be instant): the call returns when the
snapshot ext_proc is served carries it. A split naming a version no endpoint serves is refused (409)
unless ``?force=true``: a typo must not send a share of the traffic nowhere.

Errors have one shape, ``{"error": {"status", "code", "message", "detail"}}``:
400 (malformed JSON, unknown policy), 401 (token), 404 (no such endpoint,
rollout or route), 405, 409 (conflicts: exists, static, being removed; a
version nobody serves, an alias that is a version, nothing to roll back to),
422 (the body fails its schema, the policy's parameter schema or the rollout's
rules), 503 (the store could not commit).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import ipaddress
import logging
import math
import re
import secrets
import time
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from fastapi import Depends, FastAPI, Path, Query, Request, Response, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferlb_runtime import plugins
from inferlb_runtime.api_keys import KEY_PREFIX, TENANT_PATTERN, Quota, hash_key, new_key
from inferlb_runtime.model_routing import MODEL_NAME_PATTERN, Rollout
from inferlb_runtime.request_class import PRIORITIES
from inferlb_runtime.plugins import PolicyAllowlist
from inferlb_runtime.request_context import RequestContextMiddleware
from inferlb_runtime.supervision import Supervised

from . import pick_catalogue
from .api_models import (
    KEY_HINT_LENGTH,
    ActivePolicy,
    ApiKeyCreate,
    ApiKeyCreated,
    ApiKeyList,
    ApiKeyOut,
    AvailablePolicies,
    AvailablePolicy,
    DataPlaneStatus,
    EndpointCreate,
    EndpointList,
    EndpointOut,
    ErrorResponse,
    ModelCatalogueOut,
    ModelEndpointOut,
    ModelVersionOut,
    NackOut,
    NginxFailureOut,
    NginxServerOut,
    NON_FINITE,
    NginxStatusOut,
    PolicyState,
    PolicyUpdate,
    RolloutList,
    RolloutOut,
    RolloutPut,
    RolloutSplit,
    TelemetryOut,
    TypeStatusOut,
    UsageReport,
    WeightPin,
    Weights,
    XdsClientOut,
    XdsClients,
)
from .auth import AdminToken, bearer, is_loopback
from .config import parse_endpoint
from .controller import Controller
from .dashboard import dashboard_router
from .metrics import ControlPlaneMetrics
from .model import Endpoint, FleetState, Health, PickPolicySpec, Telemetry
from .nginx.applier import NginxApplier
from .policy import WeightPolicy
from .policy_registry import WeightPolicyRegistry, weight_policy_params
from .store import (
    OperatorState,
    OperatorStore,
    PolicyKind,
    StoredApiKey,
    StoredPolicy,
    StoredRollout,
    StoreError,
    live_key_entries,
    reconcile,
)
from .telemetry import is_stale
from .usage.query import BadUsageQuery, Granularity, usage_query, usage_report
from .type_urls import ENDPOINT, SHORT_NAMES
from .weight_policies import builtin_weight_policies

log = logging.getLogger("inferlb.control_plane.admin")

DEFAULT_DEREGISTRATION_DRAIN_S = 10.0
# A drained endpoint counts as idle when its smoothed in-flight and queue figures are below this.
IDLE_BELOW = 0.5


BEARER = HTTPBearer(auto_error=False, description="the admin token")
Credentials = typing.Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)]
EndpointId = typing.Annotated[str, Path(description="host:port", examples=["127.0.0.1:8101"], max_length=300)]
ApiKeyId = typing.Annotated[str, Path(description="the key's id (not the key)", examples=["key_0123456789abcdef"],
                                      max_length=100)]
Alias = typing.Annotated[str, Path(description="the model name requests use; may contain '/'",
                                   examples=["all-MiniLM-L6-v2"], max_length=128,
                                   pattern=MODEL_NAME_PATTERN.pattern)]
# Listing keys shows tenants and their quotas: these routes need the token for reads too.
API_KEYS_PATH = "/v1/api-keys"
USAGE_PATH = "/v1/usage"  # tenants' usage: the token for reads too


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, detail: Any = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.detail, self.headers = status, code, message, detail, headers


def error_response(status: int, code: str, message: str, detail: Any = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    body = {"error": {"status": status, "code": code, "message": message, "detail": detail}}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def _errors(status: int, *codes: str) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": ", ".join(codes)}}


def _responses(*entries: dict[int | str, dict[str, Any]]) -> dict[int | str, dict[str, Any]]:
    merged: dict[int | str, dict[str, Any]] = {}
    for entry in entries:
        merged.update(entry)
    return merged


E400 = _errors(400, "invalid_json", "unknown_policy")
E401 = _errors(401, "unauthorized")
E404 = _errors(404, "endpoint_not_found")
E404_KEY = _errors(404, "api_key_not_found")
E409 = _errors(409, "endpoint_exists", "static_endpoint", "endpoint_removing")
E422_USAGE = _errors(422, "validation_error")
E404_ROLLOUT = _errors(404, "rollout_not_found")
E409_ROLLOUT = _errors(409, "version_not_served", "alias_is_a_version")
E409_ROLLBACK = _errors(409, "no_previous_split")
E422 = _errors(422, "validation_error", "invalid_params")
E503 = _errors(503, "store_unavailable")


# --- views -------------------------------------------------------------------------------------------


def _finite(value: float) -> float | None:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def _json_safe(value: Any) -> Any:
    """Parameters as JSON: non-finite numbers become null, unknown objects their repr."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return _finite(value)
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return repr(value)


def telemetry_out(t: Telemetry, now: float, stale_after_s: float) -> TelemetryOut:
    return TelemetryOut(
        cpu_utilization=_finite(t.cpu_utilization), latency_mean_s=_finite(t.latency_mean_s),
        latency_p50_s=_finite(t.latency_p50_s), latency_p99_s=_finite(t.latency_p99_s),
        latency_per_token_s=_finite(t.latency_per_token_s), queue_wait_mean_s=_finite(t.queue_wait_mean_s),
        queue_depth=_finite(t.queue_depth), inflight=_finite(t.inflight), rps=_finite(t.rps),
        tokens_per_s=_finite(t.tokens_per_s), error_rate=_finite(t.error_rate), slots=_finite(t.slots),
        batch_cost_fixed_s=_finite(t.batch_cost_fixed_s), batch_cost_per_token_s=_finite(t.batch_cost_per_token_s),
        age_s=max(0.0, round(now - t.observed_at, 3)), stale=is_stale(t, now, stale_after_s),
    )


def weight_policy_catalogue() -> list[AvailablePolicy]:
    """Built-in and entry-point weight policies (``module:attribute`` ones can be named, not listed)."""
    return [AvailablePolicy(name=d["name"], summary=d["summary"], params_schema=d["params_schema"])
            for d in WeightPolicyRegistry().describe()]


def pick_policy_catalogue() -> list[AvailablePolicy]:
    """ext_proc's named policies (pick chains; their ``admit``/``filters``/``scorers`` params add plugins)."""
    return [AvailablePolicy(name=p.name, summary=p.summary, params_schema=p.schema())
            for p in sorted(pick_catalogue.CATALOGUE.values(), key=lambda p: p.name)]


def _validation_detail(exc: ValidationError | RequestValidationError) -> list[dict[str, Any]]:
    return [{"loc": [str(part) for part in err.get("loc", ())], "msg": str(err.get("msg", "")),
             "type": str(err.get("type", ""))} for err in exc.errors()]


def api_key_out(key: StoredApiKey) -> ApiKeyOut:
    q = key.quota
    return ApiKeyOut(id=key.id, key_hint=key.key_hint, tenant=key.tenant, name=key.name,
                     priority=key.priority.name.lower(), weight=key.weight, tokens_per_minute=q.tokens_per_minute,
                     requests_per_minute=q.requests_per_minute, max_tokens_in_flight=q.max_tokens_in_flight,
                     created_at=key.created_at, revoked_at=key.revoked_at)


def _split(rollout: Rollout) -> RolloutSplit:
    return RolloutSplit(versions=dict(rollout.versions), sticky=rollout.sticky)


def rollout_out(record: StoredRollout, served: frozenset[str]) -> RolloutOut:
    """A rollout as the API shows it; ``served``: the versions some endpoint serves now."""
    r = record.rollout
    return RolloutOut(alias=r.alias, versions=dict(r.versions), sticky=r.sticky,
                      previous=None if record.previous is None else _split(record.previous),
                      unserved=[v for v, _ in r.versions if v not in served])


def served_versions(state: FleetState) -> frozenset[str]:
    """Every version some endpoint of the fleet reports, routable or not."""
    return frozenset(v for e in state.endpoints for v in e.models)


def model_catalogue(state: FleetState) -> list[ModelVersionOut]:
    """Per version: the endpoints serving it, whether any is routable, and their aliases (an endpoint reports
    its aliases for all its versions together: a version's are those of the endpoints that serve it)."""
    serving: dict[str, list[Endpoint]] = {}
    for e in sorted(state.endpoints, key=lambda e: e.id):
        for version in e.models:
            serving.setdefault(version, []).append(e)
    return [ModelVersionOut(id=version, aliases=sorted({a for e in endpoints for a in e.model_aliases}),
                            routable=any(e.routable for e in endpoints),
                            endpoints=[ModelEndpointOut(id=e.id, routable=e.routable, pool=e.pool) for e in endpoints])
            for version, endpoints in sorted(serving.items())]


def _now_us() -> float:
    """Unix time to the microsecond: what PostgreSQL's timestamptz keeps, so a reload reads back the same."""
    return round(time.time(), 6)


def _replace_endpoint(endpoint_id: str, **changes: Any) -> Callable[[FleetState], FleetState]:
    def change(state: FleetState) -> FleetState:
        return dataclasses.replace(state, endpoints=tuple(
            dataclasses.replace(e, **changes) if e.id == endpoint_id else e for e in state.endpoints))
    return change


# --- the service behind the routes ---------------------------------------------------------------------


class AdminService:
    """Operator actions on the controller's state, persisted in the store (see the module docstring)."""

    def __init__(self, controller: Controller, store: OperatorStore | None = None, *,
                 deregistration_drain_s: float = DEFAULT_DEREGISTRATION_DRAIN_S,
                 stored_weight_policy: StoredPolicy | None = None, api_keys: Iterable[StoredApiKey] = ()) -> None:
        self.controller = controller
        # Every key, live and revoked, by id: what the store holds (the controller pushes the live ones).
        self._api_keys: dict[str, StoredApiKey] = {k.id: k for k in api_keys}
        self.store = store
        self.deregistration_drain_s = deregistration_drain_s
        self._lock = asyncio.Lock()
        self._removals: dict[str, asyncio.Task[None]] = {}
        # The stored weight policy the controller runs (restored or set): a reload rebuilds it only on a change.
        self._weight_stored = stored_weight_policy
        # Every rollout with its previous split, by alias: what the store holds (the state has the current
        # splits only). Read from the store when first needed (None until then), kept up to date after.
        self._rollouts: dict[str, StoredRollout] | None = None
        self.closing = asyncio.Event()  # set by stop: long-lived responses (the dashboard's feed) end

    async def stop(self) -> None:
        self.closing.set()
        tasks = list(self._removals.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- reading ----------------------------------------------------------------------------------

    def endpoint_out(self, e: Endpoint, now: float | None = None) -> EndpointOut:
        now = time.monotonic() if now is None else now
        return EndpointOut(
            id=e.id, address=e.address, port=e.port, source=e.source, health=e.health.value,
            draining=e.draining, removing=e.id in self._removals, routable=e.routable,
            weight=Weights(effective=e.effective_weight, computed=e.computed_weight, pinned=e.pinned_weight),
            consecutive_scrape_failures=e.consecutive_scrape_failures,
            telemetry=None if e.telemetry is None else telemetry_out(e.telemetry, now,
                                                                     self.controller.config.stale_after_s),
        )

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

    def policy(self) -> PolicyState:
        pick = self.controller.state.pick_policy
        weight = self.controller.policy
        return PolicyState(
            weight=ActivePolicy(name=weight.name, params=_json_safe(weight_policy_params(weight))),
            pick=ActivePolicy(name=pick.name,
                              params=_json_safe(pick_catalogue.effective_pick_params(pick.name, pick.params))),
            available=AvailablePolicies(weight=weight_policy_catalogue(), pick=pick_policy_catalogue()),
        )

    def xds_clients(self) -> XdsClients:
        cache = self.controller.cache
        clients = []
        for c in cache.clients():
            snapshot = cache.get(c.group)
            types = {}
            for type_url, t in c.types.items():
                current = snapshot.version(type_url) if snapshot is not None else ""
                nack = t.last_nack
                types[SHORT_NAMES.get(type_url, type_url)] = TypeStatusOut(
                    type_url=type_url, wildcard=t.wildcard, names=list(t.names), sent_version=t.sent_version,
                    acked_version=t.acked_version, current_version=current,
                    in_sync=bool(current) and t.acked_version == current, push_count=t.push_count,
                    nack_count=t.nack_count,
                    last_nack=None if nack is None else NackOut(version=nack.version, nonce=nack.nonce,
                                                                message=nack.message, at=nack.at),
                )
            clients.append(XdsClientOut(stream_id=c.stream_id, node_id=c.node_id, node_cluster=c.node_cluster,
                                        group=c.group, mode=c.mode, connected_at=c.connected_at, types=types))
        return XdsClients(clients=clients)

    # -- acting -------------------------------------------------------------------------------------

    async def _commit(self, write: Callable[[OperatorStore], Any]) -> Any:
        """``write`` to the store and its result (None without a store), or 503 with nothing changed."""
        if self.store is None:
            return None
        try:
            return await write(self.store)
        except StoreError as exc:
            log.error("store write failed: nothing changed", extra={"error": str(exc)})
            raise ApiError(503, "store_unavailable", "the change could not be saved; nothing changed",
                           {"store": str(exc)}) from exc

    def _not_removing(self, endpoint: Endpoint) -> None:
        if endpoint.id in self._removals:
            raise ApiError(409, "endpoint_removing", f"endpoint {endpoint.id} is being deregistered")

    async def register(self, body: EndpointCreate) -> EndpointOut:
        endpoint = Endpoint(address=body.address, port=body.port, source="api")
        async with self._lock:
            existing = self.controller.state.endpoint(endpoint.id)
            if existing is not None:
                what = "is being deregistered" if existing.id in self._removals else "exists"
                raise ApiError(409, "endpoint_exists", f"endpoint {endpoint.id} {what}",
                               {"source": existing.source})
            await self._commit(lambda s: s.add_endpoint(endpoint.address, endpoint.port))
            self.controller.update(lambda state: dataclasses.replace(
                state, endpoints=(*state.endpoints, endpoint)) if state.endpoint(endpoint.id) is None else state)
            log.info("endpoint registered", extra={"endpoint": endpoint.id})
            return self._current(endpoint.id)

    async def deregister(self, endpoint_id: str) -> EndpointOut:
        async with self._lock:
            endpoint = self.find(endpoint_id)
            if endpoint.source != "api":
                raise ApiError(409, "static_endpoint",
                               f"endpoint {endpoint.id} comes from the {endpoint.source} config, not the API; "
                               "drain it instead, or remove it from the config", {"source": endpoint.source})
            if endpoint.id not in self._removals:
                await self._commit(lambda s: s.remove_endpoint(endpoint.id))
                self.controller.update(_replace_endpoint(endpoint.id, draining=True))
                self._start_removal(endpoint.id)
                log.info("endpoint deregistered: draining", extra={"endpoint": endpoint.id})
            return self._current(endpoint.id)

    def _start_removal(self, endpoint_id: str) -> None:
        """Drain, then remove, in a supervised task: a failure is logged, counted and retried (the drain
        deadline stays the first attempt's); the endpoint shows ``removing`` until it is gone."""
        supervised = Supervised("deregister", observer=self.controller.metrics, logger=log)
        deadline = asyncio.get_running_loop().time() + self.deregistration_drain_s

        async def remove() -> None:
            try:
                await supervised.run(lambda: self._drain_then_remove(endpoint_id, deadline),
                                     {"endpoint": endpoint_id})
            finally:
                self._removals.pop(endpoint_id, None)

        self._removals[endpoint_id] = asyncio.create_task(remove(), name=f"deregister {endpoint_id}")

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
        async with self._lock:
            controller.update(lambda state: dataclasses.replace(
                state, endpoints=tuple(e for e in state.endpoints if e.id != endpoint_id)))
            log.info("endpoint removed", extra={"endpoint": endpoint_id, "reason": reason})

    async def _set_override(self, endpoint_id: str, **changes: Any) -> EndpointOut:
        async with self._lock:
            endpoint = self.find(endpoint_id)
            self._not_removing(endpoint)
            updated = dataclasses.replace(endpoint, **changes)
            await self._commit(lambda s: s.set_override(endpoint.id, updated.pinned_weight, updated.draining))
            self.controller.update(_replace_endpoint(endpoint.id, **changes))
            log.info("endpoint changed", extra={"endpoint": endpoint.id, **changes})
            return self._current(endpoint.id)

    async def pin(self, endpoint_id: str, weight: int | None) -> EndpointOut:
        return await self._set_override(endpoint_id, pinned_weight=weight)

    async def drain(self, endpoint_id: str, draining: bool) -> EndpointOut:
        return await self._set_override(endpoint_id, draining=draining)

    async def set_policy(self, update: PolicyUpdate) -> PolicyState:
        weight_policy: WeightPolicy | None = None
        pick: PickPolicySpec | None = None
        stored: dict[PolicyKind, StoredPolicy] = {}
        allow = self.controller.config.policy_allowlist
        if update.weight is not None:
            weight_policy = build_weight_policy(update.weight.name, update.weight.params, allow)
            stored["weight"] = StoredPolicy(update.weight.name, dict(update.weight.params))
        if update.pick is not None:
            try:
                params = pick_catalogue.validate_pick_params(update.pick.name, update.pick.params, allow)
            except pick_catalogue.UnknownPickPolicy as exc:
                raise ApiError(400, "unknown_policy", str(exc), available_policies("pick", allow)) from None
            except pick_catalogue.BadPickParams as exc:
                raise ApiError(422, "invalid_params", str(exc)) from None
            pick = PickPolicySpec(update.pick.name, params)
            stored["pick"] = StoredPolicy(pick.name, params)
        async with self._lock:
            await self._commit(lambda s: s.set_policies(stored))
            if weight_policy is not None:
                self.controller.set_policy(weight_policy)
                self._weight_stored = stored["weight"]
            if pick is not None:
                self.controller.update(lambda state: dataclasses.replace(state, pick_policy=pick))
            log.info("policy changed", extra={"policies": {k: v.name for k, v in stored.items()}})
        return self.policy()

    # -- API keys -----------------------------------------------------------------------------------

    def api_keys(self, tenant: str | None = None, include_revoked: bool = False) -> ApiKeyList:
        keys = sorted(self._api_keys.values(), key=lambda k: (k.created_at, k.id))
        return ApiKeyList(api_keys=[api_key_out(k) for k in keys
                                    if (tenant is None or k.tenant == tenant) and (include_revoked or k.live)])

    def api_key(self, key_id: str) -> ApiKeyOut:
        return api_key_out(self._find_key(key_id))

    def _find_key(self, key_id: str) -> StoredApiKey:
        key = self._api_keys.get(key_id)
        if key is None:
            raise ApiError(404, "api_key_not_found", f"no API key {key_id!r}")
        return key

    async def create_api_key(self, body: ApiKeyCreate) -> ApiKeyCreated:
        """A new key: stored as its hash, pushed to ext_proc at once; the key itself is in this answer only."""
        key = new_key()
        record = StoredApiKey(
            id=f"key_{secrets.token_hex(8)}", tenant=body.tenant, key_hash=hash_key(key),
            key_hint=key[len(KEY_PREFIX):][:KEY_HINT_LENGTH], name=body.name, priority=PRIORITIES[body.priority],
            weight=body.weight, quota=Quota(body.tokens_per_minute, body.requests_per_minute,
                                            body.max_tokens_in_flight),
            created_at=_now_us())
        async with self._lock:
            await self._commit(lambda s: s.add_api_key(record))
            self._api_keys[record.id] = record
            await self._push_api_keys()
        log.info("API key created", extra={"key_id": record.id, "tenant": record.tenant})
        return ApiKeyCreated(key=key, **api_key_out(record).model_dump())

    async def revoke_api_key(self, key_id: str) -> ApiKeyOut:
        """Revoke (ext_proc drops the key at once); revoking again keeps the first time."""
        async with self._lock:
            record = self._find_key(key_id)
            if record.live:
                at = _now_us()
                stored = await self._commit(lambda s: s.revoke_api_key(key_id, at))
                record = stored if stored is not None else dataclasses.replace(record, revoked_at=at)
                self._api_keys[key_id] = record
                await self._push_api_keys()
                log.info("API key revoked", extra={"key_id": key_id, "tenant": record.tenant})
            return api_key_out(record)

    async def _push_api_keys(self) -> None:
        await self.controller.set_api_keys(live_key_entries(self._api_keys.values()))

    # -- models and rollouts (issue 15) --------------------------------------------------------------

    async def _rollout_records(self) -> dict[str, StoredRollout]:
        """The rollouts with their previous splits (read from the store the first time: 503 if it fails)."""
        if self._rollouts is None:
            if self.store is None:
                records: tuple[StoredRollout, ...] = tuple(StoredRollout(r) for r in self.controller.state.rollouts)
            else:
                try:
                    records = (await self.store.aload()).rollouts
                except StoreError as exc:
                    raise ApiError(503, "store_unavailable", "the rollouts could not be read from the store",
                                   {"store": str(exc)}) from exc
            self._rollouts = {r.alias: r for r in records}
        return self._rollouts

    async def models(self) -> ModelCatalogueOut:
        state = self.controller.state
        return ModelCatalogueOut(models=model_catalogue(state), rollouts=(await self.rollouts()).rollouts)

    async def rollouts(self) -> RolloutList:
        records = await self._rollout_records()
        served = served_versions(self.controller.state)
        return RolloutList(rollouts=[rollout_out(records[a], served) for a in sorted(records)])

    async def rollout(self, alias: str) -> RolloutOut:
        return rollout_out(self._find_rollout(await self._rollout_records(), alias),
                           served_versions(self.controller.state))

    @staticmethod
    def _find_rollout(records: Mapping[str, StoredRollout], alias: str) -> StoredRollout:
        record = records.get(alias)
        if record is None:
            raise ApiError(404, "rollout_not_found", f"no rollout of {alias!r}")
        return record

    async def set_rollout(self, alias: str, body: RolloutPut, force: bool) -> RolloutOut:
        """Create or replace ``alias``'s split; the one it replaces becomes its ``previous``."""
        try:
            rollout = Rollout(alias, tuple((v, float(p)) for v, p in body.versions.items()), body.sticky)
        except ValueError as exc:
            raise ApiError(422, "validation_error", str(exc),
                           [{"loc": ["body", "versions"], "msg": str(exc), "type": "value_error"}]) from None
        async with self._lock:
            records = await self._rollout_records()
            served = served_versions(self.controller.state)
            if alias in served:
                raise ApiError(409, "alias_is_a_version",
                               f"{alias!r} is a version an endpoint serves: a rollout of it would hide that version; "
                               "choose another alias")
            unserved = [v for v, _ in rollout.versions if v not in served]
            if unserved and not force:
                raise ApiError(409, "version_not_served",
                               f"no endpoint serves {', '.join(map(repr, unserved))}: their share of {alias!r} would "
                               "be answered 503; check the names (GET /v1/models), or add ?force=true",
                               {"unserved": unserved, "served": sorted(served)})
            current = records.get(alias)
            if current is None or current.rollout != rollout:
                await self._change_rollout(records, StoredRollout(rollout, None if current is None
                                                                  else current.rollout), "rollout set")
            return rollout_out(records[alias], served)

    async def delete_rollout(self, alias: str) -> RolloutOut:
        """Remove ``alias``'s rollout (and its previous split): the alias resolves as before it had one."""
        async with self._lock:
            records = await self._rollout_records()
            record = self._find_rollout(records, alias)
            await self._commit(lambda s: s.delete_rollout(alias))
            del records[alias]
            await self._publish_rollouts(records)
            log.info("rollout deleted", extra={"alias": alias, "versions": dict(record.rollout.versions)})
            return rollout_out(record, served_versions(self.controller.state))

    async def rollback(self, alias: str) -> RolloutOut:
        """Put the previous split back; the current one becomes the previous (a second rollback undoes it)."""
        async with self._lock:
            records = await self._rollout_records()
            record = self._find_rollout(records, alias)
            if record.previous is None:
                raise ApiError(409, "no_previous_split", f"the rollout of {alias!r} has no previous split to "
                               "roll back to (it was created by its only PUT)")
            await self._change_rollout(records, StoredRollout(record.previous, record.rollout), "rollout rolled back")
            return rollout_out(records[alias], served_versions(self.controller.state))

    async def _change_rollout(self, records: dict[str, StoredRollout], record: StoredRollout, what: str) -> None:
        await self._commit(lambda s: s.set_rollout(record))
        records[record.alias] = record
        await self._publish_rollouts(records)
        log.info(what, extra={"alias": record.alias, "versions": dict(record.rollout.versions),
                              "sticky": record.rollout.sticky,
                              "previous": None if record.previous is None else dict(record.previous.versions)})

    async def _publish_rollouts(self, records: Mapping[str, StoredRollout]) -> None:
        """Into the state and out to ext_proc now, not after the debounce (the Envoys' snapshot is unchanged)."""
        rollouts = tuple(records[a].rollout for a in sorted(records))
        self.controller.update(lambda state: dataclasses.replace(state, rollouts=rollouts))
        await self.controller.publish()

    # -- usage for billing (control_plane/usage) ------------------------------------------------------

    async def usage(self, tenant: str | None, from_text: str | None, to_text: str | None,
                    granularity: Granularity) -> UsageReport:
        """Usage from the store; 422 naming a bad parameter, 503 without a store or when it fails."""
        try:
            query = usage_query(tenant, from_text, to_text, granularity, datetime.datetime.now(datetime.timezone.utc))
        except BadUsageQuery as exc:
            raise ApiError(422, "validation_error", str(exc),
                           [{"loc": ["query", exc.param], "msg": str(exc), "type": "value_error"}]) from None
        if self.store is None:
            raise ApiError(503, "store_unavailable", "usage is kept in the store, and this control plane has none")
        try:
            return await usage_report(self.store, query)
        except StoreError as exc:
            log.error("usage query failed", extra={"error": str(exc)})
            raise ApiError(503, "store_unavailable", "usage could not be read from the store",
                           {"store": str(exc)}) from exc


    # -- another replica changed the shared store (store.follow) ----------------------------------

    async def reload_from_store(self) -> bool:
        """Read the whole operator state and fold it in; True if anything changed.

        The same fold as startup's ``restore`` (``store.reconcile``): pins, drains and
        registrations from the store; API endpoints gone from it (deregistered on another
        replica) drain and are removed here as a local deregistration does. Under the
        action lock and read inside it, so a reload never undoes a later local action.
        """
        if self.store is None:
            return False
        async with self._lock:
            stored = await self.store.aload()
            policy_before, state_before = self.controller.policy, self.controller.state
            stored = self._apply_stored_policies(stored)
            vanished: tuple[str, ...] = ()

            def change(state: FleetState) -> FleetState:
                nonlocal vanished
                new, vanished = reconcile(state, stored, frozenset(self._removals))
                return new

            self.controller.update(change)
            for endpoint_id in vanished:
                self.controller.update(_replace_endpoint(endpoint_id, draining=True))
                self._start_removal(endpoint_id)
                log.info("endpoint deregistered on another replica: draining", extra={"endpoint": endpoint_id})
            self._rollouts = {r.alias: r for r in stored.rollouts}  # reconcile put the current ones in the state
            keys = {k.id: k for k in stored.api_keys}
            keys_changed = keys != self._api_keys
            if keys_changed:  # created or revoked on another replica
                self._api_keys = keys
                await self._push_api_keys()
            return self.controller.state != state_before or self.controller.policy is not policy_before \
                or keys_changed

    def _apply_stored_policies(self, stored: OperatorState) -> OperatorState:
        """Switch to a changed stored weight policy; ``stored`` without a pick policy that does not validate
        (or is not allowed here: another replica's store rows are no way around this one's allowlist)."""
        allow = self.controller.config.policy_allowlist
        if stored.weight_policy is not None and stored.weight_policy != self._weight_stored:
            self._weight_stored = stored.weight_policy
            try:
                self.controller.set_policy(WeightPolicyRegistry(allow).make(stored.weight_policy.name,
                                                                            stored.weight_policy.params))
                log.info("weight policy changed by another replica", extra={"weight_policy": stored.weight_policy.name})
            except (ValueError, TypeError) as exc:
                log.error("stored weight policy not applied: keeping the current one", extra={"error": str(exc)})
        if stored.pick_policy is not None:
            try:
                pick_catalogue.validate_pick_params(stored.pick_policy.name, stored.pick_policy.params, allow)
            except ValueError as exc:
                log.error("stored pick policy not applied: keeping the current one", extra={"error": str(exc)})
                stored = dataclasses.replace(stored, pick_policy=None)
        return stored


def build_weight_policy(name: str, params: Mapping[str, Any], allow: PolicyAllowlist) -> WeightPolicy:
    """A weight policy from the API's ``{name, params}``: 400 when the name leads to no policy or is not
    allowed (listing what is), 422 when its parameters are wrong (a built-in's, or a ``BadPolicyParams``)."""
    try:
        return WeightPolicyRegistry(allow).make(name, params)
    except (ValueError, TypeError) as exc:
        if name in builtin_weight_policies() or isinstance(exc, plugins.BadPolicyParams):
            raise ApiError(422, "invalid_params", str(exc)) from None
        raise ApiError(400, "unknown_policy", str(exc), available_policies("weight", allow)) from None


def available_policies(kind: str, allow: PolicyAllowlist) -> dict[str, Any]:
    """The ``detail`` of an unknown or refused policy name (``kind`` "weight" or "pick"): what may be named
    instead (for a pick chain, the entry points are its installed plugins)."""
    builtins = builtin_weight_policies() if kind == "weight" else pick_catalogue.CATALOGUE
    steps: tuple[plugins.Kind, ...] = ("weight",) if kind == "weight" else ("admit", "filter", "scorer")
    entry_points = sorted(name for step in steps for name in plugins.entry_point_objects(step))
    return {"available": sorted(builtins), "entry_points": entry_points,
            "allowed_module_prefixes": list(allow.module_prefixes)}


# --- the app -------------------------------------------------------------------------------------------

DESCRIPTION = """\
inferlb's control plane: see and override what it decides.

Every mutation needs `Authorization: Bearer <token>` (the token is in
`<data_dir>/admin-token` unless configured). Reads are open from loopback
unless `admin_auth_reads` is set; `/v1/api-keys` and `/v1/usage` always need it. Changes reach every Envoy and ext_proc
through xDS within about a second, and survive restarts.

Errors: `{"error": {"status", "code", "message", "detail"}}`.
"""


def nginx_status_out(nginx: NginxApplier) -> DataPlaneStatus:
    st = nginx.status()
    error = st.last_error
    return DataPlaneStatus(mode="nginx", nginx=NginxStatusOut(
        config_dir=st.config_dir, listen=st.listen, manage_process=st.manage_process, running=st.running,
        pid=st.pid, version=st.version, digest=st.digest, applied_at=st.applied_at, reloads=st.reloads,
        rejected=st.rejected, cycles=st.cycles, pending=st.pending, failing=st.failing,
        last_error=None if error is None else NginxFailureOut(stage=error.stage, message=error.message,
                                                              digest=error.digest, at=error.at),
        servers=[NginxServerOut(endpoint=s.endpoint_id, weight=s.weight, down=s.down, pinned=s.pinned)
                 for s in st.servers],
    ))


def create_admin_app(controller: Controller, metrics: ControlPlaneMetrics, service: AdminService | None = None,
                     token: AdminToken | None = None, *, auth_reads: bool = False,
                     nginx: NginxApplier | None = None) -> FastAPI:
    """The HTTP app. Without a ``token`` every mutation is refused (401): there is no open mode."""
    service = service or AdminService(controller)
    app = FastAPI(title="inferlb control plane", version="0.1.0", description=DESCRIPTION)

    def check(request: Request) -> None:
        presented = bearer(request.headers.get("authorization"))
        if presented is None:
            raise ApiError(401, "unauthorized", "this needs Authorization: Bearer <admin token>", None,
                           {"WWW-Authenticate": 'Bearer realm="inferlb"'})
        if token is None or not token.matches(presented):
            raise ApiError(401, "unauthorized", "the admin token is wrong", None,
                           {"WWW-Authenticate": 'Bearer realm="inferlb", error="invalid_token"'})

    def needs_token(request: Request) -> bool:
        if request.method not in ("GET", "HEAD", "OPTIONS") or request.url.path.startswith((API_KEYS_PATH, USAGE_PATH)):
            return True
        return auth_reads or not is_loopback(request.client.host if request.client else None)

    @app.middleware("http")
    async def authorise(request: Request, call_next: Callable[[Request], Any]) -> Response:
        """The token check for all of /v1, before the body is even read: no token, no information."""
        if request.url.path.startswith("/v1/") and needs_token(request):
            try:
                check(request)
            except ApiError as exc:
                return error_response(exc.status, exc.code, exc.message, exc.detail, exc.headers)
        return await call_next(request)

    # Outermost (added after the token check): every answer, a 401 too, carries the request's id
    # (x-request-id as sent, else a fresh one), and so do the log lines written for it.
    app.add_middleware(RequestContextMiddleware, generate_id=True, echo_id=True)

    # The same checks as dependencies: they document the bearer scheme in /openapi.json (and /docs).
    async def writer(request: Request, _: Credentials) -> None:
        check(request)

    async def reader(request: Request, _: Credentials) -> None:
        if needs_token(request):
            check(request)

    # -- error shape ----------------------------------------------------------------------------------

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, exc.detail, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(err.get("type") in ("json_invalid", NON_FINITE) for err in errors):
            return error_response(400, "invalid_json", "the body is not valid JSON", _validation_detail(exc))
        return error_response(422, "validation_error", "the request does not match the schema",
                              _validation_detail(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        return error_response(exc.status_code, codes.get(exc.status_code, "http_error"), str(exc.detail), None,
                              getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("admin API error", extra={"path": request.url.path})
        return error_response(500, "internal_error", "unexpected error; see the control plane's log")

    # -- probes and metrics -----------------------------------------------------------------------------

    @app.get("/healthz", summary="Liveness", tags=["probes"])
    async def healthz() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/readyz", summary="Ready once the first snapshot is published and xDS is serving; not ready while "
             "publishing fails", tags=["probes"])
    async def readyz() -> JSONResponse:
        if nginx is not None and not nginx.ready:  # NGINX mode: ready once nginx serves a validated config
            return JSONResponse({"status": "not ready", "reason": "nginx is not serving yet"}, status_code=503)
        publishing = controller.publishing
        if publishing.failing:  # the state Envoys and ext_procs get is stale until a publish succeeds
            return JSONResponse({"status": "not ready", "reason": f"publishing snapshots is failing "
                                 f"({publishing.consecutive_failures} in a row, retrying): {publishing.last_error}"},
                                status_code=503)
        if controller.published.is_set():
            return JSONResponse({"status": "ready", "endpoints": len(controller.state.endpoints)})
        return JSONResponse({"status": "not ready", "reason": "no snapshot published yet"}, status_code=503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response, tags=["probes"])
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    # -- /v1 ---------------------------------------------------------------------------------------------

    read = [Depends(reader)]
    write = [Depends(writer)]
    app.include_router(dashboard_router(service, read))  # /dashboard: the page and its live feed

    @app.get("/v1/endpoints", response_model=EndpointList, dependencies=read, tags=["endpoints"],
             summary="Every endpoint: source, health, drain state, weights and latest telemetry",
             responses=_responses(E401))
    async def list_endpoints() -> EndpointList:
        return service.endpoints()

    @app.post("/v1/endpoints", response_model=EndpointOut, status_code=201, dependencies=write,
              tags=["endpoints"], summary="Register an endpoint (source api)",
              responses=_responses(E400, E401, E409, E422, E503))
    async def register(body: EndpointCreate, response: Response) -> EndpointOut:
        out = await service.register(body)
        response.headers["Location"] = f"/v1/endpoints/{out.id}"
        return out

    @app.get("/v1/endpoints/{endpoint_id}", response_model=EndpointOut, dependencies=read, tags=["endpoints"],
             summary="One endpoint", responses=_responses(E401, E404, E422))
    async def get_endpoint(endpoint_id: EndpointId) -> EndpointOut:
        return service.get(endpoint_id)

    @app.delete("/v1/endpoints/{endpoint_id}", response_model=EndpointOut, status_code=202, dependencies=write,
                tags=["endpoints"],
                summary="Deregister an API endpoint: drain it, then remove it (202: removal under way)",
                responses=_responses(E401, E404, E409, E422, E503))
    async def deregister(endpoint_id: EndpointId) -> EndpointOut:
        return await service.deregister(endpoint_id)

    @app.put("/v1/endpoints/{endpoint_id}/weight", response_model=EndpointOut, dependencies=write,
             tags=["endpoints"], summary="Pin the weight (1..1000): it beats the weight policy",
             responses=_responses(E400, E401, E404, E409, E422, E503))
    async def pin(endpoint_id: EndpointId, body: WeightPin) -> EndpointOut:
        return await service.pin(endpoint_id, body.weight)

    @app.delete("/v1/endpoints/{endpoint_id}/weight", response_model=EndpointOut, dependencies=write,
                tags=["endpoints"], summary="Unpin: the weight policy decides again",
                responses=_responses(E401, E404, E409, E422, E503))
    async def unpin(endpoint_id: EndpointId) -> EndpointOut:
        return await service.pin(endpoint_id, None)

    @app.post("/v1/endpoints/{endpoint_id}/drain", response_model=EndpointOut, dependencies=write,
              tags=["endpoints"], summary="Drain: no new traffic, in-flight requests finish",
              responses=_responses(E401, E404, E409, E422, E503))
    async def drain(endpoint_id: EndpointId) -> EndpointOut:
        return await service.drain(endpoint_id, True)

    @app.delete("/v1/endpoints/{endpoint_id}/drain", response_model=EndpointOut, dependencies=write,
                tags=["endpoints"], summary="Undrain: new traffic again",
                responses=_responses(E401, E404, E409, E422, E503))
    async def undrain(endpoint_id: EndpointId) -> EndpointOut:
        return await service.drain(endpoint_id, False)

    @app.get("/v1/policy", response_model=PolicyState, dependencies=read, tags=["policy"],
             summary="The active weight and pick policies, and the available ones with their parameter schemas",
             responses=_responses(E401))
    async def get_policy() -> PolicyState:
        return service.policy()

    @app.put("/v1/policy", response_model=PolicyState, dependencies=write, tags=["policy"],
             summary="Switch the weight and/or pick policy (parameters validated against its schema)",
             responses=_responses(E400, E401, E422, E503))
    async def put_policy(body: PolicyUpdate) -> PolicyState:
        return await service.set_policy(body)

    @app.get("/v1/xds/clients", response_model=XdsClients, dependencies=read, tags=["xds"],
             summary="Connected Envoys and ext_procs: node, acked versions per type, last NACK",
             responses=_responses(E401))
    async def xds_clients() -> XdsClients:
        return service.xds_clients()

    @app.post(API_KEYS_PATH, response_model=ApiKeyCreated, status_code=201, dependencies=write, tags=["api keys"],
              summary="Create an API key for a tenant: the key is in this answer only (stored as its hash)",
              responses=_responses(E400, E401, E422, E503))
    async def create_api_key(body: ApiKeyCreate, response: Response) -> ApiKeyCreated:
        out = await service.create_api_key(body)
        response.headers["Location"] = f"{API_KEYS_PATH}/{out.id}"
        return out

    @app.get(API_KEYS_PATH, response_model=ApiKeyList, dependencies=write, tags=["api keys"],
             summary="The API keys (live ones unless include_revoked), oldest first; never a key nor its hash",
             responses=_responses(E401, E422))
    async def list_api_keys(tenant: typing.Annotated[str | None, Query(max_length=63)] = None,
                            include_revoked: bool = False) -> ApiKeyList:
        return service.api_keys(tenant, include_revoked)

    @app.get(API_KEYS_PATH + "/{key_id}", response_model=ApiKeyOut, dependencies=write, tags=["api keys"],
             summary="One API key (revoked ones too)", responses=_responses(E401, E404_KEY, E422))
    async def get_api_key(key_id: ApiKeyId) -> ApiKeyOut:
        return service.api_key(key_id)

    @app.delete(API_KEYS_PATH + "/{key_id}", response_model=ApiKeyOut, dependencies=write, tags=["api keys"],
                summary="Revoke an API key: ext_proc refuses it within a push (revoking again keeps the first time)",
                responses=_responses(E401, E404_KEY, E422, E503))
    async def revoke_api_key(key_id: ApiKeyId) -> ApiKeyOut:
        return await service.revoke_api_key(key_id)

    @app.get(USAGE_PATH, response_model=UsageReport, dependencies=write, tags=["usage"],
             summary="Usage for billing per tenant (from the store): totals and buckets of requests, tokens, errors, "
                     "sheds, rate-limited and unauthenticated requests",
             responses=_responses(E401, E422_USAGE, E503))
    async def usage(
        tenant: typing.Annotated[str | None, Query(max_length=63, pattern=TENANT_PATTERN.pattern,
                                                   description="one tenant; unset: all")] = None,
        from_: typing.Annotated[str | None, Query(alias="from", max_length=64,
                                                  description="RFC 3339; default: 24 h before to")] = None,
        to: typing.Annotated[str | None, Query(max_length=64, description="RFC 3339, exclusive; default: now")] = None,
        granularity: Granularity = "hour",
    ) -> UsageReport:
        return await service.usage(tenant, from_, to, granularity)

    @app.get("/v1/models", response_model=ModelCatalogueOut, dependencies=read, tags=["models"],
             summary="What the fleet serves: per model version its endpoints, whether routable, its aliases; "
                     "and the rollouts", responses=_responses(E401, E503))
    async def models() -> ModelCatalogueOut:
        return await service.models()

    @app.get("/v1/rollouts", response_model=RolloutList, dependencies=read, tags=["models"],
             summary="Every rollout: an alias's traffic split over model versions", responses=_responses(E401, E503))
    async def list_rollouts() -> RolloutList:
        return await service.rollouts()

    @app.post("/v1/rollouts/{alias:path}/rollback", response_model=RolloutOut, dependencies=write, tags=["models"],
              summary="Put the previous split back (the current one becomes the previous: a second rollback "
                      "goes forward again)", responses=_responses(E401, E404_ROLLOUT, E409_ROLLBACK, E422, E503))
    async def rollback(alias: Alias) -> RolloutOut:
        return await service.rollback(alias)

    @app.get("/v1/rollouts/{alias:path}", response_model=RolloutOut, dependencies=read, tags=["models"],
             summary="One rollout, with the split a rollback would put back",
             responses=_responses(E401, E404_ROLLOUT, E422, E503))
    async def get_rollout(alias: Alias) -> RolloutOut:
        return await service.rollout(alias)

    @app.put("/v1/rollouts/{alias:path}", response_model=RolloutOut, dependencies=write, tags=["models"],
             summary="Set an alias's split over versions (canary, blue-green); the split it replaces is kept for a "
                     "rollback. Refused (409) when a version is served by no endpoint, unless force",
             responses=_responses(E400, E401, E409_ROLLOUT, E422, E503))
    async def put_rollout(alias: Alias, body: RolloutPut,
                          force: typing.Annotated[bool, Query(description="accept versions no endpoint serves "
                                                                          "(yet)")] = False) -> RolloutOut:
        return await service.set_rollout(alias, body, force)

    @app.delete("/v1/rollouts/{alias:path}", response_model=RolloutOut, dependencies=write, tags=["models"],
                summary="Remove a rollout: the alias resolves as the workers' alias again",
                responses=_responses(E401, E404_ROLLOUT, E422, E503))
    async def delete_rollout(alias: Alias) -> RolloutOut:
        return await service.delete_rollout(alias)

    @app.get("/v1/dataplane", response_model=DataPlaneStatus, dependencies=read, tags=["dataplane"],
             summary="The data plane: envoy (xDS), or nginx with its applied config, reloads and last error",
             responses=_responses(E401))
    async def dataplane() -> DataPlaneStatus:
        return DataPlaneStatus(mode="envoy", nginx=None) if nginx is None else nginx_status_out(nginx)

    _match_any_path_value(app)
    return app


def _match_any_path_value(app: FastAPI) -> None:
    """Let ``{name:path}`` parameters (a rollout's alias may contain '/') match any character, newlines too.

    Starlette's ``path`` convertor is ``.*``, whose ``.`` stops at a newline: ``PUT /v1/rollouts/a%0Ab``
    matched no route and got a bare 404 "Not Found" (schemathesis found it). Matched, the value meets its
    parameter's own validation: a 422 naming the alias and its pattern."""
    for route in app.routes:
        regex = getattr(route, "path_regex", None)
        if regex is not None and ":path}" in getattr(route, "path_format", "") + getattr(route, "path", ""):
            route.path_regex = re.compile(regex.pattern, regex.flags | re.DOTALL)
