"""Policy actions: the active weight and pick policies, switching them, and folding in another replica's.

A weight policy runs here (the controller's); a pick policy is a name and
parameters ext_proc builds its pick chain from, validated here against the
same catalogue and the operator's allowlist before anything is stored.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from inferlb_runtime import plugins
from inferlb_runtime.plugins import PolicyAllowlist

from ..api_models import ActivePolicy, AvailablePolicies, PolicyState, PolicyUpdate
from ..model import PickPolicySpec
from ..policies import pick_catalogue
from ..policies.builtins import builtin_weight_policies
from ..policies.contract import WeightPolicy
from ..policies.registry import WeightPolicyRegistry, weight_policy_params
from ..store import OperatorState, PolicyKind, StoredPolicy
from .actions import Actions
from .errors import ApiError
from .views import json_safe, pick_policy_catalogue, weight_policy_catalogue

log = logging.getLogger("inferlb.control_plane.admin")


class PolicyActions:
    """The policies' view and switch; remembers the stored weight policy the controller runs."""

    def __init__(self, actions: Actions, stored_weight_policy: StoredPolicy | None = None) -> None:
        self.actions = actions
        self.controller = actions.controller
        # The stored weight policy the controller runs (restored or set): a reload rebuilds it only on a change.
        self._weight_stored = stored_weight_policy

    def policy(self) -> PolicyState:
        pick = self.controller.state.pick_policy
        weight = self.controller.policy
        return PolicyState(
            weight=ActivePolicy(name=weight.name, params=json_safe(weight_policy_params(weight))),
            pick=ActivePolicy(name=pick.name,
                              params=json_safe(pick_catalogue.effective_pick_params(pick.name, pick.params))),
            available=AvailablePolicies(weight=weight_policy_catalogue(), pick=pick_policy_catalogue()),
        )

    async def set_policy(self, update: PolicyUpdate) -> PolicyState:
        weight_policy: WeightPolicy | None = None
        pick: PickPolicySpec | None = None
        stored: dict[PolicyKind, StoredPolicy] = {}
        allow = self.controller.config.policy_allowlist
        if update.weight is not None:
            weight_policy = build_weight_policy(update.weight.name, update.weight.params, allow)
            stored["weight"] = StoredPolicy(update.weight.name, dict(update.weight.params))
        if update.pick is not None:
            pick = _pick_policy(update.pick.name, update.pick.params, allow)
            stored["pick"] = StoredPolicy(pick.name, pick.params)
        async with self.actions.lock:
            await self.actions.commit(lambda s: s.set_policies(stored))
            if weight_policy is not None:
                self.controller.set_policy(weight_policy)
                self._weight_stored = stored["weight"]
            if pick is not None:
                self.controller.update(lambda state: dataclasses.replace(state, pick_policy=pick))
            log.info("policy changed", extra={"policies": {k: v.name for k, v in stored.items()}})
        return self.policy()

    def apply_stored(self, stored: OperatorState) -> OperatorState:
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


def _pick_policy(name: str, params: Mapping[str, Any], allow: PolicyAllowlist) -> PickPolicySpec:
    """The API's pick ``{name, params}`` validated: 400 for a name that is unknown or not allowed, 422 for
    bad parameters."""
    try:
        return PickPolicySpec(name, pick_catalogue.validate_pick_params(name, params, allow))
    except pick_catalogue.UnknownPickPolicy as exc:
        raise ApiError(400, "unknown_policy", str(exc), available_policies("pick", allow)) from None
    except pick_catalogue.BadPickParams as exc:
        raise ApiError(422, "invalid_params", str(exc)) from None


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
