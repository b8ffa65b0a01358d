"""Containing a weight policy: whatever it does, every round gets valid weights and nothing propagates.

The ``Controller`` owns one ``WeightPolicyGuard``, made when the policy is set
and replaced when it changes (a switched-to policy starts with a clean
record), and computes each scrape round's weights through it. If the policy
raises, returns garbage (not a mapping, unknown or missing endpoints, weights
that are not integers in 1..1000: negative, NaN, inf, floats) or takes longer
than ``WEIGHT_BUDGET_S`` (user policies only; Python cannot be preempted, so
the round is measured and its result discarded), the default ``capacity``
policy computes that round's weights instead (and if the default fails too,
or *is* the failing policy, every endpoint keeps its current weight). Each
failure is counted with the observer's ``policy_failure(policy, reason)``
(``inferlb_cp_policy_failures_total``) and logged at most once per
``LOG_INTERVAL_S`` per reason. After ``MAX_CONSECUTIVE`` failing rounds in a
row the policy is not called at all for ``COOLDOWN_S`` (a policy that blocks
the loop for a second each round would otherwise keep doing it), then tried
again. The failure record is ``inferlb_runtime.plugins.FailureStreak``,
shared with ext_proc's guard.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from inferlb_runtime import plugins

from ..model import MAX_WEIGHT, MIN_WEIGHT
from .builtins import CapacityWeightPolicy, builtin_weight_policies, clamp_weight
from .contract import FleetView, WeightPolicy

log = logging.getLogger("inferlb.control_plane.policy")

WEIGHT_BUDGET_S = 0.05  # one round of a user policy, measured
MAX_CONSECUTIVE = 3  # failing rounds in a row before the policy is suspended
COOLDOWN_S = 30.0  # how long a suspended policy is not called
LOG_INTERVAL_S = 60.0  # at most one log line per policy and reason per interval

REASONS = ("error", "bad_type", "unknown_endpoint", "missing_endpoint", "bad_weight", "slow")


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
    """Runs one weight policy with containment (see the module docstring): one per policy instance, owned by
    whoever computes weights with it (the ``Controller``), so its failure record lives and dies with the
    policy."""

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

    def compute(self, view: FleetView, observer: FailureObserver | None = None) -> dict[str, int]:
        """The round's weights: the policy's, or the fallback's when it fails (never raises); each failure is
        reported to ``observer`` (the control plane's metrics) when given."""
        if self.suspended:
            return self._fallback(view)
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

    def _failed(self, view: FleetView, observer: FailureObserver | None, reason: str, detail: str) -> dict[str, int]:
        self.streak.failed(reason, detail, observer.policy_failure if observer is not None else None,
                           "weight policy failed; the default policy computes this round's weights")
        return self._fallback(view)

    def _fallback(self, view: FleetView) -> dict[str, int]:
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


__all__ = ["COOLDOWN_S", "LOG_INTERVAL_S", "MAX_CONSECUTIVE", "REASONS", "WEIGHT_BUDGET_S", "FailureObserver",
           "WeightPolicyGuard", "check_weights", "policy_name"]
