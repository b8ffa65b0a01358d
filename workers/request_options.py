"""What a request's headers say about how to serve it: its priority class, its deadline, its model.

The headers and their parsing are shared with ext_proc
(``inferlb_runtime/request_class.py``, ``inferlb_runtime/model_routing.py``);
here a budget becomes a deadline on this worker's clock, and a bad header a
400 in OpenAI's shape. The model header is the version ext_proc chose (a
rollout's pick): it wins over the body's ``model``. ``Cache-Control``
(the same directives ext_proc honours) says what the worker cache may do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from inferlb_runtime.cache_control import CACHE_CONTROL_HEADER, NO_DIRECTIVES, CacheDirectives, parse_cache_control
from inferlb_runtime.model_routing import MODEL_HEADER, check_model_name
from inferlb_runtime.request_class import BadRequestHeader, Priority, parse_budget_s, parse_priority

from .protocol import APIError


@dataclass(frozen=True)
class RequestOptions:
    priority: Priority = Priority.STANDARD
    deadline: float | None = None  # time.perf_counter() seconds
    model: str | None = None  # the version named in MODEL_HEADER
    cache: CacheDirectives = NO_DIRECTIVES


def parse_request_options(headers: Mapping[str, str], now: float) -> RequestOptions:
    """The options in ``headers`` (lower-case names), received at ``now``; ``APIError`` 400 naming a bad one."""
    try:
        priority = parse_priority(headers)
        budget = parse_budget_s(headers)
    except BadRequestHeader as exc:
        raise APIError(400, str(exc), code="invalid_header", param=exc.header) from None
    model = headers.get(MODEL_HEADER)
    if model is not None:
        try:
            check_model_name(model, f"header {MODEL_HEADER}")
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_header", param=MODEL_HEADER) from None
    return RequestOptions(priority, now + budget if budget is not None else None, model,
                          parse_cache_control(headers.get(CACHE_CONTROL_HEADER)))
