"""A replica's usage counters read from its ``/metrics`` exposition: untrusted input, bounded.

The body is whatever answers at the replica's metrics port (size and time
bounded by the scrape, ``scraper.fetch_metrics``). What it may make the
store keep is bounded here: at most :data:`MAX_TENANTS` tenants per replica,
tenant names that are API-key tenants (``api_keys.TENANT_PATTERN``, which
``anonymous`` and ``other`` match), known outcomes only, and finite counts
from 0 to 2^53. Anything else is left out and counted in ``refused``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Mapping

from prometheus_client.metrics_core import Metric

from inferlb_runtime.api_keys import TENANT_PATTERN

from ..store.usage import COUNTER_COLUMNS, KINDS, OUTCOMES

FAMILIES = {"inferlb_ext_proc_tenant_requests": "requests", "inferlb_ext_proc_tenant_tokens": "tokens"}
START_TIME = "process_start_time_seconds"
# ext_proc keeps 1000 tenants apart and counts later ones as "other"; a body with more is not ext_proc's.
MAX_TENANTS = 1024
MAX_COUNT = 2**53  # exact in a float, and far inside a 64-bit column
_COLUMN = {(kind, outcome): i for i, (kind, outcome) in
           enumerate((k, o) for k in KINDS for o in OUTCOMES)}


@dataclass(frozen=True)
class ReplicaUsage:
    """One replica's cumulative counters per tenant (:data:`COUNTER_COLUMNS` order) and its process start."""

    started_at: float | None
    tenants: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    refused: int = 0  # series left out: bad tenant, unknown outcome, bad value, over the tenant cap


def valid_tenant(tenant: str) -> bool:
    return TENANT_PATTERN.fullmatch(tenant) is not None


def _count(value: float) -> int | None:
    if not math.isfinite(value) or value < 0 or value > MAX_COUNT:
        return None
    return int(value)


def replica_usage(families: Iterable[Metric]) -> ReplicaUsage | None:
    """The usage in parsed families (``text_string_to_metric_families``); None when there is none (an
    ext_proc from before usage counters, or not an ext_proc)."""
    started_at: float | None = None
    counts: dict[str, list[int]] = {}
    refused, found = 0, False
    for family in families:
        if family.name == START_TIME and family.samples:
            value = family.samples[0].value
            started_at = value if math.isfinite(value) and value > 0 else None
            continue
        kind = FAMILIES.get(family.name)
        if kind is None:
            continue
        found = True
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # _created
            tenant, outcome = sample.labels.get("tenant", ""), sample.labels.get("outcome", "")
            column = _COLUMN.get((kind, outcome))
            value = _count(sample.value)
            if column is None or value is None or not valid_tenant(tenant):
                refused += 1
                continue
            row = counts.get(tenant)
            if row is None:
                if len(counts) >= MAX_TENANTS:
                    refused += 1
                    continue
                row = counts[tenant] = [0] * len(COUNTER_COLUMNS)
            row[column] = value
    if not found:
        return None
    return ReplicaUsage(started_at, {tenant: tuple(row) for tenant, row in counts.items()}, refused)
