"""``AdminService``: the operator actions on the controller's state, persisted in the store.

One object for the app, the dashboard and ``__main__``: it owns the shared
action machinery (``actions.Actions``: one lock, store first) and hands each
responsibility to its own part (endpoints, policies, tenants, rollouts). It
also folds in what another control-plane replica wrote to a shared store.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from ..api_models import (
    ApiKeyCreate,
    ApiKeyCreated,
    ApiKeyList,
    ApiKeyOut,
    EndpointCreate,
    EndpointList,
    EndpointOut,
    ModelCatalogueOut,
    PolicyState,
    PolicyUpdate,
    RolloutList,
    RolloutOut,
    RolloutPut,
    UsageReport,
    XdsClients,
)
from ..controller import Controller
from ..model import Endpoint, FleetState
from ..store import OperatorStore, StoredApiKey, StoredPolicy, reconcile
from ..usage.query import Granularity
from .actions import Actions
from .endpoint_actions import DEFAULT_DEREGISTRATION_DRAIN_S, EndpointActions
from .policy_actions import PolicyActions
from .rollout_actions import RolloutActions
from .tenant_actions import TenantActions
from .views import xds_clients_out

log = logging.getLogger("inferlb.control_plane.admin")


class AdminService:
    """Operator actions on the controller's state, persisted in the store (see ``actions``)."""

    def __init__(self, controller: Controller, store: OperatorStore | None = None, *,
                 deregistration_drain_s: float = DEFAULT_DEREGISTRATION_DRAIN_S,
                 stored_weight_policy: StoredPolicy | None = None, api_keys: Iterable[StoredApiKey] = ()) -> None:
        self.controller = controller
        self.store = store
        self.actions = Actions(controller, store)
        self.endpoint_actions = EndpointActions(self.actions, deregistration_drain_s)
        self.policy_actions = PolicyActions(self.actions, stored_weight_policy)
        self.tenant_actions = TenantActions(self.actions, api_keys)
        self.rollout_actions = RolloutActions(self.actions)
        self.closing = asyncio.Event()  # set by stop: long-lived responses (the dashboard's feed) end

    @property
    def deregistration_drain_s(self) -> float:
        return self.endpoint_actions.deregistration_drain_s

    async def stop(self) -> None:
        self.closing.set()
        await self.endpoint_actions.stop()

    # -- endpoints ------------------------------------------------------------------------------------

    def endpoint_out(self, e: Endpoint, now: float | None = None) -> EndpointOut:
        return self.endpoint_actions.endpoint_out(e, now)

    def endpoints(self) -> EndpointList:
        return self.endpoint_actions.endpoints()

    def find(self, endpoint_id: str) -> Endpoint:
        return self.endpoint_actions.find(endpoint_id)

    def get(self, endpoint_id: str) -> EndpointOut:
        return self.endpoint_actions.get(endpoint_id)

    async def register(self, body: EndpointCreate) -> EndpointOut:
        return await self.endpoint_actions.register(body)

    async def deregister(self, endpoint_id: str) -> EndpointOut:
        return await self.endpoint_actions.deregister(endpoint_id)

    async def pin(self, endpoint_id: str, weight: int | None) -> EndpointOut:
        return await self.endpoint_actions.pin(endpoint_id, weight)

    async def drain(self, endpoint_id: str, draining: bool) -> EndpointOut:
        return await self.endpoint_actions.drain(endpoint_id, draining)

    # -- policies and xDS clients ---------------------------------------------------------------------

    def policy(self) -> PolicyState:
        return self.policy_actions.policy()

    async def set_policy(self, update: PolicyUpdate) -> PolicyState:
        return await self.policy_actions.set_policy(update)

    def xds_clients(self) -> XdsClients:
        return xds_clients_out(self.controller.cache)

    # -- tenants: API keys and usage ------------------------------------------------------------------

    def api_keys(self, tenant: str | None = None, include_revoked: bool = False) -> ApiKeyList:
        return self.tenant_actions.api_keys(tenant, include_revoked)

    def api_key(self, key_id: str) -> ApiKeyOut:
        return self.tenant_actions.api_key(key_id)

    async def create_api_key(self, body: ApiKeyCreate) -> ApiKeyCreated:
        return await self.tenant_actions.create_api_key(body)

    async def revoke_api_key(self, key_id: str) -> ApiKeyOut:
        return await self.tenant_actions.revoke_api_key(key_id)

    async def usage(self, tenant: str | None, from_text: str | None, to_text: str | None,
                    granularity: Granularity) -> UsageReport:
        return await self.tenant_actions.usage(tenant, from_text, to_text, granularity)

    # -- models and rollouts --------------------------------------------------------------------------

    async def models(self) -> ModelCatalogueOut:
        return await self.rollout_actions.models()

    async def rollouts(self) -> RolloutList:
        return await self.rollout_actions.rollouts()

    async def rollout(self, alias: str) -> RolloutOut:
        return await self.rollout_actions.rollout(alias)

    async def set_rollout(self, alias: str, body: RolloutPut, force: bool) -> RolloutOut:
        return await self.rollout_actions.set_rollout(alias, body, force)

    async def delete_rollout(self, alias: str) -> RolloutOut:
        return await self.rollout_actions.delete_rollout(alias)

    async def rollback(self, alias: str) -> RolloutOut:
        return await self.rollout_actions.rollback(alias)

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
        removals = self.endpoint_actions.removals
        async with self.actions.lock:
            stored = await self.store.aload()
            policy_before, state_before = self.controller.policy, self.controller.state
            stored = self.policy_actions.apply_stored(stored)
            vanished: tuple[str, ...] = ()

            def change(state: FleetState) -> FleetState:
                nonlocal vanished
                new, vanished = reconcile(state, stored, frozenset(removals))
                return new

            self.controller.update(change)
            for endpoint_id in vanished:
                self.endpoint_actions.start_removal(endpoint_id)
                log.info("endpoint deregistered on another replica: draining", extra={"endpoint": endpoint_id})
            self.rollout_actions.replace_records(stored.rollouts)  # reconcile put the current ones in the state
            keys_changed = await self.tenant_actions.replace_keys(stored.api_keys)  # created or revoked elsewhere
            return self.controller.state != state_before or self.controller.policy is not policy_before \
                or keys_changed
