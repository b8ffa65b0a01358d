"""The quota algorithm, as pure functions of a tenant's state and an injected clock (milliseconds).

Per minute limits (tokens, requests): a sliding-window counter. Time is cut
into fixed 60 s windows; a tenant keeps the counts of the current and the
previous one, and estimates the last 60 s as the previous count weighted by
how much of it still overlaps plus the current count. A request of cost
``c`` passes iff ``estimate + c <= limit``. The current count alone is at most
the estimate, so every fixed minute stays within the quota, and the weighted
previous window smooths the boundary (no double burst across it, as a fixed
window allows). All arithmetic is on integers scaled by the window length,
with the same divisions as the Redis script (``quota_redis.ACQUIRE_LUA``), so
both give the same decisions (``tests/test_quota_equivalence.py``).

Tokens in flight: a per-tenant sum of leases, each with an expiry (a replica
that crashes without releasing must not hold its tenant's in-flight quota for
ever); expired leases are dropped at the next check.

A request is checked against every limit first and counted against all of
them only if all pass. Refused, it is told the limit to wait longest for and
how long (if nothing else is admitted meanwhile); a request that alone is
over a limit is ``too_large``: no wait helps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping

from inferlb_runtime.api_keys import Quota

from . import (
    MAX_TOKENS_IN_FLIGHT,
    REQUESTS_PER_MINUTE,
    TOKENS_PER_MINUTE,
    Lease,
    Limit,
    QuotaOutcome,
    Window,
)

WINDOW_MS = 60_000
# Tokens in flight free up as requests finish, which the store cannot foresee: a short hint.
IN_FLIGHT_RETRY_MS = 1_000
# The codes of the limits, shared with the Lua script (0: none).
LIMIT_CODES: dict[int, Limit] = {1: TOKENS_PER_MINUTE, 2: REQUESTS_PER_MINUTE, 3: MAX_TOKENS_IN_FLIGHT}
_TPM, _RPM, _IN_FLIGHT = 1, 2, 3


@dataclass(frozen=True, slots=True)
class Minute:
    """A sliding-window counter: the counts of fixed window ``window`` and of the one before."""

    window: int
    current: int = 0
    previous: int = 0


@dataclass(frozen=True, slots=True)
class TenantState:
    """One tenant's counters. Never mutated: every function returns a new one."""

    tokens: Minute | None = None
    requests: Minute | None = None
    in_flight: int = 0
    leases: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # id -> (tokens, expires_ms)
    next_expiry_ms: int = 0  # no lease expires before this (0: no leases)


@dataclass(frozen=True, slots=True)
class Decision:
    """A check's result as integers, the shape the Lua script returns (one field per element, in order)."""

    admitted: bool
    exceeded: int  # a LIMIT_CODES key, 0: none
    too_large: bool
    retry_ms: int  # -1: none
    window: int
    tokens_remaining: int = 0
    tokens_reset_ms: int = 0
    requests_remaining: int = 0
    requests_reset_ms: int = 0

    @classmethod
    def of_reply(cls, reply: list[int]) -> Decision:
        """From the Lua script's array reply."""
        a, e, t, r, w, tr, trs, rr, rrs = (int(x) for x in reply)
        return cls(bool(a), e, bool(t), r, w, tr, trs, rr, rrs)


def roll(minute: Minute | None, window: int) -> Minute:
    """``minute`` as seen from ``window``: one window on, the current count becomes the previous."""
    if minute is None or minute.window < window - 1:
        return Minute(window)
    if minute.window == window - 1:
        return Minute(window, 0, minute.current)
    return minute


def _retry_ms(minute: Minute, limit: int, cost: int, elapsed: int) -> int:
    """-1 if ``cost`` passes now; else the milliseconds until it would (nothing else admitted meanwhile)."""
    load = minute.previous * (WINDOW_MS - elapsed) + minute.current * WINDOW_MS  # the estimate x WINDOW_MS
    if load + cost * WINDOW_MS <= limit * WINDOW_MS:
        return -1
    if minute.current + cost <= limit:  # the previous window's weight must fall further, within this one
        return WINDOW_MS - math.floor((limit - cost - minute.current) * WINDOW_MS / minute.previous) - elapsed
    # Only the next window can take it, once this one's count has decayed enough.
    return 2 * WINDOW_MS - elapsed - math.floor((limit - cost) * WINDOW_MS / minute.current)


def _figures(minute: Minute, limit: int, elapsed: int) -> tuple[int, int]:
    """(remaining, milliseconds until fully replenished) for the headers."""
    load = minute.previous * (WINDOW_MS - elapsed) + minute.current * WINDOW_MS
    remaining = max(0, math.floor((limit * WINDOW_MS - load) / WINDOW_MS))
    if minute.current > 0:
        return remaining, 2 * WINDOW_MS - elapsed
    if minute.previous > 0:
        return remaining, WINDOW_MS - elapsed
    return remaining, 0


def _live_leases(state: TenantState, now_ms: int) -> tuple[int, Mapping[str, tuple[int, int]], int]:
    """(tokens in flight, leases, next expiry) without the leases expired at ``now_ms``."""
    if not state.leases or now_ms < state.next_expiry_ms:
        return state.in_flight, state.leases, state.next_expiry_ms
    leases = {k: v for k, v in state.leases.items() if v[1] > now_ms}
    next_expiry = min((v[1] for v in leases.values()), default=0)
    return sum(v[0] for v in leases.values()), leases, next_expiry


