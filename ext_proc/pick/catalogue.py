"""What the fleet serves, by name: model versions, aliases and rollouts, derived once per EDS view.

The control plane publishes, per endpoint, the versions it serves and the
aliases it answers to, and on the locality the rollout table
(``inferlb_runtime/model_routing.py``). ext_proc resolves a request's
``model`` against this catalogue (``pick/model_filter.py``) and answers
``GET /v1/models`` from it. Deriving it per view, not per request, keeps a
resolution to a few dictionary look-ups whatever the fleet's size.

Which names are *known* counts every endpoint of the view, routable or not:
a version whose workers are all draining is still the fleet's (503
``model_unavailable``, retry later), not an unknown name (404). An empty
catalogue (no endpoint says what it serves: workers from before model
routing) means ext_proc does not route by model at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from inferlb_runtime.model_routing import Rollout

from ..model import EndpointView, Reply


def _nothing() -> Mapping[str, Any]:
    return MappingProxyType({})

MAX_LISTED = 20  # names a 404 lists (GET /v1/models has them all)


def _by_name(pairs: Sequence[tuple[str, EndpointView]]) -> Mapping[str, tuple[EndpointView, ...]]:
    grouped: dict[str, list[EndpointView]] = {}
    for name, endpoint in pairs:
        grouped.setdefault(name, []).append(endpoint)
    return MappingProxyType({name: tuple(endpoints) for name, endpoints in grouped.items()})


@dataclass(frozen=True, eq=False)
class ModelCatalogue:
    """Names -> endpoints, in EDS order: every endpoint (known names) and the routable ones (candidates).
    Compared by identity: one per view."""

    versions: Mapping[str, tuple[EndpointView, ...]] = field(default_factory=_nothing)
    aliases: Mapping[str, tuple[EndpointView, ...]] = field(default_factory=_nothing)
    rollouts: Mapping[str, Rollout] = field(default_factory=_nothing)
    routable_versions: Mapping[str, tuple[EndpointView, ...]] = field(default_factory=_nothing)
    routable_aliases: Mapping[str, tuple[EndpointView, ...]] = field(default_factory=_nothing)
    serving: Mapping[str, frozenset[str]] = field(default_factory=_nothing)  # name -> routable endpoint ids
    # No endpoint says what it serves: ext_proc does not route by model (workers from before it). A field, not
    # a property: read twice per request.
    empty: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "empty", not self.versions and not self.aliases)

    @classmethod
    def of(cls, endpoints: Sequence[EndpointView], rollouts: Mapping[str, Rollout]) -> "ModelCatalogue":
        versions = [(v, e) for e in endpoints for v in e.models]
        aliases = [(a, e) for e in endpoints for a in e.model_aliases]
        if not versions and not aliases:
            return EMPTY if not rollouts else cls(rollouts=MappingProxyType(dict(rollouts)))
        routable_versions = _by_name([(v, e) for v, e in versions if e.routable])
        routable_aliases = _by_name([(a, e) for a, e in aliases if e.routable])
        serving = {name: frozenset(e.id for e in found)
                   for table in (routable_aliases, routable_versions) for name, found in table.items()}
        return cls(_by_name(versions), _by_name(aliases), MappingProxyType(dict(rollouts)), routable_versions,
                   routable_aliases, MappingProxyType(serving))

    def names(self) -> list[str]:
        """Every name a request may use, sorted: versions, aliases and rollout aliases."""
        return sorted({*self.versions, *self.aliases, *self.rollouts})

    def models_list(self, created: int) -> dict[str, Any]:
        """``GET /v1/models`` in OpenAI's list shape; ``inferlb`` says what each name is and, for a rollout
        alias, its split."""
        data = []
        for name in self.names():
            rollout = self.rollouts.get(name)
            if rollout is not None:
                about: dict[str, Any] = {"kind": "rollout", "rollout": {
                    "versions": {v: p for v, p in rollout.versions}, "sticky": rollout.sticky}}
            elif name in self.versions:
                about = {"kind": "version", "routable_endpoints": len(self.routable_versions.get(name, ()))}
            else:
                about = {"kind": "alias", "routable_endpoints": len(self.routable_aliases.get(name, ()))}
            data.append({"id": name, "object": "model", "created": created, "owned_by": "inferlb", "inferlb": about})
        return {"object": "list", "data": data}

    def model(self, name: str, created: int) -> dict[str, Any] | None:
        """``GET /v1/models/{name}``: the one entry, or None when the fleet does not know the name."""
        return next((m for m in self.models_list(created)["data"] if m["id"] == name), None)

    def unknown(self, model: str | None) -> bool:
        """``model`` names nothing the fleet serves (the model filter's 404); never while the catalogue is empty."""
        return model is not None and not self.empty and model not in self.rollouts \
            and model not in self.versions and model not in self.aliases

    def not_found(self, model: str) -> Reply:
        """The 404 for a model the fleet does not serve, naming what it does."""
        return Reply(404, "model_not_found", self.unknown_message(model), type="invalid_request_error",
                     param="model")

    def unknown_message(self, model: str) -> str:
        """A 404's message: the name and what the fleet does serve."""
        names = self.names()
        listed = ", ".join(names[:MAX_LISTED]) + (f" (and {len(names) - MAX_LISTED} more)"
                                                 if len(names) > MAX_LISTED else "")
        return (f"The model '{model}' does not exist on this gateway. Available models: {listed} "
                "(GET /v1/models lists them).")


EMPTY = ModelCatalogue()


@runtime_checkable
class Watching(Protocol):
    """Optional for a built-in plugin of the pick chain: told each new view once, before the decisions that
    use it (the routable endpoints, the fleet's model catalogue), so that per-request work stays O(1)."""

    def new_view(self, routable: Sequence[EndpointView], catalogue: ModelCatalogue) -> None: ...
