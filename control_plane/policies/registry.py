"""Loading and describing weight policies: the one place the control plane turns a name into a policy.

A name comes from the configuration, the admin API (``PUT /v1/policy``) or
another replica's store rows, so it is untrusted. ``WeightPolicyRegistry``
holds the operator's ``PolicyAllowlist`` and builds a built-in
(``policies/builtins.py``) by name, else a user policy: an ``inferlb.policies``
entry point whose object declares ``kind = "weight"``, or a
``module:attribute`` spec under a module prefix the allowlist names.
Built-ins and user policies go through the same
``inferlb_runtime.plugins.instantiate``, so one validator
(``plugins.parse_params``, against the policy's ``Params`` dataclass) checks
every policy's parameters. ``describe()`` lists what can be chosen, with each
one's parameter schema, for ``GET /v1/policy``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from inferlb_runtime import plugins

from .builtins import builtin_weight_policies
from .contract import WeightPolicy


class WeightPolicyRegistry:
    """Weight policies that may be named under ``allow`` (no ``module:attribute`` spec by default)."""

    def __init__(self, allow: plugins.PolicyAllowlist = plugins.PolicyAllowlist()) -> None:
        self.allow = allow

    def make(self, name: str, params: Mapping[str, Any] | None = None) -> WeightPolicy:
        """The policy ``name`` built with validated ``params``.

        ``ValueError`` with a clear message on any bad input: ``plugins.PolicyNotFound`` (answer 400) when
        the name leads to no weight policy or is not allowed, listing what may be named;
        ``plugins.BadPolicyParams`` (answer 422) when its parameters are wrong.
        """
        builtins = builtin_weight_policies()
        obj = builtins.get(name)
        if obj is None:
            try:
                obj, _ = plugins.resolve("weight", name, self.allow)
            except plugins.PolicyNotFound as exc:
                raise plugins.PolicyNotFound(
                    f"{exc}; {plugins.allowed_names('weight', builtins, self.allow)}") from None
        policy: WeightPolicy = plugins.instantiate("weight", name, obj, params)
        return policy

    def describe(self) -> list[dict[str, Any]]:
        """Every selectable weight policy: ``{name, kind, summary, params_schema, source}``, built-ins first.

        Entry points are imported to describe them (a broken one is logged and left out); ``module:attribute``
        policies cannot be listed, only named.
        """
        builtins = builtin_weight_policies()
        described = [plugins.describe("weight", name, cls, "builtin") for name, cls in sorted(builtins.items())]
        described += [d for d in plugins.describe_entry_points("weight") if d["name"] not in builtins]
        return described


def make_weight_policy(name: str, params: Mapping[str, Any] | None = None,
                       allow: plugins.PolicyAllowlist = plugins.PolicyAllowlist()) -> WeightPolicy:
    """Shorthand for ``WeightPolicyRegistry(allow).make(name, params)`` (the simulator, tests, one-off checks)."""
    return WeightPolicyRegistry(allow).make(name, params)


def weight_policy_params(policy: WeightPolicy) -> dict[str, object]:
    """A policy's parameters as plain values (for ``GET /v1/policy``); empty for policies without ``params``."""
    params = getattr(policy, "params", None)
    return dataclasses.asdict(params) if dataclasses.is_dataclass(params) and not isinstance(params, type) else {}


__all__ = ["WeightPolicyRegistry", "make_weight_policy", "weight_policy_params"]
