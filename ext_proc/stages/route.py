"""Route: a request with a body to a path the fleet does not serve is answered 404 here, before its model is
looked at, so that the answer depends on the route alone (a known model's request to an unknown path got the
worker's ``not_found``, an unknown model's the gateway's ``model_not_found``)."""

from __future__ import annotations

from .. import wire
from ..context import Answer, RequestContext
from ..metrics import ExtProcMetrics
from ..model import Reply


class CheckRoute:
    name = "route"

    def __init__(self, inference_paths: tuple[str, ...], metrics: ExtProcMetrics) -> None:
        self.paths = frozenset(inference_paths)
        self.metrics = metrics

    def on_request_headers(self, ctx: RequestContext) -> Answer | None:
        if ctx.headers_phase:  # no body (a GET): the worker answers, as it does for its probes
            return None
        headers = ctx.headers
        method = headers.get(":method", "")
        path = headers.get(":path", "").partition("?")[0]
        if method != "POST" or path in self.paths:
            return None
        self.metrics.count("admit_replies", "not_found")
        return Answer(wire.reply_response(Reply(404, "not_found", f"{method} {path}: Not Found. This gateway "
                                                f"serves POST {', '.join(sorted(self.paths))}.",
                                                type="invalid_request_error")))