def acquire(state: TenantState, quota: Quota, tokens: int, now_ms: int, lease_ttl_ms: int,
            lease_id: str) -> tuple[TenantState, Decision]:
    """Check ``tokens`` and one request against every limit of ``quota``; count them only if all pass."""
    window, elapsed = divmod(now_ms, WINDOW_MS)
    tpm, rpm, max_in_flight = quota.tokens_per_minute, quota.requests_per_minute, quota.max_tokens_in_flight
    tok = roll(state.tokens, window) if tpm else state.tokens
    req = roll(state.requests, window) if rpm else state.requests
    in_flight, leases, next_expiry = _live_leases(state, now_ms) if max_in_flight else (
        state.in_flight, state.leases, state.next_expiry_ms)

    too_large = 0
    if tpm and tokens > tpm:
        too_large = _TPM
    elif max_in_flight and tokens > max_in_flight:
        too_large = _IN_FLIGHT
    exceeded, retry = 0, -1
    if not too_large:
        for code, wait in ((_TPM, _retry_ms(tok, tpm, tokens, elapsed) if tpm and tok else -1),
                           (_RPM, _retry_ms(req, rpm, 1, elapsed) if rpm and req else -1),
                           (_IN_FLIGHT, IN_FLIGHT_RETRY_MS if max_in_flight and in_flight + tokens > max_in_flight
                            else -1)):
            if wait > retry:
                exceeded, retry = code, wait
    admitted = not too_large and not exceeded
    if admitted:
        if tpm and tok:
            tok = Minute(window, tok.current + tokens, tok.previous)
        if rpm and req:
            req = Minute(window, req.current + 1, req.previous)
        if max_in_flight:
            expires = now_ms + lease_ttl_ms
            leases = {**leases, lease_id: (tokens, expires)}
            in_flight += tokens
            next_expiry = min(next_expiry, expires) if next_expiry else expires
    t_rem, t_reset = _figures(tok, tpm, elapsed) if tpm and tok else (0, 0)
    r_rem, r_reset = _figures(req, rpm, elapsed) if rpm and req else (0, 0)
    decision = Decision(admitted, too_large or exceeded, bool(too_large), retry if exceeded else -1, window,
                        t_rem, t_reset, r_rem, r_reset)
    return TenantState(tok, req, in_flight, leases, next_expiry), decision


def release(state: TenantState, lease: Lease, served: bool, now_ms: int) -> TenantState:
    """Free ``lease``'s tokens in flight; if not ``served``, refund its request and tokens to its minute."""
    in_flight, leases = state.in_flight, state.leases
    if lease.in_flight and lease.id in leases:
        leases = {k: v for k, v in leases.items() if k != lease.id}
        in_flight = max(0, in_flight - lease.tokens)
    tok, req = state.tokens, state.requests
    if not served:
        window = now_ms // WINDOW_MS
        if lease.per_minute_tokens:
            tok = _refund(tok, window, lease.window, lease.tokens)
        if lease.per_minute_request:
            req = _refund(req, window, lease.window, 1)
    return replace(state, tokens=tok, requests=req, in_flight=in_flight, leases=leases)


def _refund(minute: Minute | None, window: int, counted_in: int, amount: int) -> Minute | None:
    """Take ``amount`` back from the window it was counted in, while that window still counts."""
    if minute is None:
        return None
    minute = roll(minute, window)
    if counted_in == minute.window:
        return Minute(minute.window, max(0, minute.current - amount), minute.previous)
    if counted_in == minute.window - 1:
        return Minute(minute.window, minute.current, max(0, minute.previous - amount))
    return minute


def idle(state: TenantState, now_ms: int) -> bool:
    """Nothing left to remember: no live lease, and both counters' windows have passed."""
    window = now_ms // WINDOW_MS
    return (not state.leases or now_ms >= max(v[1] for v in state.leases.values())) and all(
        m is None or m.window < window - 1 for m in (state.tokens, state.requests))


def to_outcome(decision: Decision, quota: Quota, tenant: str, tokens: int, lease_id: str) -> QuotaOutcome:
    """The contract's outcome of ``decision``, with the lease an admitted request must give back."""
    tok = Window(quota.tokens_per_minute, decision.tokens_remaining, decision.tokens_reset_ms / 1000) \
        if quota.tokens_per_minute else None
    req = Window(quota.requests_per_minute, decision.requests_remaining, decision.requests_reset_ms / 1000) \
        if quota.requests_per_minute else None
    lease = Lease(tenant, lease_id, decision.window, tokens, quota.tokens_per_minute is not None,
                  quota.requests_per_minute is not None, quota.max_tokens_in_flight is not None) \
        if decision.admitted else None
    return QuotaOutcome(
        admitted=decision.admitted, tokens=tok, requests=req,
        exceeded=LIMIT_CODES.get(decision.exceeded), too_large=decision.too_large,
        retry_after_s=decision.retry_ms / 1000 if decision.retry_ms >= 0 else None, lease=lease)
