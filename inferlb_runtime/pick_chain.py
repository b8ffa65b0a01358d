"""The pick chain as both services name it: built-in plugins, their parameters, and the named policies.

A request is decided by a chain of steps (ext_proc/pick/chain.py runs it)::

    filters -> sample -> cost -> budget -> admit -> scorers -> picker

* **filters** narrow the candidates (routable and the replica's partition always come first);
* **sample** keeps at most ``d`` of them, so that a decision on 10,000 endpoints stays O(d);
* each survivor is **costed** (predicted service time, outstanding work);
* a request with a deadline keeps only the candidates predicted to finish within its **budget**, when any is;
* **admit** plugins may answer the request themselves (shed it, serve it from a cache); they come after
  the costing because shedding judges by the predicted completion (costing d candidates is microseconds);
* **scorers** give each candidate a score in [0, 1] (higher is better), summed with the scorers' weights;
* the **picker** chooses the primary and the retry fallbacks.

Every preset's filters start with ``model``: the body's ``model`` (a version, a
worker alias, or a rollout alias split over versions) narrows the candidates
to the endpoints serving it, or the request is answered 404
``model_not_found`` / 503 ``model_unavailable`` (a no-op while no endpoint
says what it serves). ext_proc adds ``slow_start`` after it from its own
configuration (a window per ext_proc, not a policy parameter).

A *policy* is a configuration of that chain. The names operators have used
(``least_completion_time``, ``round_robin``, ``least_outstanding``,
``p2c_tokens``) are presets: each expands its parameters into a
:class:`ChainSpec`, and each accepts extra ``admit``, ``filters`` and
``scorers`` (built-in or user plugins) appended to its own. So sticky
sessions are one scorer added to the default chain, not a copy of it::

    {"name": "least_completion_time",
     "params": {"scorers": [{"plugin": "examples.policies.sticky_session:SessionAffinity", "weight": 0.25}]}}

Why this lives in the runtime: the control plane validates a policy when an
operator sets it (a 4xx naming the bad parameter at once, not a silent
fallback in every ext_proc replica later) and ext_proc builds it from EDS
metadata; with the definitions here, both use the same ones and the same
validator (:func:`inferlb_runtime.plugins.parse_params`). A user plugin's
name is only checked as a string here (entry point or allowed
``module:attribute``); its parameters are checked where it is imported,
in ext_proc.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from annotated_types import Ge, Le

from . import plugins

Step = Literal["admit", "filter", "scorer", "picker"]
USER_STEPS: tuple[Step, ...] = ("admit", "filter", "scorer")  # what a user plugin may be
MAX_SEED = 2**53  # numbers travel as doubles in EDS metadata
MAX_PLUGINS = 16  # per step: a chain is a handful of plugins, not a program


# Parameter types with their bounds: checked by plugins.parse_params, shown in the JSON schemas.
Fallbacks = Annotated[int, Ge(0), Le(2)]  # retry fallbacks after the primary pick (Endpoint Picker Protocol)
Seed = Annotated[int, Ge(0), Le(MAX_SEED)] | None  # random seed (tests); null: random
SampleSize = Annotated[int, Ge(0), Le(1000)]
SloMs = Annotated[float, Ge(0.0), Le(3_600_000.0)]  # a predicted completion, in ms
DEFAULT_SLO_MS = 2000.0


# --- built-in plugin parameters ---------------------------------------------------------------------


@dataclass(frozen=True)
class SampleParams:
    """How many candidates are costed: all of them (``d`` 0) or ``d`` distinct ones at random."""

    d: SampleSize = 4
    weighted: bool = False  # sample proportionally to EDS weight (else uniformly)
    seed: Seed = None


@dataclass(frozen=True)
class RotateParams:
    """Round robin's filter: the next ``width`` routable endpoints in EDS order, one step further each time."""

    width: Annotated[int, Ge(1), Le(3)] = 3


@dataclass(frozen=True)
class CompletionTimeParams:
    """Predicted completion: outstanding work + this request's cost, over weight ** ``weight_exponent``."""

    weight_exponent: Annotated[float, Ge(0.0), Le(4.0)] = 0.0


@dataclass(frozen=True)
class ShedParams:
    """Shed a ``sheddable`` request (429) when even the best candidate's predicted completion is over
    ``slo_ms``; the client is told to retry after the predicted excess, at least ``retry_after_s``.

    ``queue_model`` says how its wait is predicted: ``priority`` (the workers serve by class) counts the
    critical and standard work that will arrive during it, from the rate ext_proc routes there (averaged
    over ``rate_window_s``); ``fifo`` only the work queued now."""

    slo_ms: SloMs = DEFAULT_SLO_MS
    retry_after_s: Annotated[int, Ge(1), Le(3600)] = 1
    queue_model: Literal["priority", "fifo"] = "priority"
    rate_window_s: Annotated[float, Ge(0.1), Le(60.0)] = 1.0


