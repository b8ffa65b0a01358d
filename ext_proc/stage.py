"""A request stage, and the hook lists the runner walks.

A request's life in ext_proc is a pipeline of small stages (``ext_proc/stages/``, the order declared in
``pipeline.py``). A stage is any object with a ``name`` and some of these hooks; the runner
(``server.py``) calls each hook a stage has, in the pipeline's order, and skips the ones it has not
(found once, when the pipeline is built, never per request: as the pick chain does):

- ``on_request_headers(ctx) -> Answer | None``: the request's headers are in. An :class:`Answer` ends the
  request (a 401, a 400, a 429 before the body); None passes it on.
- ``on_request(ctx) -> Answer | Wait | None``: the request is whole (its body in, or none coming). A final
  answer ends it; the decision's answer (``final=False``) forwards it; a :class:`Wait` is awaited first.
- ``on_response_headers(ctx)``, ``on_response_body(ctx, chunk, end)``, ``on_response_end(ctx)``: the
  worker's answer passes; ``on_response_end`` once it has (at its headers, unless its body streams).
- ``on_end(ctx)``: the stream ended, however (answered, cancelled, reset): release what the request held.
- ``on_view(view)``: a new fleet view from EDS.

A stage may leave a hook out for its configuration by setting it to None when it is built (the admission
stage without a fair queue has no room to free). Stages never import each other: what one leaves for the
next is on the :class:`RequestContext`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol

from .context import Answer, RequestContext, Verdict
from .xds.fleet_view import FleetView

class Stage(Protocol):
    """A request stage: a name (for its metrics and log lines), and any of the hooks above."""

    name: str


class Stages:
    """The pipeline's hooks by phase, in order: bound methods found once, at build time."""

    def __init__(self, stages: Sequence[Any]) -> None:
        self.stages = tuple(stages)
        self.by_name: dict[str, Any] = {stage.name: stage for stage in self.stages}
        if len(self.by_name) != len(self.stages):
            raise ValueError(f"two request stages have the same name: {self.names}")
        self.on_request_headers: tuple[Callable[[RequestContext], Optional[Answer]], ...] = self._hooks(
            "on_request_headers")
        self.on_request: tuple[Callable[[RequestContext], Verdict], ...] = self._hooks("on_request")
        self.on_response_headers: tuple[Callable[[RequestContext], None], ...] = self._hooks("on_response_headers")
        self.on_response_body: tuple[Callable[[RequestContext, bytes, bool], None], ...] = self._hooks(
            "on_response_body")
        self.on_response_end: tuple[Callable[[RequestContext], None], ...] = self._hooks("on_response_end")
        self.on_end: tuple[Callable[[RequestContext], None], ...] = self._hooks("on_end")
        self.on_view: tuple[Callable[[FleetView], None], ...] = self._hooks("on_view")

    def _hooks(self, hook: str) -> tuple[Any, ...]:
        return tuple(getattr(stage, hook) for stage in self.stages if callable(getattr(stage, hook, None)))

    @property
    def names(self) -> list[str]:
        return [stage.name for stage in self.stages]
