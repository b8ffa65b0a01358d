"""ext_proc's domain values and the protocols of its pick chain's plugins.

A request is decided by a chain (``pick/chain.py``; its configuration is
``inferlb_runtime/pick_chain.py``)::

    filters -> sample -> cost -> budget -> admit -> scorers -> picker

The values are frozen: a plugin gets a consistent picture and cannot change
it, and a plugin can be unit-tested with no servers at all. The names match
the control plane's: an :class:`EndpointView` is one endpoint, a
``FleetView`` (``xds/client.py``) the whole fleet at one moment.
"""

from __future__ import annotations

import bisect

from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple, Protocol, Sequence, runtime_checkable

from inferlb_runtime.api_keys import ANONYMOUS_TENANT
from inferlb_runtime.model_routing import DEFAULT_POOL
from inferlb_runtime.request_class import Priority

# Request sizes (tokens) admission and the in-flight sums group requests by: a sentence, a paragraph, a batch,
# more. A worker serving the least attained service first runs a request after those no larger than it.
SIZE_BOUNDS = (64, 512, 4096)


def size_bucket(tokens: float) -> int:
    """The index of a request's size in SIZE_BOUNDS' buckets (0: a sentence ... 3: over 4,096 tokens)."""
    return bisect.bisect_left(SIZE_BOUNDS, tokens)


SLOTS_KEY = "slots"  # EDS telemetry: jobs the worker runs at once


@dataclass(frozen=True)
class EndpointView:
    """One endpoint of the ``workers`` cluster as the control plane's EDS describes it.

    ``telemetry`` holds the figures the control plane attaches as metadata
    (namespace ``inferlb``: cpu_utilization, latency_per_token_s, queue_depth,
    inflight, rps, error_rate, batch_cost_per_token_s, batch_cost_fixed_s, slots, ...).
    """

    id: str  # host:port
    address: str
    port: int
    weight: int = 100
    healthy: bool = True  # EDS health HEALTHY or UNKNOWN
    draining: bool = False
    telemetry: Mapping[str, float] = field(default_factory=dict)
    models: tuple[str, ...] = ()  # the version ids it serves (empty: a worker that does not say)
    model_aliases: tuple[str, ...] = ()  # the aliases it answers to
    pool: str = DEFAULT_POOL

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining

    @property
    def slots(self) -> float:
        """Jobs it runs at once (telemetry ``slots``: the worker's ``inferlb_worker_slots``); 1 when it does
        not say, so a worker without the gauge is costed as a single queue, as before the gauge."""
        slots = self.telemetry.get(SLOTS_KEY)
        return slots if slots is not None and slots > 1.0 else 1.0


@dataclass(frozen=True)
class RequestView:
    """What a plugin may know of a request."""

    tokens: int  # counted with the model's tokenizer, or estimated from bytes
    estimated: bool  # True when ``tokens`` is a byte-based estimate
    model: str | None
    inputs: int  # number of inputs (texts or token arrays)
    headers: Mapping[str, str] = field(default_factory=dict)
    priority: Priority = Priority.STANDARD  # its class (x-gateway-inference-objective)
    budget_s: float | None = None  # seconds left before its deadline, at the decision; None: no deadline
    tenant: str = ANONYMOUS_TENANT  # its API key's tenant (ext_proc/callers.py)
    key_id: str | None = None  # its API key's id (None: anonymous): a sticky rollout's caller
    user: str | None = None  # the body's OpenAI ``user``: the other sticky caller
    version: str | None = None  # the model version it runs on, once the model filter resolved one


