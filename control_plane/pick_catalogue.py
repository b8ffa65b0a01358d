"""The pick policies ext_proc has built in, as the control plane knows them: names,
summaries and parameter schemas, to list them and validate ``PUT /v1/policy``.

Why a catalogue and not an import: the services never import each other
(docs/design.md), and a pick policy reaches ext_proc as EDS metadata only. Why not
validate lazily in ext_proc: an operator should get a 4xx naming the bad
parameter at once, not a silent fallback in every ext_proc replica later.
The cost is that this file mirrors ``ext_proc/policies.py``; a test
(``tests/test_admin_api.py``) fails when the two disagree on names,
parameters or defaults. Ranges here may be stricter than ext_proc's (numbers
travel as doubles in the metadata, so integers stay below 2**53).

A name that is not built in must be an installed ``inferlb.policies``
entry point of kind ``pick``, or a ``module:attribute`` spec under a module
prefix the control plane's allowlist names (checked on the string: the
control plane never imports a pick spec). Its parameters go to ext_proc
unchecked but JSON-clean (finite numbers): only ext_proc can import it, and
it checks the spec against its own allowlist again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from inferlb_runtime import plugins

MAX_SEED = 2**53


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class LeastCompletionTimeParams(_Params):
    d: int = Field(4, ge=1, le=1000, description="candidates scored per decision on larger fleets (power-of-d)")
    weight_exponent: float = Field(0.0, ge=0.0, le=4.0,
                                   description="0: the cost model alone judges speed; 1: weights as relative capacity")
    sample_weighted: bool = Field(False, description="sample the d candidates proportionally to weight (else uniformly)")
    fallbacks: int = Field(2, ge=0, le=2, description="retry fallbacks after the primary pick")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="random seed (tests); null: random")


class RoundRobinParams(_Params):
    fallbacks: int = Field(2, ge=0, le=2, description="retry fallbacks after the primary pick")


class LeastOutstandingParams(_Params):
    d: int = Field(0, ge=0, le=1000, description="0: look at every endpoint; > 0: sample d")
    fallbacks: int = Field(2, ge=0, le=2, description="retry fallbacks after the primary pick")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="random seed (tests); null: random")


class P2CTokensParams(_Params):
    sample_weighted: bool = Field(True, description="sample the two candidates proportionally to weight")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="random seed (tests); null: random")


@dataclass(frozen=True)
class PickPolicyInfo:
    name: str
    summary: str
    params: type[_Params]

    def schema(self) -> dict[str, Any]:
        schema = self.params.model_json_schema()
        schema.pop("title", None)
        return schema

    def defaults(self) -> dict[str, Any]:
        return self.params().model_dump()


CATALOGUE: Mapping[str, PickPolicyInfo] = {p.name: p for p in (
    PickPolicyInfo("least_completion_time",
                   "least predicted completion time (outstanding work + this request's cost), power-of-d",
                   LeastCompletionTimeParams),
    PickPolicyInfo("round_robin", "each routable endpoint in turn", RoundRobinParams),
    PickPolicyInfo("least_outstanding", "fewest requests in flight from this ext_proc", LeastOutstandingParams),
    PickPolicyInfo("p2c_tokens", "power of two choices on outstanding tokens", P2CTokensParams),
)}
DEFAULT_PICK_POLICY = "least_completion_time"


class UnknownPickPolicy(ValueError):
    pass


def validate_pick_params(name: str, params: Mapping[str, Any],
                         allow: plugins.PolicyAllowlist = plugins.PolicyAllowlist()) -> dict[str, Any]:
    """The parameters as they go to ext_proc (only those given, validated and typed).

    ``UnknownPickPolicy`` for a name that is neither built in, nor an installed pick entry point, nor a
    ``module:attribute`` spec ``allow`` allows (the message lists what is); pydantic's ``ValidationError``
    for bad parameters.
    """
    info = CATALOGUE.get(name)
    if info is None:
        if plugins.is_spec(name) and allow.allows(name) or name in plugins.entry_point_objects("pick"):
            return dict(params)
        why = "is not allowed" if plugins.is_spec(name) else "is unknown"
        raise UnknownPickPolicy(f"pick policy {name!r} {why}; {plugins.allowed_names('pick', CATALOGUE, allow)}")
    validated = info.params.model_validate(dict(params))
    return {key: getattr(validated, key) for key in params}


def effective_pick_params(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults overlaid with ``params`` (what ext_proc runs with), for display."""
    info = CATALOGUE.get(name)
    return {**(info.defaults() if info is not None else {}), **params}


__all__ = ["CATALOGUE", "DEFAULT_PICK_POLICY", "PickPolicyInfo", "UnknownPickPolicy", "ValidationError",
           "effective_pick_params", "validate_pick_params"]
