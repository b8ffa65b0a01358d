"""An operator's own request stage, added by configuration (``[ext_proc] stages``), with its failures contained.

The operator installs a class (an entry point of the ``inferlb.policies`` group, or a ``module:attribute``
under ``allowed_policy_modules``: the same rules as policies, ``inferlb_runtime/plugins.py``) whose instances
have ``on_request(request) -> Reply | None`` (or an ``async def``). It sees the request as the pick chain
does (:class:`~ext_proc.model.RequestView`: tokens, model, inputs, headers, class, tenant) and may refuse it
with a :class:`~ext_proc.model.Reply`, sent in OpenAI's error shape, or pass it on (None).

Contained: a stage that raises, returns anything else, or takes longer than its time budget is skipped for
that request (the request goes on), counted in ``inferlb_ext_proc_stage_failures_total{stage}`` and logged
at most once a minute per stage.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from inferlb_runtime import plugins
from inferlb_runtime.plugins import LogLimiter, PolicyAllowlist

from ..context import Answer, RequestContext, Verdict, Wait
from ..metrics import ExtProcMetrics
from ..model import Reply
from ..replies import Replies

log = logging.getLogger("inferlb.ext_proc")


@dataclass(frozen=True)
class OperatorStageSpec:
    """One configured stage: what to load, its parameters, the built-in stage it runs before, its budget."""

    plugin: str
    params: Mapping[str, Any] = field(default_factory=dict)
    before: str = "decide"
    timeout_s: float = 0.05


class OperatorStage:
    """The adapter between the runner and an operator's object: the runner never calls user code bare."""

    def __init__(self, spec: OperatorStageSpec, allow: PolicyAllowlist, metrics: ExtProcMetrics,
                 replies: Replies) -> None:
        self.plugin = plugins.build("stage", spec.plugin, spec.params, allow)  # ValueError: refused at start-up
        self.name = f"operator:{spec.plugin}"
        self.timeout_s = spec.timeout_s
        self.metrics = metrics
        self.replies = replies
        self._logs = LogLimiter()

    def on_request(self, ctx: RequestContext) -> Verdict:
        assert ctx.request is not None
        request = ctx.chain_request(ctx.request)
        try:
            verdict = self.plugin.on_request(request)
        except Exception as exc:
            return self._failed("error", exc)
        if inspect.isawaitable(verdict):
            return Wait(self._awaited(ctx, verdict))
        return self._answer(ctx, verdict)

    async def _awaited(self, ctx: RequestContext, pending: Any) -> Answer | None:
        try:
            verdict = await asyncio.wait_for(pending, self.timeout_s)
        except asyncio.TimeoutError:
            return self._failed("timeout", None)
        except Exception as exc:
            return self._failed("error", exc)
        return self._answer(ctx, verdict)

    def _answer(self, ctx: RequestContext, verdict: object) -> Answer | None:
        if verdict is None:
            return None
        if not isinstance(verdict, Reply):
            return self._failed("bad_return", TypeError(f"on_request returned {type(verdict).__name__}, not a "
                                                        "Reply or None"))
        assert ctx.request is not None
        return self.replies.refuse(ctx, ctx.request.model, verdict, self.name)

    def _failed(self, reason: str, exc: BaseException | None) -> None:
        self.metrics.count("stage_failures", self.name)
        held = self._logs.allow(reason)
        if held is not None:
            log.error("operator stage failed; the request goes on without it",
                      extra={"stage": self.name, "reason": reason, "held_back": held,
                             "error": plugins.describe_exception(exc) if exc is not None else "over its time budget"})
        return None
