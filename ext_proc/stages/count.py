"""Parse and count: the request's tokens, with the model's own tokenizer (``tokens.py``).

Counted even when nothing is routable yet: the view may change while the request waits its turn, and the
tenant's usage counts its tokens whatever answers it. A large body is counted off the event loop; Envoy's
message timeout is extended before (or while) it is, so that a body the worker would refuse cleanly does
not become a 504.
"""

from __future__ import annotations

import asyncio
import time

from ..context import Answer, RequestContext, Verdict, Wait
from ..model import RequestView
from ..tokens import TokenCounter

# A large body still being counted after this long gets Envoy's message timeout extended: half the control
# plane's default message_timeout (200 ms), so the extension is sent well before Envoy gives up.
COUNT_BEFORE_EXTENDING_S = 0.1
# A body this large gets the extension at once: counting it takes a good part of the message timeout (about
# 0.5 s per MiB of short inputs), and on a busy host the timer above fired too late (a 504 in a fresh-clone run).
EXTEND_AT_ONCE_BYTES = 128 * 1024


class CountTokens:
    """Leaves the counted request (``ctx.request``, ``ctx.tokens``) and the decision's start time."""

    name = "count"

    def __init__(self, counter: TokenCounter) -> None:
        self.counter = counter

    def on_request(self, ctx: RequestContext) -> Verdict:
        ctx.started = time.perf_counter()
        body = ctx.payload
        if not self.counter.needs_thread(body):
            self._counted(ctx, self.counter.count(body, ctx.headers))
            return None
        # Held (EPP) streams have no per-message wait to extend at once; they get the timer's extension.
        extend = 0.0 if len(body) > EXTEND_AT_ONCE_BYTES and not ctx.held else COUNT_BEFORE_EXTENDING_S
        return Wait(self._count_in_thread(ctx, body), extend)

    async def _count_in_thread(self, ctx: RequestContext, body: bytes) -> Answer | None:
        self._counted(ctx, await asyncio.to_thread(self.counter.count, body, ctx.headers))
        return None

    @staticmethod
    def _counted(ctx: RequestContext, request: RequestView) -> None:
        ctx.request = request
        ctx.tokens = request.tokens
        if ctx.span is not None:
            ctx.span.set_attributes({"inferlb.tokens": request.tokens, "inferlb.tokens_estimated": request.estimated,
                                     "inferlb.tenant": ctx.caller.tenant})
