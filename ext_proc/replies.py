"""ext_proc's own answers to a request, counted the same wherever a stage gives one."""

from __future__ import annotations

from .context import Answer, RequestContext
from .metrics import OTHER_MODEL, ExtProcMetrics
from .model import Reply
from .xds.fleet_view import ViewSource


class Replies:
    """Counts a refusal (by code; a 429 as a shed, by the step that judged it; a model's 404 or 503 by
    version) and answers it with the caller's x-ratelimit-* headers."""

    def __init__(self, metrics: ExtProcMetrics, source: ViewSource) -> None:
        self.metrics = metrics
        self.source = source

    def refuse(self, ctx: RequestContext, model: str | None, reply: Reply, at: str = "decision") -> Answer:
        """``at``: the step that judged it, counted for a shed (how many 429s never waited for their body)."""
        self.metrics.count("admit_replies", reply.code)
        if reply.status == 429:
            self.metrics.count("sheds", at)
        if reply.param == "model":
            self.metrics.model_answer(self.model_label(model), str(reply.status))
        ctx.outcome = "shed" if reply.status == 429 else "failed"
        return ctx.refusal(reply)

    def model_label(self, version: str | None) -> str:
        """A version as a metric label: one the catalogue lists, else "other" (bounded label values)."""
        view = self.source.view
        return version if version is not None and view is not None and version in view.catalogue.versions \
            else OTHER_MODEL
