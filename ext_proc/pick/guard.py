"""Containing a user plugin on the per-request path: it may fail, never the request.

The chain wraps each user plugin (built-ins are tested, and stay on the fast
path unwrapped) in a :class:`GuardedPlugin`, owned by the chain and so by the
service. Per call it:

* calls the plugin's method; if it raises or returns garbage (a filter
  returning an endpoint it was not offered, or nothing at all; a scorer
  returning other than one number in [0, 1] per candidate; an admit plugin
  returning other than a ``Reply`` or None), the step goes on **as if the
  plugin were not there** (a filter keeps all, a scorer scores 0, admit
  lets the request through): the decision is the rest of the chain's;
* measures the plugin's time; over ``PLUGIN_BUDGET_S`` the call is counted as
  slow (its answer is still used: it is valid and already paid for);
* after ``MAX_CONSECUTIVE`` failed or slow calls in a row, leaves the plugin
  out for ``COOLDOWN_S`` (Python cannot preempt a slow plugin, so this
  bounds what it costs), then tries it again.

Every failure is reported to the failure observer (``ExtProcMetrics``:
``inferlb_ext_proc_policy_failures_total{policy,reason}``, ``policy`` being
the plugin's name) and logged at most once per ``LOG_INTERVAL_S`` per reason.
Nothing raises.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from inferlb_runtime import plugins

from ..model import Candidate, EndpointView, Reply, RequestView

log = logging.getLogger("inferlb.ext_proc.policy")

PLUGIN_BUDGET_S = 0.002  # a plugin's own time per call, measured
MAX_CONSECUTIVE = 5  # failed or slow calls in a row before the plugin is left out
COOLDOWN_S = 30.0
LOG_INTERVAL_S = 60.0

REASONS = ("error", "bad_type", "unknown_endpoint", "empty", "slow")

FailureObserver = Callable[[str, str], None]  # (plugin name, reason)
_FAILED = object()


class GuardedPlugin:
    """A user plugin of one step behind the guard; has that step's method (and ``favourites`` for a scorer)."""

    def __init__(self, plugin: Any, step: str, *, budget_s: float = PLUGIN_BUDGET_S,
                 max_consecutive: int = MAX_CONSECUTIVE, cooldown_s: float = COOLDOWN_S,
                 log_interval_s: float = LOG_INTERVAL_S, observer: FailureObserver | None = None,
                 clock: Callable[[], float] = time.monotonic, timer: Callable[[], float] = time.perf_counter) -> None:
        self.inner = plugin
        self.step = step
        self.name: str = plugin.name if isinstance(getattr(plugin, "name", None), str) else type(plugin).__name__
        self.budget_s = budget_s
        self.observer = observer
        self._timer = timer
        self.streak = plugins.FailureStreak(self.name, what=step, max_consecutive=max_consecutive,
                                            cooldown_s=cooldown_s, log_interval_s=log_interval_s, clock=clock,
                                            logger=log)
        self._ids_of: Sequence[EndpointView] | None = None
        self._ids: frozenset[str] = frozenset()
        self._spent = 0.0  # the plugin's time in the current call
        # Only a scorer that has favourites offers them (the chain asks every scorer that does, per request).
        if not callable(getattr(plugin, "favourites", None)):
            self.favourites = None  # type: ignore[method-assign,assignment]

    @property
    def params(self) -> Any:
        return getattr(self.inner, "params", None)

    @property
    def suspended(self) -> bool:
        return self.streak.suspended

    @property
    def failures(self) -> dict[str, int]:
        return self.streak.failures

    # -- the steps ---------------------------------------------------------------------------------
    def admit(self, request: RequestView, candidates: Sequence[Candidate]) -> Reply | None:
        answer = self._call(self.inner.admit, request, candidates)
        if answer is _FAILED or answer is None:
            return None
        if not isinstance(answer, Reply):
            return self._failed("bad_type", f"admit() returned {type(answer).__name__}, not a Reply or None")
        return self._passed(answer)

    def filter(self, request: RequestView, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        kept = self._call(self.inner.filter, request, endpoints)
        if kept is _FAILED:
            return endpoints
        if kept is endpoints:
            return self._passed(kept)
        if isinstance(kept, (str, bytes)) or not isinstance(kept, Sequence):
            return self._failed("bad_type", f"filter() returned {type(kept).__name__}, not a list of endpoints",
                                endpoints)
        if not kept:
            return self._failed("empty", "filter() left no endpoint", endpoints)
        stranger = self._not_offered(kept, endpoints)
        if stranger is not None:
            return self._failed("unknown_endpoint", f"filter() returned {stranger}, which it was not offered",
                                endpoints)
        return self._passed(kept)

    def score(self, request: RequestView, candidates: Sequence[Candidate]) -> Sequence[float]:
        zeros = [0.0] * len(candidates)
        scores = self._call(self.inner.score, request, candidates)
        if scores is _FAILED:
            return zeros
        if isinstance(scores, (str, bytes)) or not isinstance(scores, Sequence) or len(scores) != len(candidates):
            return self._failed("bad_type", "score() must return one number per candidate, got "
                                f"{type(scores).__name__}", zeros)
        for s in scores:
            if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0.0 <= s <= 1.0:
                return self._failed("bad_type", f"score() returned {s!r}, not a number in [0, 1]", zeros)
        return self._passed(scores)

    def favourites(self, request: RequestView, endpoints: Sequence[EndpointView]) -> Iterable[EndpointView]:
        if self.suspended:
            return ()
        try:
            found = list(self.inner.favourites(request, endpoints))
        except Exception as exc:
            return self._failed("error", plugins.describe_exception(exc), ())
        stranger = self._not_offered(found, endpoints)
        if stranger is not None:  # the sample must never gain an endpoint the filters did not leave
            return self._failed("unknown_endpoint", f"favourites() returned {stranger}, which it was not offered",
                                ())
        return found

    def _not_offered(self, answer: Iterable[object], endpoints: Sequence[EndpointView]) -> str | None:
        """The first of ``answer`` that is not one of ``endpoints`` (shown), or None."""
        if endpoints is not self._ids_of:
            self._ids_of, self._ids = endpoints, frozenset(e.id for e in endpoints)
        for e in answer:
            if not isinstance(e, EndpointView) or e.id not in self._ids:
                return e.id if isinstance(e, EndpointView) else repr(e)[:80]
        return None

    # -- bookkeeping -------------------------------------------------------------------------------
    def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        if self.suspended:
            return _FAILED
        started = self._timer()
        try:
            answer = method(*args)
        except Exception as exc:
            return self._failed("error", plugins.describe_exception(exc), _FAILED)
        self._spent = self._timer() - started
        return answer

    def _passed(self, answer: Any) -> Any:
        spent = self._spent
        if spent > self.budget_s:
            self.streak.failed("slow", f"the plugin took {spent * 1000:.2f} ms, over its "
                               f"{self.budget_s * 1000:.1f} ms budget (its answer was used)", self.observer,
                               f"{self.step} plugin over its time budget")
        else:
            self.streak.succeeded()
        return answer

    def _failed(self, reason: str, detail: str, instead: Any = None) -> Any:
        self.streak.failed(reason, detail, self.observer, f"{self.step} plugin failed; the chain goes on without it")
        return instead