class Candidate(NamedTuple):
    """An endpoint that passed the filters and the sample, with ext_proc's predictions for this request.

    A named tuple, not a frozen dataclass: immutable alike, and built several times per request
    (a frozen dataclass's ``__init__`` costs three times as much)."""

    endpoint: EndpointView
    predicted_cost_s: float  # this request's predicted service time on the endpoint
    # predicted wait there before it starts: the work already there (our in-flight + the worker's reported
    # queue), over the endpoint's slots (``costing.slot_wait_s``; all of it on a single-slot worker)
    outstanding_s: float
    outstanding_requests: int  # requests this ext_proc has in flight there
    outstanding_tokens: int  # tokens this ext_proc has in flight there

    @property
    def id(self) -> str:
        return self.endpoint.id

    @property
    def predicted_completion_s(self) -> float:
        return self.outstanding_s + self.predicted_cost_s


@dataclass(frozen=True)
class Reply:
    """An answer an admit plugin gives instead of routing: sent to the client as it is, in OpenAI's error
    shape (``{"error": {"message", "type", "param", "code"}}``)."""

    status: int  # 429 to shed, 503 when nothing can serve, ...
    code: str  # machine-readable: "overloaded", ...
    message: str  # what happened and what to do, for a person
    type: str = "server_error"
    param: str | None = None  # the request field at fault ("model"), as OpenAI names it
    retry_after_s: int | None = None  # a Retry-After header, when retrying later is the advice
    headers: tuple[tuple[str, str], ...] = ()  # more response headers (the x-ratelimit-* of a 429)


class Decision(NamedTuple):
    """A pick: ``ranked[0]`` is the primary, the rest retry fallbacks (a named tuple: one per request)."""

    ranked: tuple[str, ...]
    predicted_s: float  # this request's predicted service seconds on the primary
    policy: str
    completion_s: float = 0.0  # predicted completion on the primary: its outstanding work + predicted_s
    evaluated: int = 0  # candidates costed for this decision
    version: str | None = None  # the model version chosen for it (the worker is told in x-inferlb-model)

    @property
    def primary(self) -> str:
        return self.ranked[0]


# --- the plugins --------------------------------------------------------------------------------------
# A user plugin is a class with a ``name``, ``kind`` (for the inferlb.policies entry-point group) and the
# step's method; optionally a ``Params`` dataclass it is constructed with. Plugins are called on the event
# loop once per request: they must be fast and never block.


class Admit(Protocol):
    """Answers a request itself (shed it, serve it from a cache) or lets it through (None).

    It runs once the candidates are costed, so that it can judge by their predicted completion (shedding);
    ``candidates`` may be empty (nothing routable: a cache may still answer)."""

    name: str

    def admit(self, request: RequestView, candidates: Sequence[Candidate]) -> Reply | None: ...


class Filter(Protocol):
    """Narrows the candidates: returns some of ``endpoints`` (the same sequence object when it keeps all:
    the stages after it cache per sequence object)."""

    name: str

    def filter(self, request: RequestView, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]: ...


class Scorer(Protocol):
    """Scores each candidate in [0, 1], higher is better, in the candidates' order. The chain sums the
    scorers' scores times their weights."""

    name: str

    def score(self, request: RequestView, candidates: Sequence[Candidate]) -> Sequence[float]: ...


@runtime_checkable
class Favouring(Protocol):
    """Optional for a scorer: endpoints the sample must keep (a sticky session's own worker), so that
    sampling d random candidates cannot leave out the one it would score highest."""

    def favourites(self, request: RequestView, endpoints: Sequence[EndpointView]) -> Iterable[EndpointView]: ...


@runtime_checkable
class Resolving(Protocol):
    """Optional for a built-in filter: runs before every filter, once per request, and either rewrites the
    request (the model filter resolves the body's ``model`` to the version it runs on, which the costing and
    the worker then use) or answers it (a :class:`Reply`: an unknown model's 404)."""

    def resolve(self, request: RequestView) -> RequestView | Reply: ...


class Picker(Protocol):
    """Chooses the primary and the retry fallbacks (built in: ``max_score``, ``in_order``)."""

    name: str

    def pick(self, request: RequestView, candidates: Sequence[Candidate], scores: Sequence[float]) -> list[str]: ...