@dataclass(frozen=True)
class ModelParams:
    """Route by the body's ``model``; ``seed`` fixes the random buckets of non-sticky rollouts (tests)."""

    seed: Seed = None


@dataclass(frozen=True)
class SlowStartParams:
    """An endpoint that turned routable less than ``window_s`` ago is a candidate for a growing share of the
    requests (a linear ramp from ``min_share``), so that a cold worker is not flooded by the picks its empty
    queue attracts. Endpoints of ext_proc's first view are not ramped (they were serving already)."""

    window_s: Annotated[float, Ge(0.0), Le(3600.0)] = 10.0
    min_share: Annotated[float, Ge(0.0), Le(1.0)] = 0.1
    seed: Seed = None


@dataclass(frozen=True)
class FailingParams:
    """An endpoint whose ``error_rate`` telemetry is over ``max_error_rate`` is left out of the candidates
    (while others remain), except for a ``probe_share`` of requests, so it can show it has recovered."""

    max_error_rate: Annotated[float, Ge(0.0), Le(1.0)] = 0.5
    probe_share: Annotated[float, Ge(0.0), Le(1.0)] = 0.02
    seed: Seed = None


@dataclass(frozen=True)
class NoParams:
    """A plugin without parameters."""


@dataclass(frozen=True)
class MaxScoreParams:
    """The highest total score wins, exact ties at random; the next ``fallbacks`` are the retry fallbacks."""

    fallbacks: Fallbacks = 2
    seed: Seed = None


@dataclass(frozen=True)
class InOrderParams:
    """The candidates in the order the filters left them (round robin's rotation)."""

    fallbacks: Fallbacks = 2


@dataclass(frozen=True)
class BuiltinPlugin:
    """A plugin ext_proc has built in: the step it serves, its parameters class, what it does."""

    name: str
    step: Step
    params: type
    summary: str


BUILTIN_PLUGINS: Mapping[str, BuiltinPlugin] = {p.name: p for p in (
    BuiltinPlugin("shed", "admit", ShedParams,
                  "429 for a sheddable request when the best predicted completion is over the SLO (by default "
                  "counting the higher classes' work arriving while it waits)"),
    BuiltinPlugin("model", "filter", ModelParams, "the endpoints serving the body's model (a version, an alias, or "
                  "a rollout's version); 404 model_not_found for a name the fleet does not serve"),
    BuiltinPlugin("failing", "filter", FailingParams,
                  "leaves out endpoints answering mostly errors (error_rate telemetry), but for a share of probes"),
    BuiltinPlugin("slow_start", "filter", SlowStartParams,
                  "a newly routable endpoint takes a share of requests ramping up over a window"),
    BuiltinPlugin("rotate", "filter", RotateParams, "the next few routable endpoints in turn (round robin)"),
    BuiltinPlugin("completion_time", "scorer", CompletionTimeParams,
                  "least predicted completion time: outstanding work + this request's predicted cost"),
    BuiltinPlugin("outstanding_requests", "scorer", NoParams, "fewest requests this ext_proc has in flight there"),
    BuiltinPlugin("outstanding_tokens", "scorer", NoParams, "fewest tokens this ext_proc has in flight there"),
    BuiltinPlugin("max_score", "picker", MaxScoreParams, "highest total score, ties at random"),
    BuiltinPlugin("in_order", "picker", InOrderParams, "the candidates in the filters' order"),
)}


# --- the chain ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PluginRef:
    """One plugin of a chain: a built-in name, an ``inferlb.policies`` entry point or a ``module:attribute``
    spec, its raw parameters, and (scorers) the weight of its score in the total."""

    plugin: str
    params: Mapping[str, Any] = field(default_factory=dict)
    weight: float = 1.0

    @property
    def builtin(self) -> BuiltinPlugin | None:
        return BUILTIN_PLUGINS.get(self.plugin)


@dataclass(frozen=True)
class ChainSpec:
    """A whole chain, validated: what ext_proc builds and runs."""

    policy: str  # the preset it came from, for metrics and logs
    admit: tuple[PluginRef, ...] = ()
    filters: tuple[PluginRef, ...] = ()
    sample: SampleParams = SampleParams(d=0)
    scorers: tuple[PluginRef, ...] = ()
    picker: PluginRef = PluginRef("max_score")


