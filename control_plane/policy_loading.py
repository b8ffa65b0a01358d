"""User weight policies: loading them, listing them, and containing them.

**Loading.** ``make_weight_policy(name, params, allow)`` builds a built-in
(``policy.py``) by name, else a user policy: a name registered in the
``inferlb.policies`` entry-point group (whose object declares
``kind = "weight"``) or a ``module:attribute`` spec under a module prefix the
operator allows (a class; see ``inferlb_runtime.plugins`` for the checks and
how parameters are validated).
``describe_weight_policies()`` lists what can be chosen, with each one's
parameter schema, for ``GET /v1/policy``.

**Containment.** The controller runs the active policy through
``contained_compute(policy, view, observer)`` each scrape round. If the
policy raises, returns garbage (not a mapping, unknown or missing endpoints,
weights that are not integers in 1..1000: negative, NaN, inf, floats) or
takes longer than ``WEIGHT_BUDGET_S`` (user policies only; Python cannot be
preempted, so the round is measured and its result discarded), the default
``capacity`` policy computes that round's weights instead (and if the
default fails too, or *is* the failing policy, every endpoint keeps its
current weight). Each failure is counted with the observer's
``policy_failure(policy, reason)`` (``inferlb_cp_policy_failures_total``)
and logged at most once per ``LOG_INTERVAL_S`` per reason. After
``MAX_CONSECUTIVE`` failing rounds in a row the policy is not called at all
for ``COOLDOWN_S`` (a policy that blocks the loop for a second each round
would otherwise keep doing it), then tried again. Nothing propagates.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from inferlb_runtime import plugins

from .model import MAX_WEIGHT, MIN_WEIGHT
from .policy import CapacityWeightPolicy, FleetView, WeightPolicy, builtin_weight_policies, clamp_weight

log = logging.getLogger("inferlb.control_plane.policy")

DEFAULT_WEIGHT_POLICY = "capacity"
WEIGHT_BUDGET_S = 0.05  # one round of a user policy, measured
MAX_CONSECUTIVE = 3  # failing rounds in a row before the policy is suspended
COOLDOWN_S = 30.0  # how long a suspended policy is not called
LOG_INTERVAL_S = 60.0  # at most one log line per policy and reason per interval

REASONS = ("error", "bad_type", "unknown_endpoint", "missing_endpoint", "bad_weight", "slow")


# --- loading ----------------------------------------------------------------------------------------


def make_weight_policy(name: str, params: Mapping[str, object] | None = None,
                       allow: plugins.PolicyAllowlist = plugins.PolicyAllowlist()) -> WeightPolicy:
    """Build a policy: a built-in by name, else a user policy (an ``inferlb.policies`` entry point or a
    ``module:attribute`` spec under a module prefix ``allow`` names: :func:`load_weight_policy`).

    ``ValueError`` with a clear message on any bad input: ``PolicyNotFound`` for a name that leads to no
    weight policy, ``BadPolicyParams`` for bad parameters (both from ``inferlb_runtime.plugins``).
    """
    cls = builtin_weight_policies().get(name)
    if cls is None:
        return load_weight_policy(name, params, allow)
    try:
        return cls(plugins.parse_params(f"weight policy {name!r}", cls.Params, params or {}))
    except ValueError as exc:
        raise plugins.BadPolicyParams(str(exc)) from None


def load_weight_policy(name: str, params: Mapping[str, Any] | None = None,
                       allow: plugins.PolicyAllowlist = plugins.PolicyAllowlist()) -> WeightPolicy:
    """A user weight policy by entry-point name or allowed ``module:attribute``, built with validated ``params``.

    ``plugins.PolicyNotFound`` (a ValueError: answer 400, listing what may be named) when the name leads
    to no weight policy or is not allowed, ``plugins.BadPolicyParams`` (a ValueError: answer 422) when its
    parameters are wrong.
    """
    try:
        obj, _ = plugins.resolve("weight", name, allow)
    except plugins.PolicyNotFound as exc:
        raise plugins.PolicyNotFound(
            f"{exc}; {plugins.allowed_names('weight', builtin_weight_policies(), allow)}") from None
    return plugins.instantiate("weight", name, obj, params)


def describe_weight_policies() -> list[dict[str, Any]]:
    """Every selectable weight policy: ``{name, kind, summary, params_schema, source}``, built-ins first.

    Entry points are imported to describe them (a broken one is logged and left out); ``module:attribute``
    policies cannot be listed, only named.
    """
    builtins = builtin_weight_policies()
    described = [plugins.describe("weight", name, cls, "builtin") for name, cls in sorted(builtins.items())]
    described += [d for d in plugins.describe_entry_points("weight") if d["name"] not in builtins]
    return described


# --- containment ------------------------------------------------------------------------------------


class FailureObserver(Protocol):
    """What the guard reports to (``ControlPlaneMetrics`` implements it)."""

    def policy_failure(self, policy: str, reason: str) -> None: ...


def policy_name(policy: object) -> str:
    name = getattr(policy, "name", None)
    return name if isinstance(name, str) else type(policy).__name__


def check_weights(view: FleetView, result: object) -> tuple[dict[str, int] | None, str, str]:
    """``(weights, "", "")`` when ``result`` is a valid answer for ``view``, else ``(None, reason, detail)``."""
    if not isinstance(result, Mapping):
        return None, "bad_type", f"compute() returned {type(result).__name__}, not a mapping of endpoint id -> weight"
    ids = {e.id for e in view.endpoints}
    weights: dict[str, int] = {}
    try:
        for key, value in result.items():
            if key not in ids:
                return None, "unknown_endpoint", f"a weight for {key!r}, which is not in the view"
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                shown = value if not isinstance(value, float) or math.isfinite(value) else str(value)
                return None, "bad_weight", f"{key}: weight {shown!r} is not an integer"
            if not MIN_WEIGHT <= value <= MAX_WEIGHT:
                return None, "bad_weight", f"{key}: weight {value} is outside {MIN_WEIGHT}..{MAX_WEIGHT}"
            weights[key] = int(value)
    except Exception as exc:  # a Mapping whose iteration fails
        return None, "bad_type", f"reading the result failed: {plugins.describe_exception(exc)}"
    if len(weights) != len(ids):
        missing = sorted(ids - weights.keys())
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        return None, "missing_endpoint", f"no weight for {', '.join(missing[:3])}{more}"
    return weights, "", ""


class WeightPolicyGuard:
    """Runs one weight policy with containment (see the module docstring); one per policy instance."""

    def __init__(
        self,
        policy: WeightPolicy,
        *,
        default: WeightPolicy | None = None,
        budget_s: float | None = None,
        max_consecutive: int | None = None,
        cooldown_s: float | None = None,
        log_interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.policy = policy
        self.default: WeightPolicy = default if default is not None else CapacityWeightPolicy()
        self.name = policy_name(policy)
        builtin = type(policy) in set(builtin_weight_policies().values())
        # A built-in is not timed: it is tested, and the fallback would be the same work again.
        self.budget_s = math.inf if builtin else (WEIGHT_BUDGET_S if budget_s is None else budget_s)
        self.falls_back_to_itself = type(policy) is type(self.default)
        self._timer = timer
        self.streak = plugins.FailureStreak(
            self.name, what="weight",
            max_consecutive=MAX_CONSECUTIVE if max_consecutive is None else max_consecutive,
            cooldown_s=COOLDOWN_S if cooldown_s is None else cooldown_s,
            log_interval_s=LOG_INTERVAL_S if log_interval_s is None else log_interval_s,
            clock=clock, logger=log,
        )
        self._log = plugins.LogLimiter(LOG_INTERVAL_S if log_interval_s is None else log_interval_s, clock)
        self.last_used = self.name  # which policy produced the latest weights (its name, or the default's)

    @property
    def suspended(self) -> bool:
        return self.streak.suspended

    @property
    def failures(self) -> dict[str, int]:
        return self.streak.failures

    def compute(self, view: FleetView, observer: object = None) -> dict[str, int]:
        """The round's weights: the policy's, or the fallback's when it fails (never raises)."""
        if self.suspended:
            return self._fallback(view, observer)
        started = self._timer()
        try:
            result = self.policy.compute(view)
        except Exception as exc:
            return self._failed(view, observer, "error", plugins.describe_exception(exc))
        spent = self._timer() - started
        weights, reason, detail = check_weights(view, result)
        if weights is None:
            return self._failed(view, observer, reason, detail)
        if spent > self.budget_s:
            return self._failed(view, observer, "slow",
                                f"compute() took {spent * 1000:.1f} ms, over its {self.budget_s * 1000:.0f} ms budget")
        self.streak.succeeded()
        self.last_used = self.name
        return weights

    def _failed(self, view: FleetView, observer: object, reason: str, detail: str) -> dict[str, int]:
        report = getattr(observer, "policy_failure", None)
        self.streak.failed(reason, detail, report if callable(report) else None,
                           "weight policy failed; the default policy computes this round's weights")
        return self._fallback(view, observer)

    def _fallback(self, view: FleetView, observer: object) -> dict[str, int]:
        keep = {e.id: clamp_weight(e.weight) for e in view.endpoints}
        if self.falls_back_to_itself:
            self.last_used = "keep"
            return keep
        try:
            weights, reason, detail = check_weights(view, self.default.compute(view))
        except Exception as exc:
            weights, reason, detail = None, "error", plugins.describe_exception(exc)
        if weights is None:
            if self._log.allow(("default", reason)) is not None:
                log.error("the default weight policy failed too; weights kept",
                          extra={"policy": policy_name(self.default), "reason": reason, "detail": detail})
            self.last_used = "keep"
            return keep
        self.last_used = policy_name(self.default)
        return weights


