"""What a request's headers say about how to serve it: its priority class and its deadline.

The class is named by the Gateway API Inference Extension's objective header,
``x-gateway-inference-objective``, with the extension's criticality levels
as objective names: ``critical``, ``standard`` (the default) and
``sheddable``. The deadline is a time budget in milliseconds from when the
worker receives the request: ``x-inferlb-timeout-ms``, or Envoy's
``x-envoy-expected-rq-timeout-ms`` (set when the route has a timeout); the
smaller one wins. A budget rather than a wall-clock time needs no clock
agreement between machines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from .batcher import Priority
from .protocol import APIError

OBJECTIVE_HEADER = "x-gateway-inference-objective"
TIMEOUT_HEADER = "x-inferlb-timeout-ms"
ENVOY_TIMEOUT_HEADER = "x-envoy-expected-rq-timeout-ms"

PRIORITIES = {p.name.lower(): p for p in Priority}


@dataclass(frozen=True)
class RequestOptions:
    priority: Priority = Priority.STANDARD
    deadline: float | None = None  # time.perf_counter() seconds


def parse_request_options(headers: Mapping[str, str], now: float) -> RequestOptions:
    """The options in ``headers`` (lower-case names), received at ``now``; ``APIError`` 400 naming a bad one."""
    objective = headers.get(OBJECTIVE_HEADER, "").strip().lower()
    if objective and objective not in PRIORITIES:
        raise APIError(400, f"header {OBJECTIVE_HEADER} is {objective!r}; expected one of "
                       f"{', '.join(PRIORITIES)}", code="invalid_header", param=OBJECTIVE_HEADER)
    budgets = [_budget_ms(headers, name) for name in (TIMEOUT_HEADER, ENVOY_TIMEOUT_HEADER) if name in headers]
    deadline = now + min(budgets) / 1000 if budgets else None
    return RequestOptions(PRIORITIES.get(objective, Priority.STANDARD), deadline)


def _budget_ms(headers: Mapping[str, str], name: str) -> float:
    raw = headers[name].strip()
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise APIError(400, f"header {name} is {raw!r}; expected a positive number of milliseconds",
                       code="invalid_header", param=name)
    return value
