"""Quota: take the request's tokens from its tenant's quota (``ext_proc/quota/``), and give back what a request
that never ran did not use.

A caller without a quota costs nothing here. The quota store may be a round trip away (Redis): the
decision's time leaves that wait out. A refused request gets OpenAI's 429 with ``Retry-After``; a store
that cannot be reached, when the gateway fails closed, a 503.
"""

from __future__ import annotations

import asyncio
import logging
import time

from .. import wire
from ..context import Answer, RequestContext, Verdict, Wait
from ..metrics import ExtProcMetrics
from ..model import Reply
from ..quota import Lease, QuotaStore, rate_limit_headers
from ..quota.reply import quota_reply

log = logging.getLogger("inferlb.ext_proc")

QUOTA_UNAVAILABLE = Reply(503, "quota_unavailable", "Quotas cannot be checked right now (the quota store is "
                          "unreachable and this gateway is configured to fail closed). Retry shortly.",
                          retry_after_s=1)


class Quota:
    """Leaves the quota's outcome (``ctx.quota``) for the x-ratelimit-* headers of every later answer."""

    name = "quota"

    def __init__(self, store: QuotaStore, metrics: ExtProcMetrics) -> None:
        self.store = store
        self.metrics = metrics
        self._releases: set[asyncio.Task[None]] = set()  # leases being given back

    def on_request(self, ctx: RequestContext) -> Verdict:
        if ctx.caller.quota.unlimited:
            return None
        return Wait(self._acquire(ctx))

    async def _acquire(self, ctx: RequestContext) -> Answer | None:
        waited = time.perf_counter()
        caller, tokens = ctx.caller, ctx.tokens
        ctx.quota = outcome = await self.store.acquire(caller.tenant, caller.quota, tokens)
        if outcome.admitted:
            ctx.started += time.perf_counter() - waited  # the decision time leaves the round trip out
            return None
        ctx.outcome = "rate_limited"
        if outcome.store_failed:
            self.metrics.count("admit_replies", "quota_unavailable")
            return Answer(wire.reply_response(QUOTA_UNAVAILABLE))
        self.metrics.count("admit_replies", "rate_limit_exceeded")
        return Answer(wire.reply_response(quota_reply(caller.tenant, outcome, tokens)))

    def on_response_headers(self, ctx: RequestContext) -> None:
        if ctx.quota is not None:  # OpenAI's x-ratelimit-* headers as the check left them
            ctx.limits = wire.header_entries(rate_limit_headers(ctx.quota))

    def on_end(self, ctx: RequestContext) -> None:
        lease = ctx.quota.lease if ctx.quota is not None else None
        if lease is not None and lease.releases(ctx.forwarded):  # usually not: nothing in flight to free
            self._give_back(lease, ctx.forwarded)

    def _give_back(self, lease: Lease, served: bool) -> None:
        """Off the stream: it may be ending by cancellation, and Redis is a round trip away."""
        task = asyncio.get_running_loop().create_task(self.store.release(lease, served))
        self._releases.add(task)
        task.add_done_callback(self._released)

    def _released(self, task: asyncio.Task[None]) -> None:
        self._releases.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("quota lease release failed", exc_info=task.exception())
