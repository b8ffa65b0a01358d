"""The pick policies ext_proc runs, as the control plane knows them: to list them and validate
``PUT /v1/policy``.

Why not an import of ext_proc: the services never import each other
(docs/design.md), and a pick policy reaches ext_proc as EDS metadata only.
Why not validate lazily in ext_proc: an operator should get a 4xx naming the
bad parameter at once, not a silent fallback in every ext_proc replica
later. Both services read the same definitions
(``inferlb_runtime/pick_chain.py``: the named policies, the built-in
plugins and their parameters) with the same validator, so there is nothing
here to keep in step with ext_proc.

A user plugin named in a policy's ``admit``, ``filters`` or ``scorers`` must
be an installed ``inferlb.policies`` entry point of that step, or a
``module:attribute`` spec under a module prefix the control plane's
allowlist names (checked on the string: the control plane never imports
it). Its parameters go to ext_proc unchecked but JSON-clean (finite
numbers): only ext_proc imports it, and it checks the spec against its own
allowlist again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inferlb_runtime import pick_chain, plugins
from inferlb_runtime.pick_chain import DEFAULT_PICK_POLICY, EXTRA_STEPS, PRESETS


@dataclass(frozen=True)
class PickPolicyInfo:
    name: str
    summary: str
    params: type

    def schema(self) -> dict[str, Any]:
        schema = plugins.dataclass_schema(self.params)
        for key, step in EXTRA_STEPS.items():
            schema.setdefault("properties", {})[key] = {
                "type": "array", "description": f"{step} plugins added to the chain: [{{plugin, params"
                                                f"{', weight' if step == 'scorer' else ''}}}]",
                "items": {"type": "object"}}
        return schema

    def defaults(self) -> dict[str, Any]:
        return pick_chain.preset_defaults(self.name)


CATALOGUE: Mapping[str, PickPolicyInfo] = {p.name: PickPolicyInfo(p.name, p.summary, p.params)
                                           for p in PRESETS.values()}


UnknownPickPolicy = plugins.PolicyNotFound  # unknown policy or plugin, or one the allowlist refuses (a 400)
BadPickParams = plugins.BadPolicyParams  # wrong parameters (a 422)


def validate_pick_params(name: str, params: Mapping[str, Any],
                         allow: plugins.PolicyAllowlist = plugins.PolicyAllowlist()) -> dict[str, Any]:
    """The parameters as they go to ext_proc: only those given, typed (``"d": 4.0`` becomes 4).

    ``UnknownPickPolicy`` or ``BadPickParams`` (both ValueError) saying what is wrong and where.
    """
    pick_chain.chain_spec(name, params, allow)
    parsed = plugins.parse_params(f"pick policy {name!r}", PRESETS[name].params,
                                  {k: v for k, v in params.items() if k not in EXTRA_STEPS})
    return {key: params[key] if key in EXTRA_STEPS else getattr(parsed, key) for key in params}


def effective_pick_params(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults overlaid with ``params`` (what ext_proc runs with), for display."""
    return {**(pick_chain.preset_defaults(name) if name in PRESETS else {}), **params}


__all__ = ["BadPickParams", "CATALOGUE", "DEFAULT_PICK_POLICY", "PickPolicyInfo", "UnknownPickPolicy",
           "effective_pick_params", "validate_pick_params"]
