"""Sticky sessions with bounded load: requests with the same ``x-session-id`` go to the same worker,
unless that worker is overloaded.

**When to use it.** Only when a worker keeps something per session that is
worth reusing: a cache of a conversation's prefix or embeddings, a per-user
adapter, warm per-tenant data. A stateless embedding model does not need it,
and the default ``least_completion_time`` balances better without it.
Requests without the header are ranked by the default rule.

**How.** Rendezvous (highest-random-weight) hashing over the routable
endpoints: each (session, endpoint) pair gets a stable pseudo-random score
and the highest wins. A worker joining or leaving moves only the sessions
that hash to it (about 1/n of them), and every ext_proc replica agrees,
because the hash is a stable one (blake2b), not Python's per-process
``hash()``. Bounded load ("consistent hashing with bounded loads", Mirrokni,
Thorup and Zadimoghaddam, 2018): when the sticky worker's predicted
completion time for this request (the work already there plus this
request's cost) exceeds ``load_factor`` x the mean over the candidates, the
request is ranked by the default rule instead (least predicted completion
time per unit of weight); the session comes back once the worker catches up.
``load_factor`` 1.25 keeps sessions sticky until their worker runs 25%
behind the others; larger values are stickier, 1.0 is barely sticky.

**Cost.** Hashing every routable endpoint for a session is O(n) (about a
microsecond per endpoint): fine for tens or hundreds of workers. Only the
session's top choices and ``sample`` random others are costed and ranked.

**Use it.** Allow its module where it runs (``--allow-policy-module
examples.policies`` for ext_proc, and for the control plane if it is chosen
through the admin API: nothing is allowed by default), then ``python -m
ext_proc --pick-policy examples.policies.sticky_session:StickySessionPolicy``,
or through the control plane::

    curl -X PUT -H "Authorization: Bearer $TOKEN" localhost:8080/v1/policy \\
      -d '{"pick": {"name": "examples.policies.sticky_session:StickySessionPolicy",
                    "params": {"load_factor": 1.5}}}'
"""

from __future__ import annotations

import hashlib
import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # types only: the control plane may import this module to describe it, never ext_proc
    from ext_proc.model import Candidate, EndpointInfo, RequestView

_MASK = (1 << 64) - 1


def stable_hash(text: str) -> int:
    """64 bits of blake2b: the same in every process (unlike ``hash()``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _mix(x: int) -> int:
    """splitmix64's finaliser: a bijection that scatters the bits of ``x``."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


@dataclass(frozen=True)
class StickySessionParams:
    header: str = "x-session-id"  # the request header naming the session (lower case)
    load_factor: float = 1.25  # sticky while its predicted completion <= load_factor x the candidates' mean
    fallbacks: int = 2  # retry fallbacks after the primary pick
    sample: int = 4  # random endpoints costed besides the session's top choices (0: every endpoint)
    seed: int | None = None  # random seed (tests); None: random

    def __post_init__(self) -> None:
        if not self.header or self.header != self.header.lower():
            raise ValueError(f"header must be a non-empty lower-case header name, got {self.header!r}")
        if not 1.0 <= self.load_factor <= 100.0:
            raise ValueError(f"load_factor must be in [1, 100], got {self.load_factor}")
        if not 0 <= self.fallbacks <= 2:
            raise ValueError(f"fallbacks must be 0, 1 or 2, got {self.fallbacks}")
        if self.sample < 0:
            raise ValueError(f"sample must be >= 0, got {self.sample}")


class StickySessionPolicy:
    """The same x-session-id to the same worker (rendezvous hashing), unless it is overloaded (bounded load)."""

    name: ClassVar[str] = "sticky_session"
    kind: ClassVar[str] = "pick"  # for the inferlb.policies entry-point group
    Params: ClassVar[type] = StickySessionParams

    def __init__(self, params: StickySessionParams | None = None) -> None:
        self.params = params or StickySessionParams()
        self._rng = random.Random(self.params.seed)
        self._endpoint_hashes: dict[str, int] = {}

    # -- hashing ---------------------------------------------------------------------------------
    def _endpoint_hash(self, endpoint_id: str) -> int:
        h = self._endpoint_hashes.get(endpoint_id)
        if h is None:
            if len(self._endpoint_hashes) > 65536:  # endpoints come and go: do not grow forever
                self._endpoint_hashes.clear()
            h = self._endpoint_hashes[endpoint_id] = stable_hash(endpoint_id)
        return h

    def preference(self, session: str, endpoint_ids: Sequence[str]) -> list[str]:
        """``endpoint_ids`` in the session's order of preference (rendezvous hashing)."""
        s = stable_hash(session)
        return sorted(endpoint_ids, key=lambda e: _mix(s ^ self._endpoint_hash(e)), reverse=True)

    def _session(self, request: RequestView) -> str | None:
        return request.headers.get(self.params.header) or None

    # -- PickPolicy ----------------------------------------------------------------------------
    def sample(self, request: RequestView, endpoints: Sequence[EndpointInfo]) -> Sequence[EndpointInfo]:
        """The session's top choices plus ``sample`` random others (the others give the mean load and the
        fallback ranking); everything when the fleet is that small."""
        p = self.params
        top = 1 + p.fallbacks
        n = len(endpoints)
        if p.sample == 0 or n <= top + p.sample:
            return endpoints
        session = self._session(request)
        if session is None:
            return [endpoints[i] for i in self._rng.sample(range(n), top + p.sample)]
        s = stable_hash(session)
        ranked = heapq.nlargest(top, range(n), key=lambda i: _mix(s ^ self._endpoint_hash(endpoints[i].id)))
        chosen = set(ranked)
        while len(chosen) < top + p.sample:
            chosen.add(self._rng.randrange(n))
        return [endpoints[i] for i in chosen]

    def rank(self, request: RequestView, candidates: Sequence[Candidate]) -> Sequence[str]:
        keep = 1 + self.params.fallbacks
        session = self._session(request)
        if session is None or not candidates:
            return self.default_rank(candidates)[:keep]
        by_id = {c.endpoint.id: c for c in candidates}
        sticky = by_id[self.preference(session, list(by_id))[0]]
        mean = sum(c.predicted_completion_s for c in candidates) / len(candidates)
        if sticky.predicted_completion_s > self.params.load_factor * mean:
            return self.default_rank(candidates)[:keep]  # overloaded: balance this one
        rest = self.default_rank([c for c in candidates if c is not sticky])
        return [sticky.endpoint.id, *rest[: keep - 1]]

    def default_rank(self, candidates: Sequence[Candidate]) -> list[str]:
        """Least predicted completion time per unit of weight (the built-in default's rule), ties at random."""
        rnd = self._rng.random
        scored = sorted(
            (c.predicted_completion_s / c.endpoint.weight if c.endpoint.weight > 0 else float("inf"), rnd(),
             c.endpoint.id)
            for c in candidates
        )
        return [s[2] for s in scored]
