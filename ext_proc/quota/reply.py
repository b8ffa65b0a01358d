"""The 429 a request over its tenant's quota gets, worded and typed as OpenAI's rate-limit errors.

OpenAI's body names the limit that was hit, its value, what was used or
asked for and when to retry, with ``type`` ``"tokens"`` or ``"requests"``
and ``code`` ``"rate_limit_exceeded"``; its SDKs raise ``RateLimitError`` on
the 429 and read ``retry-after-ms`` / ``retry-after``. A request that alone
is over a limit gets the same status but no retry time: only splitting it
helps, and the message says so.
"""

from __future__ import annotations

import math

from ..model import Reply
from . import QuotaOutcome, rate_limit_headers

_LIMITS = {
    "tokens_per_minute": ("tokens", "tokens per min (TPM)"),
    "requests_per_minute": ("requests", "requests per min (RPM)"),
    "max_tokens_in_flight": ("tokens", "tokens in flight"),
}


def quota_reply(tenant: str, outcome: QuotaOutcome, tokens: int) -> Reply:
    """The 429 for a refused quota check of a ``tokens``-token request of ``tenant``."""
    exceeded = outcome.exceeded or "tokens_per_minute"
    type_, what = _LIMITS.get(exceeded, ("tokens", exceeded))
    window = outcome.requests if type_ == "requests" else outcome.tokens
    limit = f"Limit {window.limit}, " if window is not None and exceeded != "max_tokens_in_flight" else ""
    asked = f"Requested {tokens if type_ == 'tokens' else 1}."
    if outcome.too_large:
        message = (f"Request too large for tenant {tenant} on {what}: {limit}{asked} "
                   "Split the input into smaller requests.")
    else:
        used = f"Used {window.limit - window.remaining}, " if window is not None and limit else ""
        wait = (f" Please try again in {_seconds(outcome.retry_after_s)}."
                if outcome.retry_after_s is not None else "")
        message = f"Rate limit reached for tenant {tenant} on {what}: {limit}{used}{asked}{wait}"
    return Reply(429, "rate_limit_exceeded", message, type=type_, headers=tuple(rate_limit_headers(outcome)))


def _seconds(seconds: float) -> str:
    return f"{math.ceil(seconds * 1000)}ms" if seconds < 1 else f"{math.ceil(seconds * 10) / 10:g}s"