@dataclass(frozen=True)
class _RefParams:
    """The shape of one plugin entry in a policy's ``admit``, ``filters`` or ``scorers`` list."""

    plugin: str
    params: Mapping[str, Any] | None = None
    weight: Annotated[float, Ge(0.0), Le(1000.0)] = 1.0  # scorers only


# --- presets (the policy names) ---------------------------------------------------------------------


@dataclass(frozen=True)
class Admission:
    """What every preset accepts about admission: sheddable requests are shed (429) when the fleet's best
    predicted completion for them is over ``slo_ms``; 0 turns shedding off. Critical and standard
    requests are never shed."""

    slo_ms: SloMs = DEFAULT_SLO_MS


def _admission(p: Admission) -> tuple[PluginRef, ...]:
    return (PluginRef("shed", {"slo_ms": p.slo_ms}),) if p.slo_ms > 0 else ()


MODEL_FILTER = PluginRef("model")  # the head of every preset's filters
FAILING_FILTER = PluginRef("failing")  # next in every preset: a worker answering errors fast attracts no picks


@dataclass(frozen=True)
class LeastCompletionTimeParams(Admission):
    d: Annotated[int, Ge(1), Le(1000)] = 4  # candidates costed per decision on larger fleets (power-of-d)
    weight_exponent: Annotated[float, Ge(0.0), Le(4.0)] = 0.0  # 0: the cost model alone judges speed; 1: weights
    sample_weighted: bool = False  # sample the d candidates proportionally to weight (else uniformly)
    fallbacks: Fallbacks = 2
    seed: Seed = None


@dataclass(frozen=True)
class RoundRobinParams(Admission):
    fallbacks: Fallbacks = 2


@dataclass(frozen=True)
class LeastOutstandingParams(Admission):
    d: SampleSize = 0  # 0: look at every endpoint; > 0: sample d
    fallbacks: Fallbacks = 2
    seed: Seed = None


@dataclass(frozen=True)
class P2CTokensParams(Admission):
    sample_weighted: bool = True  # sample the two candidates proportionally to weight
    seed: Seed = None


def _model(seed: int | None) -> PluginRef:
    return MODEL_FILTER if seed is None else PluginRef("model", {"seed": seed})


def _least_completion_time(p: LeastCompletionTimeParams) -> ChainSpec:
    return ChainSpec("least_completion_time", admit=_admission(p), filters=(_model(p.seed), FAILING_FILTER),
                     sample=SampleParams(p.d, p.sample_weighted, p.seed),
                     scorers=(PluginRef("completion_time", {"weight_exponent": p.weight_exponent}),),
                     picker=PluginRef("max_score", {"fallbacks": p.fallbacks, "seed": p.seed}))


def _round_robin(p: RoundRobinParams) -> ChainSpec:
    return ChainSpec("round_robin", admit=_admission(p),
                     filters=(MODEL_FILTER, FAILING_FILTER, PluginRef("rotate", {"width": 1 + p.fallbacks})),
                     picker=PluginRef("in_order", {"fallbacks": p.fallbacks}))


def _least_outstanding(p: LeastOutstandingParams) -> ChainSpec:
    return ChainSpec("least_outstanding", admit=_admission(p), filters=(_model(p.seed), FAILING_FILTER),
                     sample=SampleParams(p.d, False, p.seed),
                     scorers=(PluginRef("outstanding_requests"),),
                     picker=PluginRef("max_score", {"fallbacks": p.fallbacks, "seed": p.seed}))


def _p2c_tokens(p: P2CTokensParams) -> ChainSpec:
    return ChainSpec("p2c_tokens", admit=_admission(p), filters=(_model(p.seed), FAILING_FILTER),
                     sample=SampleParams(2, p.sample_weighted, p.seed),
                     scorers=(PluginRef("outstanding_tokens"),),
                     picker=PluginRef("max_score", {"fallbacks": 1, "seed": p.seed}))


@dataclass(frozen=True)
class Preset:
    """A named policy: its own parameters and the chain they expand to."""

    name: str
    params: type
    expand: Any  # Callable[[params], ChainSpec]
    summary: str


PRESETS: Mapping[str, Preset] = {p.name: p for p in (
    Preset("least_completion_time", LeastCompletionTimeParams, _least_completion_time,
           "least predicted completion time (outstanding work + this request's cost), power-of-d"),
    Preset("round_robin", RoundRobinParams, _round_robin, "each routable endpoint in turn"),
    Preset("least_outstanding", LeastOutstandingParams, _least_outstanding,
           "fewest requests in flight from this ext_proc"),
    Preset("p2c_tokens", P2CTokensParams, _p2c_tokens, "power of two choices on outstanding tokens"),
)}
DEFAULT_PICK_POLICY = "least_completion_time"
EXTRA_STEPS: Mapping[str, Step] = {"admit": "admit", "filters": "filter", "scorers": "scorer"}


