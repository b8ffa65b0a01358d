"""Usage: the tenant's requests and tokens by outcome, counted once the stream has ended."""

from __future__ import annotations

from ..context import RequestContext
from ..metrics import ExtProcMetrics


class Usage:
    name = "usage"

    def __init__(self, metrics: ExtProcMetrics) -> None:
        self.metrics = metrics

    def on_end(self, ctx: RequestContext) -> None:
        self.metrics.tenant_usage(ctx.caller.tenant, ctx.outcome, ctx.tokens)