_GUARDS: dict[int, tuple[object, WeightPolicyGuard]] = {}  # id(policy) -> (policy, its guard); holds the policy
_MAX_GUARDS = 8


def guard_for(policy: WeightPolicy) -> WeightPolicyGuard:
    """The guard of ``policy`` (created on first use; a switched-to policy starts with a clean record)."""
    entry = _GUARDS.get(id(policy))
    if entry is not None and entry[0] is policy:
        return entry[1]
    guard = WeightPolicyGuard(policy)
    _GUARDS[id(policy)] = (policy, guard)
    while len(_GUARDS) > _MAX_GUARDS:
        del _GUARDS[next(iter(_GUARDS))]
    return guard


def contained_compute(policy: WeightPolicy, view: FleetView, observer: object = None) -> dict[str, int]:
    """``policy.compute(view)`` with containment: always a valid weight for every endpoint of ``view``.

    ``observer``: anything with ``policy_failure(policy, reason)`` (the control plane's metrics), or None.
    """
    return guard_for(policy).compute(view, observer)


__all__ = ["COOLDOWN_S", "DEFAULT_WEIGHT_POLICY", "LOG_INTERVAL_S", "MAX_CONSECUTIVE", "REASONS", "WEIGHT_BUDGET_S",
           "WeightPolicyGuard", "check_weights", "contained_compute", "describe_weight_policies", "guard_for",
           "load_weight_policy", "make_weight_policy"]
