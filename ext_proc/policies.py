"""The built-in pick policies and their registry.

Each policy implements ``PickPolicy.rank`` (ext_proc/model.py). Policies that
need not look at the whole fleet also implement the optional
:class:`EndpointSampler` extension: ``sample`` chooses, before any cost is
predicted, which endpoints become candidates, so that a decision on a fleet
of 10,000 stays O(d). The picker calls it when present.

``least_completion_time`` (the default) scores a candidate by::

    score = (outstanding_s + predicted_cost_s) / weight ** weight_exponent

i.e. predicted completion time (the work already queued there plus this
request's own cost). By default (``weight_exponent: 0``) the weight is not in
the score: the cost model already learns each endpoint's speed from its own
timings, and the capacity weights grow roughly with speed squared, so
dividing by them (and sampling by them) counted speed two or three times and
starved slow workers of work they could do (simulated, 8 workers at 80%:
p99 342 -> 217 ms, goodput 151 -> 162/s). ``weight_exponent: 1`` reads an
endpoint of weight 200 as draining work twice as fast as one of weight 100,
which lets operator pins and the control plane's CPU view steer ext_proc's
picks too. The lowest score wins, exact ties at random.

Power-of-d: with more than ``d`` routable endpoints, ``d`` distinct ones are
sampled (uniformly by default; ``sample_weighted: true`` samples
proportionally to weight) and only they are scored. d defaults to 4, not 2:
the outstanding work ext_proc knows of its own requests is exact and fresh,
so more choices keep improving the pick while each costs ~2 µs; with several
ext_procs and stale reports of each other's work, random sampling still keeps
them from herding onto one endpoint that only looks idle (simulated, 1,000
workers, 10 replicas, before the picker partitioned large fleets among
replicas: d = 2 p99 761 ms, d = 3 483, d = 4 417, d = 8 353). The picker now
hands each replica only its own partition of a large fleet, so the sampled
candidates carry (nearly) no foreign work to misjudge.

User policies (an ``inferlb.policies`` entry point or a ``module:attribute``
spec) are loaded and contained by ``policy_loading.py``; ``make_pick_policy``
hands it any name that is not built in.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol, runtime_checkable


from .model import Candidate, EndpointInfo, PickPolicy, RequestView


@runtime_checkable
class EndpointSampler(Protocol):
    """Optional extension of :class:`PickPolicy`: pick which endpoints become candidates (O(d))."""

    def sample(self, request: RequestView, endpoints: Sequence[EndpointInfo]) -> Sequence[EndpointInfo]: ...


# --- parameters -----------------------------------------------------------------------------------


def _coerce(policy: str, name: str, kind: str, value: Any) -> Any:
    """One parameter from JSON-ish input (EDS Struct numbers arrive as floats: 4.0 is an int)."""
    if kind == "seed":
        if value is None:
            return None
        kind = "int"
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise ValueError(f"{policy}: param {name!r} must be an integer, got {value!r}")
        return int(value)
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{policy}: param {name!r} must be a number, got {value!r}")
        return float(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{policy}: param {name!r} must be true or false, got {value!r}")
        return value
    raise AssertionError(kind)


class _Params:
    """Mixin: build a frozen params dataclass from a mapping, rejecting unknown keys and bad types."""

    KINDS: ClassVar[Mapping[str, str]] = {}
    POLICY: ClassVar[str] = ""

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any] | None) -> Any:
        params = params or {}
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"{cls.POLICY}: unknown param(s) {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(sorted(known))}")
        values = {k: _coerce(cls.POLICY, k, cls.KINDS[k], v) for k, v in params.items()}
        return cls(**values)


def _check(policy: str, ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"{policy}: {message}")


@dataclass(frozen=True)
class LeastCompletionTimeParams(_Params):
    d: int = 4  # candidates scored per decision when the fleet is larger
    weight_exponent: float = 0.0  # 0: the cost model alone judges speed; 1: weights as relative capacity
    sample_weighted: bool = False  # sample the d candidates proportionally to weight (else uniformly)
    fallbacks: int = 2
    seed: int | None = None
    KINDS: ClassVar[Mapping[str, str]] = {"d": "int", "weight_exponent": "float", "sample_weighted": "bool",
                                          "fallbacks": "int", "seed": "seed"}
    POLICY: ClassVar[str] = "least_completion_time"

    def __post_init__(self) -> None:
        _check(self.POLICY, self.d >= 1, f"param 'd' must be >= 1, got {self.d}")
        _check(self.POLICY, 0.0 <= self.weight_exponent <= 4.0,
               f"param 'weight_exponent' must be in [0, 4], got {self.weight_exponent}")
        _check(self.POLICY, 0 <= self.fallbacks <= 2, f"param 'fallbacks' must be 0, 1 or 2, got {self.fallbacks}")


@dataclass(frozen=True)
class RoundRobinParams(_Params):
    fallbacks: int = 2
    KINDS: ClassVar[Mapping[str, str]] = {"fallbacks": "int"}
    POLICY: ClassVar[str] = "round_robin"

    def __post_init__(self) -> None:
        _check(self.POLICY, 0 <= self.fallbacks <= 2, f"param 'fallbacks' must be 0, 1 or 2, got {self.fallbacks}")


@dataclass(frozen=True)
class LeastOutstandingParams(_Params):
    d: int = 0  # 0: look at every endpoint (exact, O(n)); > 0: sample d
    fallbacks: int = 2
    seed: int | None = None
    KINDS: ClassVar[Mapping[str, str]] = {"d": "int", "fallbacks": "int", "seed": "seed"}
    POLICY: ClassVar[str] = "least_outstanding"

    def __post_init__(self) -> None:
        _check(self.POLICY, self.d >= 0, f"param 'd' must be >= 0, got {self.d}")
        _check(self.POLICY, 0 <= self.fallbacks <= 2, f"param 'fallbacks' must be 0, 1 or 2, got {self.fallbacks}")


@dataclass(frozen=True)
class P2CTokensParams(_Params):
    sample_weighted: bool = True
    seed: int | None = None
    KINDS: ClassVar[Mapping[str, str]] = {"sample_weighted": "bool", "seed": "seed"}
    POLICY: ClassVar[str] = "p2c_tokens"


# --- sampling -------------------------------------------------------------------------------------


class _Sampler:
    """d distinct endpoints, uniformly or proportionally to weight, in O(d log n).

    The cumulative weights are rebuilt only when a different sequence object
    comes in (the picker passes the same tuple until EDS changes).
    """

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._seq: Sequence[EndpointInfo] | None = None
        self._cum: list[float] = []
        self._total = 0.0

    def sample(self, endpoints: Sequence[EndpointInfo], d: int, weighted: bool) -> Sequence[EndpointInfo]:
        n = len(endpoints)
        if n <= d:
            return endpoints
        if weighted and endpoints is not self._seq:
            self._seq = endpoints
            acc = 0.0
            cum = []
            for e in endpoints:
                acc += e.weight if e.weight > 0 else 0.0
                cum.append(acc)
            self._cum, self._total = cum, acc
        rng = self._rng
        use_weights = weighted and self._total > 0.0
        chosen: list[int] = []
        for _ in range(8 * d):  # collisions are rare; the cap bounds pathological weight skews
            if use_weights:
                i = bisect.bisect_right(self._cum, rng.random() * self._total)
                if i >= n:
                    i = n - 1
            else:
                i = rng.randrange(n)
            if i not in chosen:
                chosen.append(i)
                if len(chosen) == d:
                    break
        return [endpoints[i] for i in chosen]


# --- policies -------------------------------------------------------------------------------------


class LeastCompletionTime:
    """Least predicted completion time: (outstanding + this request's cost) / weight^exponent."""

    name = "least_completion_time"

    def __init__(self, params: LeastCompletionTimeParams | None = None) -> None:
        self.params = params or LeastCompletionTimeParams()
        self._rng = random.Random(self.params.seed)
        self._sampler = _Sampler(self._rng)

    def sample(self, request: RequestView, endpoints: Sequence[EndpointInfo]) -> Sequence[EndpointInfo]:
        return self._sampler.sample(endpoints, self.params.d, self.params.sample_weighted)

    def rank(self, request: RequestView, candidates: Sequence[Candidate]) -> Sequence[str]:
        exponent = self.params.weight_exponent
        rnd = self._rng.random
        scored = []
        for c in candidates:
            completion = c.outstanding_s + c.predicted_cost_s
            w = c.endpoint.weight
            if exponent:
                score = completion / (w**exponent) if w > 0 else math.inf
            else:
                score = completion
            scored.append((score, rnd(), c.endpoint.id))
        scored.sort()
        return [s[2] for s in scored[: 1 + self.params.fallbacks]]


class RoundRobin:
    """Each routable endpoint in turn (in EDS order); fallbacks are the next ones."""

    name = "round_robin"

    def __init__(self, params: RoundRobinParams | None = None) -> None:
        self.params = params or RoundRobinParams()
        self._cursor = 0
        self._window: tuple[str, ...] = ()

    def sample(self, request: RequestView, endpoints: Sequence[EndpointInfo]) -> Sequence[EndpointInfo]:
        n = len(endpoints)
        if not n:
            return endpoints
        start = self._cursor % n
        self._cursor = start + 1
        window = [endpoints[(start + i) % n] for i in range(min(n, 1 + self.params.fallbacks))]
        self._window = tuple(e.id for e in window)
        return window

    def rank(self, request: RequestView, candidates: Sequence[Candidate]) -> Sequence[str]:
        ids = tuple(c.endpoint.id for c in candidates)
        if ids == self._window:  # the picker already rotated in sample()
            self._window = ()
            return ids
        n = len(ids)
        if not n:
            return ()
        start = self._cursor % n
        self._cursor = start + 1
        return [ids[(start + i) % n] for i in range(min(n, 1 + self.params.fallbacks))]


class LeastOutstanding:
    """Fewest requests this ext_proc has in flight there; ties at random."""

    name = "least_outstanding"

    def __init__(self, params: LeastOutstandingParams | None = None) -> None:
        self.params = params or LeastOutstandingParams()
        self._rng = random.Random(self.params.seed)
        self._sampler = _Sampler(self._rng)

    def sample(self, request: RequestView, endpoints: Sequence[EndpointInfo]) -> Sequence[EndpointInfo]:
        if self.params.d <= 0:
            return endpoints
        return self._sampler.sample(endpoints, self.params.d, weighted=False)

    def rank(self, request: RequestView, candidates: Sequence[Candidate]) -> Sequence[str]:
        rnd = self._rng.random
        scored = sorted((c.outstanding_requests, rnd(), c.endpoint.id) for c in candidates)
        return [s[2] for s in scored[: 1 + self.params.fallbacks]]


class P2CTokens:
    """Power of two choices on the tokens this ext_proc has in flight; the loser is the fallback."""

    name = "p2c_tokens"

    def __init__(self, params: P2CTokensParams | None = None) -> None:
        self.params = params or P2CTokensParams()
        self._rng = random.Random(self.params.seed)
        self._sampler = _Sampler(self._rng)

    def sample(self, request: RequestView, endpoints: Sequence[EndpointInfo]) -> Sequence[EndpointInfo]:
        return self._sampler.sample(endpoints, 2, self.params.sample_weighted)

    def rank(self, request: RequestView, candidates: Sequence[Candidate]) -> Sequence[str]:
        pool = candidates if len(candidates) <= 2 else self._rng.sample(list(candidates), 2)
        rnd = self._rng.random
        scored = sorted((c.outstanding_tokens, rnd(), c.endpoint.id) for c in pool)
        return [s[2] for s in scored]


# --- registry -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicySpec:
    """A built-in policy: its params class (defaults, validation) and how to build it."""

    name: str
    params: type[_Params]
    build: Callable[[Any], PickPolicy]
    summary: str

    def create(self, params: Mapping[str, Any] | None = None) -> PickPolicy:
        return self.build(self.params.from_mapping(params))


def builtin_pick_policies() -> Mapping[str, PolicySpec]:
    """Every built-in policy by name (a fresh mapping: callers may not mutate shared state)."""
    specs = (
        PolicySpec("least_completion_time", LeastCompletionTimeParams, LeastCompletionTime,
                   "least predicted completion time (outstanding work + this request's cost), power-of-d"),
        PolicySpec("round_robin", RoundRobinParams, RoundRobin, "each routable endpoint in turn"),
        PolicySpec("least_outstanding", LeastOutstandingParams, LeastOutstanding,
                   "fewest requests in flight from this ext_proc"),
        PolicySpec("p2c_tokens", P2CTokensParams, P2CTokens, "power of two choices on outstanding tokens"),
    )
    return {s.name: s for s in specs}


DEFAULT_PICK_POLICY = "least_completion_time"
