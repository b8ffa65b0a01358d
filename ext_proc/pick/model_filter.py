"""The ``model`` filter of the pick chain: route a request to the endpoints that serve the model it names.

The Gateway API Inference Extension's way (an endpoint picker resolves the
model, then schedules among the pods serving it), as a step of ext_proc's
chain rather than a chain of its own: every preset's filters start with it
(``inferlb_runtime/pick_chain.py``), and a policy's own filters come after.

Resolution of the body's ``model``, once per request, before any filter
(:meth:`ModelFilter.resolve`), against the view's catalogue (``pick/catalogue.py``):

1. a rollout alias: one of its versions, by the rollout's split
   (:meth:`Rollout.choose`) with the next bucket of the alias's low-discrepancy
   sequence, or for a sticky rollout the caller's own bucket (:func:`sticky_bucket`
   of the alias and the API key id, or the body's OpenAI ``user``; the sequence
   when the request has none);
2. a version id some endpoint serves;
3. an alias some endpoint answers to (the candidates: the endpoints with it);
4. anything else: 404 ``model_not_found``, naming it and what the fleet
   serves; no worker sees the request.

A known model with no routable endpoint is a 503 ``model_unavailable``. No
``model`` in the body, or an empty catalogue (no endpoint says what it serves:
workers from before model routing), routes as before: no filtering at all.

The version chosen becomes ``RequestView.version``: the cost model predicts
for that version, and the servicer tells the worker in ``x-inferlb-model``.
A bare alias chooses no version: the endpoint picked serves it with its first
version that has the alias (only the worker knows which of its versions have
which alias: EDS lists an endpoint's versions and aliases apart), and the
worker names that version in its answer.

Filtering (:meth:`ModelFilter.filter`) is cached per pool and name, so a
decision costs a dictionary look-up whatever the fleet's size. A version only
served outside this replica's partition (a large fleet split among ext_proc
replicas) is still routed there: the partition balances load, it must not make
a model unavailable.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

from inferlb_runtime.model_routing import Rollout, sticky_bucket
from inferlb_runtime.pick_chain import ModelParams

from ..model import EndpointView, Reply, RequestView
from .catalogue import EMPTY, ModelCatalogue

# The golden ratio's fractional part: bucket n of an alias is frac(offset + n * GOLDEN), the additive
# recurrence with the lowest discrepancy. Uniform draws put a 10% canary at 10% +- 1.3 points (one
# standard deviation) over 2,000 requests; this sequence within 0.1 point over any run of requests.
GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


class ModelFilter:
    """Resolves the body's model to a version (or keeps a bare alias) and keeps the endpoints serving it."""

    name = "model"
    kind = "filter"
    Params = ModelParams

    def __init__(self, params: ModelParams = ModelParams()) -> None:
        self.params = params
        self._offset = random.Random(params.seed).random()  # replicas start at different points
        self._sequence: dict[str, int] = {}  # rollout alias -> requests split so far
        self._catalogue: ModelCatalogue = EMPTY
        self._pool: Sequence[EndpointView] | None = None
        self._narrowed: dict[str, Sequence[EndpointView]] = {}

    def new_view(self, routable: Sequence[EndpointView], catalogue: ModelCatalogue) -> None:
        self._catalogue = catalogue
        self._sequence = {a: n for a, n in self._sequence.items() if a in catalogue.rollouts}
        self._pool = None
        self._narrowed = {}

    def resolve(self, request: RequestView) -> RequestView | Reply:
        catalogue = self._catalogue
        model = request.model
        if model is None or catalogue.empty:
            return request
        version: str | None
        rollout = catalogue.rollouts.get(model)
        if rollout is not None:
            version = rollout.choose(self._bucket(rollout, request))
            found = catalogue.routable_versions.get(version)
        elif model in catalogue.versions:
            version, found = model, catalogue.routable_versions.get(model)
        elif model in catalogue.aliases:
            version, found = None, catalogue.routable_aliases.get(model)
        else:
            return catalogue.not_found(model)
        if not found:
            which = f"'{model}' (its rollout's version '{version}')" if rollout is not None else f"'{model}'"
            return Reply(503, "model_unavailable", f"The model {which} is served by no routable endpoint right now "
                         "(its workers are unhealthy, draining or starting). Retry later.", param="model",
                         retry_after_s=1)
        return dataclasses.replace(request, version=version) if version is not None else request

    def _bucket(self, rollout: Rollout, request: RequestView) -> float:
        who = request.key_id if rollout.sticky == "api_key" else request.user if rollout.sticky == "user" else None
        if who:
            return sticky_bucket(rollout.alias, who)
        n = self._sequence.get(rollout.alias, 0)
        self._sequence[rollout.alias] = n + 1
        return (self._offset + n * GOLDEN) % 1.0

    def filter(self, request: RequestView, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        catalogue = self._catalogue
        name = request.version or request.model
        if name is None or catalogue.empty:
            return endpoints
        if endpoints is not self._pool:
            self._pool, self._narrowed = endpoints, {}
        narrowed = self._narrowed.get(name)
        if narrowed is None:
            serving = catalogue.serving.get(name)
            if serving is None:  # not resolved (resolve() answers unknown names): leave the pool as it is
                return endpoints
            kept = tuple(e for e in endpoints if e.id in serving)
            if len(kept) == len(endpoints):
                narrowed = endpoints  # the same object: the steps after cache per sequence
            elif kept:
                narrowed = kept
            else:  # served only outside this replica's partition
                narrowed = catalogue.routable_versions.get(name) or catalogue.routable_aliases.get(name) or ()
            self._narrowed[name] = narrowed
        return narrowed
