"""What a request's headers say about how to serve it: its priority class and its deadline.

The headers and their parsing are shared with ext_proc
(``inferlb_runtime/request_class.py``); here a budget becomes a deadline on
this worker's clock, and a bad header a 400 in OpenAI's shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from inferlb_runtime.request_class import BadRequestHeader, Priority, parse_budget_s, parse_priority

from .protocol import APIError


@dataclass(frozen=True)
class RequestOptions:
    priority: Priority = Priority.STANDARD
    deadline: float | None = None  # time.perf_counter() seconds


def parse_request_options(headers: Mapping[str, str], now: float) -> RequestOptions:
    """The options in ``headers`` (lower-case names), received at ``now``; ``APIError`` 400 naming a bad one."""
    try:
        priority = parse_priority(headers)
        budget = parse_budget_s(headers)
    except BadRequestHeader as exc:
        raise APIError(400, str(exc), code="invalid_header", param=exc.header) from None
    return RequestOptions(priority, now + budget if budget is not None else None)
