"""What a request's headers say about how to serve it: its priority class and its time budget.

ext_proc reads them to shed and to pick an endpoint that can make the
deadline; the worker reads them to order its queue and to refuse inputs
whose deadline has passed. One parser, so both agree on what is valid.

The class is named by the Gateway API Inference Extension's objective header,
``x-gateway-inference-objective``, with the extension's criticality levels as
objective names: ``critical``, ``standard`` (the default) and ``sheddable``.
The budget is in milliseconds from when the request is received:
``x-inferlb-timeout-ms``, or Envoy's ``x-envoy-expected-rq-timeout-ms`` (set
by an Envoy whose route has a timeout); the smaller one wins. A budget rather
than a wall-clock time needs no clock agreement between machines.
"""

from __future__ import annotations

import math
from enum import IntEnum
from typing import Mapping

OBJECTIVE_HEADER = "x-gateway-inference-objective"
TIMEOUT_HEADER = "x-inferlb-timeout-ms"
ENVOY_TIMEOUT_HEADER = "x-envoy-expected-rq-timeout-ms"
BUDGET_HEADERS = (TIMEOUT_HEADER, ENVOY_TIMEOUT_HEADER)


class Priority(IntEnum):
    """Request classes, best first (the Gateway API Inference Extension's criticality levels)."""

    CRITICAL = 0
    STANDARD = 1
    SHEDDABLE = 2


PRIORITIES: Mapping[str, Priority] = {p.name.lower(): p for p in Priority}

# Aging, one rule wherever requests wait by class (a worker's queue, ext_proc's fair admission queue): a
# class climbs one rank per AGING_S its longest-waiting request has waited, so no class starves.
AGING_S = 2.0


def aged_rank(priority: int, waiting_since: float, now: float, aging_s: float = AGING_S) -> int:
    """``priority`` (0 best) improved by one per ``aging_s`` waited since ``waiting_since``, never below 0."""
    return max(0, priority - int(max(0.0, now - waiting_since) / aging_s))


class BadRequestHeader(ValueError):
    """A class or budget header with a value that means nothing; ``header`` names it."""

    def __init__(self, header: str, message: str) -> None:
        super().__init__(message)
        self.header = header


def parse_priority(headers: Mapping[str, str]) -> Priority:
    """The class ``headers`` (lower-case names) ask for; STANDARD when they name none."""
    objective = headers.get(OBJECTIVE_HEADER, "").strip().lower()
    if not objective:
        return Priority.STANDARD
    try:
        return PRIORITIES[objective]
    except KeyError:
        raise BadRequestHeader(OBJECTIVE_HEADER, f"header {OBJECTIVE_HEADER} is {objective!r}; expected one of "
                               f"{', '.join(PRIORITIES)}") from None


def parse_budget_s(headers: Mapping[str, str]) -> float | None:
    """The request's time budget in seconds (the smallest of the budget headers), or None without one."""
    budgets = [_budget_ms(headers, name) for name in BUDGET_HEADERS if name in headers]
    return min(budgets) / 1000 if budgets else None


def _budget_ms(headers: Mapping[str, str], name: str) -> float:
    raw = headers[name].strip()
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise BadRequestHeader(name, f"header {name} is {raw!r}; expected a positive number of milliseconds")
    return value
