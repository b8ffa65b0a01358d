"""User pick policies: loading them, listing them, and containing them on the per-request path.

**Loading.** ``make_pick_policy(name, params, allow)`` builds a built-in
(``policies.py``) by name, else a user policy: a name registered in the
``inferlb.policies`` entry-point group (whose object declares
``kind = "pick"``) or a ``module:attribute`` spec under a module prefix
ext_proc's own configuration allows (``allowed_policy_modules``). The control plane never
imports the policy for ext_proc: it sends ``{name, params}`` in EDS metadata
and each ext_proc builds it here. ``describe_pick_policies()`` lists what can
be chosen, with each one's parameter schema.

**Containment.** A user policy is returned wrapped in a
:class:`ContainedPickPolicy` (built-ins are not: they are tested, and the
hot path stays as it was). Per decision the wrapper:

* calls the policy's ``sample`` (if it has one) and ``rank``; if either
  raises, or returns garbage (not a list or tuple, an id that is not one of
  the candidates, endpoints that were not offered, nothing at all), the
  default policy (``least_completion_time``) makes that decision;
* measures the time the policy spent; over ``PICK_BUDGET_S`` the decision is
  counted as slow (its answer is still used: it is valid and already paid for);
* after ``MAX_CONSECUTIVE`` failed or slow decisions in a row, the default
  makes every decision for ``COOLDOWN_S`` (Python cannot preempt a slow
  policy, so this bounds what it costs), then the policy is tried again.

Every failure is reported to the failure observer (``ExtProcMetrics``
registers itself: ``inferlb_ext_proc_policy_failures_total{policy,reason}``)
and logged at most once per ``LOG_INTERVAL_S`` per reason. Nothing raises.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from inferlb_runtime import plugins

from .model import Candidate, EndpointInfo, PickPolicy, RequestView
from .policies import DEFAULT_PICK_POLICY, builtin_pick_policies

log = logging.getLogger("inferlb.ext_proc.policy")

PICK_BUDGET_S = 0.002  # the policy's own time per decision (sample + rank), measured
MAX_CONSECUTIVE = 5  # failed or slow decisions in a row before the policy is suspended
COOLDOWN_S = 30.0
LOG_INTERVAL_S = 60.0

REASONS = ("error", "bad_type", "unknown_endpoint", "empty", "slow")

FailureObserver = Callable[[str, str], None]  # (policy name, reason)


# --- loading ----------------------------------------------------------------------------------------


def make_pick_policy(name: str, params: Mapping[str, Any] | None = None,
                     allow: plugins.PolicyAllowlist = plugins.PolicyAllowlist()) -> PickPolicy:
    """Build a policy: a built-in (``policies.py``) by name, else a user policy (an ``inferlb.policies``
    entry point or a ``module:attribute`` spec under a module prefix ``allow`` names), wrapped in
    :class:`ContainedPickPolicy`.

    ValueError saying what is wrong: ``PolicyNotFound`` for a name that leads to no pick policy,
    ``BadPolicyParams`` for bad params (both from ``inferlb_runtime.plugins``).
    """
    registry = builtin_pick_policies()
    spec = registry.get(name) if isinstance(name, str) else None
    if spec is None:
        if isinstance(name, str) and name:
            return load_pick_policy(name, params, allow)
        raise plugins.PolicyNotFound(f"unknown pick policy {name!r}; built-in: {', '.join(sorted(registry))}")
    if params is not None and not isinstance(params, Mapping):
        raise plugins.BadPolicyParams(f"{name}: params must be an object, got {type(params).__name__}")
    try:
        return spec.create(params)
    except TypeError as exc:  # a params class refusing a value its validator missed
        raise plugins.BadPolicyParams(f"{name}: bad params: {exc}") from None
    except ValueError as exc:
        raise plugins.BadPolicyParams(str(exc)) from None


def load_pick_policy(name: str, params: Mapping[str, Any] | None = None,
                     allow: plugins.PolicyAllowlist = plugins.PolicyAllowlist()) -> PickPolicy:
    """A user pick policy by entry-point name or allowed ``module:attribute``, built with validated
    ``params`` and wrapped in a :class:`ContainedPickPolicy`.

    ``plugins.PolicyNotFound`` (listing what may be named) or ``plugins.BadPolicyParams`` (both ValueError).
    """
    try:
        obj, _ = plugins.resolve("pick", name, allow)
    except plugins.PolicyNotFound as exc:
        raise plugins.PolicyNotFound(
            f"{exc}; {plugins.allowed_names('pick', builtin_pick_policies(), allow)}") from None
    return ContainedPickPolicy(plugins.instantiate("pick", name, obj, params), name)


def describe_pick_policies() -> list[dict[str, Any]]:
    """Every selectable pick policy: ``{name, kind, summary, params_schema, source}``, built-ins first."""
    builtins = builtin_pick_policies()
    described = [{"name": name, "kind": "pick", "summary": spec.summary,
                  "params_schema": plugins.dataclass_schema(spec.params), "source": "builtin"}
                 for name, spec in sorted(builtins.items())]
    described += [d for d in plugins.describe_entry_points("pick") if d["name"] not in builtins]
    return described


# --- containment ------------------------------------------------------------------------------------


class ContainedPickPolicy:
    """A user pick policy behind a guard (see the module docstring); behaves as a ``PickPolicy``."""

    def __init__(
        self,
        policy: PickPolicy,
        spec: str | None = None,
        *,
        default: PickPolicy | None = None,
        budget_s: float = PICK_BUDGET_S,
        max_consecutive: int = MAX_CONSECUTIVE,
        cooldown_s: float = COOLDOWN_S,
        log_interval_s: float = LOG_INTERVAL_S,
        observer: FailureObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.inner = policy
        name = getattr(policy, "name", None)
        self.name: str = name if isinstance(name, str) else (spec or type(policy).__name__)
        self.spec = spec or self.name
        if default is None:
            default = builtin_pick_policies()[DEFAULT_PICK_POLICY].create()
        self.default = default
        self.budget_s = budget_s
        self.observer = observer
        self._timer = timer
        self.streak = plugins.FailureStreak(self.name, what="pick", max_consecutive=max_consecutive,
                                            cooldown_s=cooldown_s, log_interval_s=log_interval_s, clock=clock,
                                            logger=log)
        sample = getattr(policy, "sample", None)
        self._inner_sample = sample if callable(sample) else None
        self._default_sample = getattr(default, "sample", None)
        self._ids_of: Sequence[EndpointInfo] | None = None
        self._ids: frozenset[str] = frozenset()
        # Per decision (the picker calls sample, then rank, synchronously): the default decides this one /
        # the policy's time so far.
        self._fallback = False
        self._spent = 0.0
        self.decisions_by_default = 0

    @property
    def params(self) -> Any:
        return getattr(self.inner, "params", None)

    @property
    def suspended(self) -> bool:
        return self.streak.suspended

    @property
    def failures(self) -> dict[str, int]:
        return self.streak.failures

    # -- PickPolicy (and EndpointSampler) --------------------------------------------------------
    def sample(self, request: RequestView, endpoints: Sequence[EndpointInfo]) -> Sequence[EndpointInfo]:
        self._spent = 0.0
        self._fallback = self.suspended
        if self._fallback:
            return self._default_pool(request, endpoints)
        if self._inner_sample is None:
            return endpoints
        started = self._timer()
        try:
            pool = self._inner_sample(request, endpoints)
        except Exception as exc:
            return self._sample_failed(request, endpoints, "error", plugins.describe_exception(exc))
        self._spent = self._timer() - started
        if isinstance(pool, (str, bytes)) or not isinstance(pool, Sequence):
            return self._sample_failed(request, endpoints, "bad_type",
                                       f"sample() returned {type(pool).__name__}, not a list of endpoints")
        if endpoints is not self._ids_of:
            self._ids_of, self._ids = endpoints, frozenset(e.id for e in endpoints)
        ids = self._ids
        for e in pool:
            if not isinstance(e, EndpointInfo) or e.id not in ids:
                shown = e.id if isinstance(e, EndpointInfo) else repr(e)[:80]
                return self._sample_failed(request, endpoints, "unknown_endpoint",
                                           f"sample() returned {shown}, which it was not offered")
        if not pool:
            return self._sample_failed(request, endpoints, "empty", "sample() returned no endpoint")
        return pool

    def rank(self, request: RequestView, candidates: Sequence[Candidate]) -> Sequence[str]:
        fallback, self._fallback = self._fallback, False
        spent, self._spent = self._spent, 0.0
        if fallback or self.suspended:
            self.decisions_by_default += 1
            return self.default.rank(request, candidates)
        started = self._timer()
        try:
            ranked = self.inner.rank(request, candidates)
        except Exception as exc:
            return self._rank_failed(request, candidates, "error", plugins.describe_exception(exc))
        spent += self._timer() - started
        problem = _check_ranking(ranked, candidates)
        if problem is not None:
            return self._rank_failed(request, candidates, *problem)
        if spent > self.budget_s:
            self._failed("slow", f"the policy took {spent * 1000:.2f} ms, over its {self.budget_s * 1000:.1f} ms "
                                 "budget (its pick was used)")
        else:
            self.streak.succeeded()
        return ranked

    # -- failures ------------------------------------------------------------------------------
    def _default_pool(self, request: RequestView, endpoints: Sequence[EndpointInfo]) -> Sequence[EndpointInfo]:
        if self._default_sample is None:
            return endpoints
        return self._default_sample(request, endpoints)

    def _sample_failed(self, request: RequestView, endpoints: Sequence[EndpointInfo], reason: str,
                       detail: str) -> Sequence[EndpointInfo]:
        self._failed(reason, detail)
        self._fallback = True
        return self._default_pool(request, endpoints)

    def _rank_failed(self, request: RequestView, candidates: Sequence[Candidate], reason: str,
                     detail: str) -> Sequence[str]:
        self._failed(reason, detail)
        self.decisions_by_default += 1
        return self.default.rank(request, candidates)

    def _failed(self, reason: str, detail: str) -> None:
        message = ("pick policy over its time budget" if reason == "slow"
                   else "pick policy failed; the default policy decides")
        self.streak.failed(reason, detail, self.observer, message)


def _check_ranking(ranked: object, candidates: Sequence[Candidate]) -> tuple[str, str] | None:
    """None when ``ranked`` is usable, else ``(reason, detail)``."""
    if isinstance(ranked, (str, bytes)) or not isinstance(ranked, Sequence):
        return "bad_type", f"rank() returned {type(ranked).__name__}, not a list of endpoint ids"
    if not ranked:
        return "empty", "rank() returned no endpoint"
    ids = {c.endpoint.id for c in candidates}
    for endpoint_id in ranked:
        if not isinstance(endpoint_id, str):
            return "bad_type", f"rank() returned {endpoint_id!r}, not an endpoint id string"
        if endpoint_id not in ids:
            return "unknown_endpoint", f"rank() returned {endpoint_id!r}, which is not a candidate"
    return None


def contain_pick_policy(policy: PickPolicy, **options: Any) -> PickPolicy:
    """``policy`` behind the guard (built-ins and already wrapped policies are returned as they are)."""
    builtin = {spec.build for spec in builtin_pick_policies().values()}
    if isinstance(policy, ContainedPickPolicy) or type(policy) in builtin:
        return policy
    return ContainedPickPolicy(policy, **options)


__all__ = [
    "COOLDOWN_S",
    "LOG_INTERVAL_S",
    "MAX_CONSECUTIVE",
    "PICK_BUDGET_S",
    "REASONS",
    "ContainedPickPolicy",
    "contain_pick_policy",
    "describe_pick_policies",
    "load_pick_policy",
    "make_pick_policy",
]
