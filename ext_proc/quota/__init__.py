"""Tenant quotas: what a check decides, the headers that tell the client, and the store interface.

ext_proc checks a request against its tenant's :class:`~inferlb_runtime.api_keys.Quota`
before routing it, with the exact token count (``QuotaStore.acquire``). The
check covers all of the key's limits at once and consumes only if every one
passes, so a request refused for its requests per minute never spends tokens
per minute. An admitted request holds a :class:`Lease` until it is answered;
``release`` gives back its tokens in flight, and also refunds the minute's
request and tokens when the request was then shed or could not be routed
(it did no work, so it should cost nothing).

Two stores implement :class:`QuotaStore` with one algorithm
(``ext_proc/quota/algorithm.py``): in process (``quota_memory``, one
replica) and in Redis (``quota_redis``, shared by replicas). Standard library
only: this module is the contract both sides (the stores and the request path)
import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol
from urllib.parse import urlsplit

from inferlb_runtime.api_keys import Quota

TOKENS_PER_MINUTE = "tokens_per_minute"
REQUESTS_PER_MINUTE = "requests_per_minute"
MAX_TOKENS_IN_FLIGHT = "max_tokens_in_flight"
Limit = Literal["tokens_per_minute", "requests_per_minute", "max_tokens_in_flight"]
FailureMode = Literal["open", "closed"]


@dataclass(frozen=True, slots=True)
class Window:
    """One per-minute limit as the client sees it (OpenAI's ``x-ratelimit-*`` figures)."""

    limit: int
    remaining: int
    reset_s: float  # until the window is fully replenished, if nothing more is admitted


@dataclass(frozen=True, slots=True)
class Lease:
    """What an admitted request holds until it is answered; the store needs it back to release.

    ``window`` is the store's minute the request was counted in (a refund goes to
    that minute's counters while they still count); the flags say which limits
    the request was counted against, so a release undoes exactly that.
    """

    tenant: str
    id: str
    window: int
    tokens: int
    per_minute_tokens: bool
    per_minute_request: bool
    in_flight: bool

    def refunds(self, served: bool) -> bool:
        """Whether a release of a request that was (not) ``served`` gives back the minute's request or tokens."""
        return not served and (self.per_minute_tokens or self.per_minute_request)

    def releases(self, served: bool) -> bool:
        """Whether releasing it changes anything (tokens in flight to free, or a refund): else skip the call."""
        return self.in_flight or self.refunds(served)


@dataclass(frozen=True, slots=True)
class QuotaOutcome:
    """A quota check's decision, with the figures the response headers carry."""

    admitted: bool
    tokens: Window | None = None  # None: the key has no tokens per minute (or the store failed)
    requests: Window | None = None  # None: the key has no requests per minute (or the store failed)
    exceeded: Limit | None = None  # the limit that refused (the one to wait longest for)
    retry_after_s: float | None = None  # when a retry can pass, if nothing else is admitted meanwhile
    lease: Lease | None = None  # None: nothing to release (refused, no limits, or the store failed)
    too_large: bool = False  # the request alone is over a limit: no retry helps, only splitting it
    store_failed: bool = False  # the shared store did not answer; the failure mode decided


ADMITTED = QuotaOutcome(admitted=True)  # a tenant without limits


REDIS_SCHEMES = ("redis", "rediss", "unix")


def check_store_url(url: str) -> str:
    """``url`` if it names a store, else ValueError saying why (never echoing the URL: it may hold a password)."""
    if url == "memory":
        return url
    parts = urlsplit(url)
    if parts.scheme not in REDIS_SCHEMES:
        raise ValueError(f"must be 'memory' or a redis://, rediss:// or unix:// URL (the scheme is "
                         f"{parts.scheme!r})")
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError("a unix:// URL needs the socket's path")
        return url
    if not parts.hostname:
        raise ValueError(f"a {parts.scheme}:// URL needs a host")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"the {parts.scheme}:// URL's port is not a port number") from None
    return url


class QuotaStore(Protocol):
    """Where the counters live; every method is called on ext_proc's event loop."""

    async def acquire(self, tenant: str, quota: Quota, tokens: int) -> QuotaOutcome:
        """Check ``tokens`` (and one request) against every limit of ``quota`` atomically; consume only if all pass."""

    async def release(self, lease: Lease, served: bool) -> None:
        """The request is over: free its tokens in flight; if not ``served`` also refund its minute's request
        and tokens. Never raises (a lost release ends with the lease's expiry)."""

    async def aclose(self) -> None:
        """Drop connections; the store is not used after."""


class QuotaObserver(Protocol):
    """What the stores report (``ext_proc/metrics.py`` implements it); every call is on the event loop."""

    def quota_decision(self, result: str) -> None:
        """One acquire's result: ``admitted``, ``limited``, ``failed_open`` or ``failed_closed``."""

    def quota_store_error(self, operation: str, reason: str) -> None:
        """The shared store did not answer ``operation`` (``acquire`` or ``release``); ``reason``:
        ``timeout``, ``error`` or ``backoff`` (not tried, it failed moments ago)."""

    def quota_store_latency(self, seconds: float) -> None:
        """One round trip to the shared store (only stores with one report it)."""


class NoQuotaObserver:
    """The default observer: reports nowhere."""

    def quota_decision(self, result: str) -> None:
        pass

    def quota_store_error(self, operation: str, reason: str) -> None:
        pass

    def quota_store_latency(self, seconds: float) -> None:
        pass


def decision_result(outcome: QuotaOutcome, failure_mode: FailureMode) -> str:
    """The observer's label for ``outcome``."""
    if outcome.store_failed:
        return "failed_open" if failure_mode == "open" else "failed_closed"
    return "admitted" if outcome.admitted else "limited"


# --- headers ---------------------------------------------------------------------------------------


def rate_limit_headers(outcome: QuotaOutcome) -> list[tuple[str, str]]:
    """OpenAI's rate-limit headers for the limits the key has, plus the retry time of a refusal.

    ``x-ratelimit-reset-*`` use OpenAI's duration format (``1s``, ``6m0s``,
    ``250ms``); ``retry-after`` is whole seconds, rounded up, and
    ``retry-after-ms`` the milliseconds (the OpenAI SDKs prefer the latter).
    """
    headers: list[tuple[str, str]] = []
    for kind, window in (("requests", outcome.requests), ("tokens", outcome.tokens)):
        if window is not None:
            headers += [(f"x-ratelimit-limit-{kind}", str(window.limit)),
                        (f"x-ratelimit-remaining-{kind}", str(window.remaining)),
                        (f"x-ratelimit-reset-{kind}", duration(window.reset_s))]
    if not outcome.admitted and outcome.retry_after_s is not None:
        ms = max(1, math.ceil(outcome.retry_after_s * 1000))
        headers.append(("retry-after", str(math.ceil(ms / 1000))))
        headers.append(("retry-after-ms", str(ms)))
    return headers


def duration(seconds: float) -> str:
    """``seconds`` as OpenAI writes a reset time (Go's duration format, to the millisecond, rounded up).

    ``0s``, ``250ms``, ``1s``, ``8.64s``, ``6m0s``, ``1h0m0s``.
    """
    ms = max(0, math.ceil(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, frac = divmod(rest, 1000)
    secs = f"{whole}.{frac:03d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    if minutes:
        return f"{minutes}m{secs}"
    return secs
