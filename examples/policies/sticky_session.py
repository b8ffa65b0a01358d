"""Sticky sessions with bounded load, as a **scorer** added to the default chain: requests with the same
``x-session-id`` go to the same worker, unless that worker is overloaded.

**When to use it.** Only when a worker keeps something per session that is
worth reusing: a cache of a conversation's prefix or embeddings, a per-user
adapter, warm per-tenant data. A stateless embedding model does not need it,
and the default ``least_completion_time`` balances better without it.

**How.** Rendezvous (highest-random-weight) hashing over the candidates the
filters leave: each (session, endpoint) pair gets a stable pseudo-random
score and the highest wins. A worker joining or leaving moves only the
sessions that hash to it (about 1/n of them), and every ext_proc replica
agrees, because the hash is a stable one (blake2b), not Python's per-process
``hash()``. The scorer names that worker as its favourite, so the chain's
power-of-d sample always keeps it, and scores it 1 (every other candidate
0) while its predicted completion time for this request (the work already
there plus this request's cost) is at most ``load_factor`` x the mean over
the candidates: bounded load ("consistent hashing with bounded loads",
Mirrokni, Thorup and Zadimoghaddam, 2018). Over that it scores 0 and the
default scorer (least predicted completion time) alone decides; the session
comes back once its worker catches up. With weight 1 next to the default
scorer's 1, a sticky worker within the bound always wins (its total is over
1, nobody else's is). Requests without the header are left to the default.

**Cost.** Hashing every candidate for a session is O(n) (about a microsecond
per endpoint): fine for tens or hundreds of workers.

**Use it.** Allow its module where it runs (``--allow-policy-module
examples.policies`` for ext_proc and for the control plane, which checks the
name: nothing is allowed by default), then add it to the default chain::

    curl -X PUT -H "Authorization: Bearer $TOKEN" localhost:8080/v1/policy \\
      -d '{"pick": {"name": "least_completion_time", "params": {"scorers": [
            {"plugin": "examples.policies.sticky_session:SessionAffinity", "weight": 1,
             "params": {"load_factor": 1.5}}]}}}'
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # types only: the control plane may import this module to describe it, never ext_proc
    from ext_proc.model import Candidate, EndpointView, RequestView

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
class SessionAffinityParams:
    header: str = "x-session-id"  # the request header naming the session (lower case)
    load_factor: float = 1.25  # sticky while its predicted completion <= load_factor x the candidates' mean

    def __post_init__(self) -> None:
        if not self.header or self.header != self.header.lower():
            raise ValueError(f"header must be a non-empty lower-case header name, got {self.header!r}")
        if not 1.0 <= self.load_factor <= 100.0:
            raise ValueError(f"load_factor must be in [1, 100], got {self.load_factor}")


class SessionAffinity:
    """Scorer: 1 for the session's own worker (rendezvous hashing) while it is not overloaded, else 0."""

    name: ClassVar[str] = "session_affinity"
    kind: ClassVar[str] = "scorer"  # for the inferlb.policies entry-point group
    Params: ClassVar[type] = SessionAffinityParams

    def __init__(self, params: SessionAffinityParams | None = None) -> None:
        self.params = params or SessionAffinityParams()
        self._endpoint_hashes: dict[str, int] = {}

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

    def _home(self, session: str, endpoint_ids: Sequence[str]) -> str:
        s = stable_hash(session)
        return max(endpoint_ids, key=lambda e: _mix(s ^ self._endpoint_hash(e)))

    def favourites(self, request: RequestView, endpoints: Sequence[EndpointView]) -> list[EndpointView]:
        """The session's worker among ``endpoints``, which the chain's sample must keep."""
        session = request.headers.get(self.params.header)
        if not session or not endpoints:
            return []
        home = self._home(session, [e.id for e in endpoints])
        return [e for e in endpoints if e.id == home]

    def score(self, request: RequestView, candidates: Sequence[Candidate]) -> list[float]:
        scores = [0.0] * len(candidates)
        session = request.headers.get(self.params.header)
        if not session or not candidates:
            return scores
        home = self._home(session, [c.endpoint.id for c in candidates])
        mean = sum(c.predicted_completion_s for c in candidates) / len(candidates)
        for i, c in enumerate(candidates):
            if c.endpoint.id == home and c.predicted_completion_s <= self.params.load_factor * mean:
                scores[i] = 1.0
        return scores
