"""``GET /v1/models`` (and ``/v1/models/{id}``), answered from the fleet's catalogue: a client sees every
version, alias and rollout the fleet serves, not one worker's list.

While the catalogue is empty (no worker says what it serves: an older fleet) the request goes to a worker
as before. Like any request of a key, it has passed the key's quota check, and carries its x-ratelimit-*
headers.
"""

from __future__ import annotations

import time
from urllib.parse import unquote

from .. import wire
from ..context import Answer, RequestContext
from ..metrics import OTHER_MODEL, ExtProcMetrics
from ..model import Reply
from ..pick.catalogue import ModelCatalogue
from ..quota import rate_limit_headers
from ..xds.fleet_view import ViewSource


class ListModels:
    name = "models"

    def __init__(self, source: ViewSource, metrics: ExtProcMetrics) -> None:
        self.source = source
        self.metrics = metrics
        self._created = int(time.time())  # the "created" of the models ext_proc lists
        self._answer: tuple[ModelCatalogue, bytes] | None = None  # the list, per catalogue

    def on_request(self, ctx: RequestContext) -> Answer | None:
        if not ctx.bodiless:  # a body came: not a listing
            return None
        headers = ctx.headers
        path = headers.get(":path", "").partition("?")[0]
        if not path.startswith("/v1/models") or headers.get(":method") != "GET":
            return None
        view = self.source.view
        catalogue = view.catalogue if view is not None else None
        if catalogue is None or catalogue.empty:
            return None
        limits = tuple(rate_limit_headers(ctx.quota)) if ctx.quota is not None else ()
        if path in ("/v1/models", "/v1/models/"):
            ctx.outcome, ctx.forwarded = "served", True  # answered: its quota is used, as a worker's answer's
            if limits:
                return Answer(wire.json_response(catalogue.models_list(self._created), "inferlb_models", *limits))
            return Answer(self._listing(catalogue))
        if not path.startswith("/v1/models/"):
            return None
        name = unquote(path[len("/v1/models/"):])  # an alias may hold a slash (sentence-transformers/...)
        entry = catalogue.model(name, self._created)
        if entry is not None:
            ctx.outcome, ctx.forwarded = "served", True
            return Answer(wire.json_response(entry, "inferlb_model", *limits))
        self.metrics.model_answer(OTHER_MODEL, "404")
        return ctx.refusal(Reply(404, "model_not_found", catalogue.unknown_message(name),
                                 type="invalid_request_error", param="model"))

    def _listing(self, catalogue: ModelCatalogue) -> bytes:
        cached = self._answer
        if cached is None or cached[0] is not catalogue:
            cached = self._answer = (catalogue, wire.json_response(catalogue.models_list(self._created),
                                                                   "inferlb_models"))
        return cached[1]