def _user_plugin(where: str, step: Step, name: str, allow: plugins.PolicyAllowlist) -> None:
    """Refuse a user plugin name that could not be loaded as ``step`` (checked on the string only)."""
    if plugins.is_spec(name):
        if not allow.allows(name):
            raise plugins.PolicyNotFound(f"{where}: plugin {name!r} is not allowed: module {name.split(':', 1)[0]!r} "
                                         f"is not under a module prefix the operator allows; {_allowed(step, allow)}")
        return
    found = plugins.entry_point_objects(step)
    if name not in found:
        raise plugins.PolicyNotFound(f"{where}: unknown plugin {name!r}; {_allowed(step, allow)}")


def _allowed(step: Step, allow: plugins.PolicyAllowlist) -> str:
    return plugins.allowed_names(step, [p.name for p in BUILTIN_PLUGINS.values() if p.step == step], allow)


def _refs(where: str, step: Step, raw: Any, allow: plugins.PolicyAllowlist) -> tuple[PluginRef, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)):
        raise plugins.BadPolicyParams(f"{where}: must be a list of {{plugin, params, weight}}, got "
                                      f"{type(raw).__name__}")
    if len(raw) > MAX_PLUGINS:
        raise plugins.BadPolicyParams(f"{where}: at most {MAX_PLUGINS} plugins, got {len(raw)}")
    refs = []
    for i, item in enumerate(raw):
        at = f"{where}[{i}]"
        entry = plugins.parse_params(at, _RefParams, item)
        builtin = BUILTIN_PLUGINS.get(entry.plugin)
        params = dict(entry.params or {})
        if builtin is not None:
            if builtin.step != step:
                raise plugins.PolicyNotFound(f"{at}: {entry.plugin!r} is a {builtin.step}, not a {step}")
            plugins.parse_params(f"{at} ({entry.plugin})", builtin.params, params)
        else:
            _user_plugin(at, step, entry.plugin, allow)
        if entry.weight != 1.0 and step != "scorer":
            raise plugins.BadPolicyParams(f"{at}: only scorers have a weight")
        try:
            refs.append(PluginRef(entry.plugin, params, entry.weight))
        except ValueError as exc:
            raise plugins.BadPolicyParams(f"{at}: {exc}") from None
    return tuple(refs)


def chain_spec(name: str, params: Mapping[str, Any] | None = None,
               allow: plugins.PolicyAllowlist = plugins.PolicyAllowlist()) -> ChainSpec:
    """The chain a named policy with ``params`` stands for, validated.

    ``plugins.PolicyNotFound`` (unknown policy or plugin, a plugin of the wrong step, a spec ``allow``
    does not allow) or ``plugins.BadPolicyParams`` (anything wrong with the parameters), both ValueError,
    saying what is wrong and where.
    """
    preset = PRESETS.get(name) if isinstance(name, str) else None
    if preset is None:
        why = "is not allowed: a pick policy is one of the built-in chains" if plugins.is_spec(name) else "is unknown"
        raise plugins.PolicyNotFound(f"pick policy {name!r} {why}; allowed: built in {', '.join(sorted(PRESETS))} "
                                     "(add your own plugins with their 'admit', 'filters' and 'scorers' params)")
    if params is not None and not isinstance(params, Mapping):
        raise plugins.BadPolicyParams(f"pick policy {name!r}: params must be an object, got {type(params).__name__}")
    own = {k: v for k, v in (params or {}).items() if k not in EXTRA_STEPS}
    spec = preset.expand(plugins.parse_params(f"pick policy {name!r}", preset.params, own))
    extra = {step: _refs(f"pick policy {name!r}: {key}", step, (params or {}).get(key), allow)
             for key, step in EXTRA_STEPS.items()}
    return dataclasses.replace(spec, admit=spec.admit + extra["admit"], filters=spec.filters + extra["filter"],
                               scorers=spec.scorers + extra["scorer"])


def preset_defaults(name: str) -> dict[str, Any]:
    """A preset's parameters with their defaults (what ``GET /v1/policy`` shows next to the ones set)."""
    preset = PRESETS[name]
    return dataclasses.asdict(preset.params())


__all__ = ["BUILTIN_PLUGINS", "DEFAULT_PICK_POLICY", "PRESETS", "USER_STEPS", "BuiltinPlugin", "ChainSpec",
           "PluginRef", "Preset", "chain_spec", "preset_defaults"]
