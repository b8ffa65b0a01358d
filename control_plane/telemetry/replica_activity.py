"""Which ext_proc replicas carry traffic, so a large fleet is partitioned among those only.

Each replica picks from its own partition of a large fleet (``ext_proc``'s
``Router.set_partition``; the control plane lists the replicas in EDS). A
replica that is connected but gets no requests (Envoy sends it none, or it
is wedged) would keep its partition, and part of the fleet would be pickable
only by a replica that picks nothing. So every scrape interval the control
plane reads each replica's decision count (``inferlb_ext_proc_decision_seconds_count``,
monotonic: never pruned) from its ``/metrics``, at the IP its xDS stream
comes from and the port its node metadata names; replicas whose count grew
since the last look are the active ones. When none grew (an idle fleet),
every connected replica stays listed. A replica left out picks from the
whole fleet if traffic reaches it, and is listed again from the next look.

The decision is pure (:class:`ReplicaActivity`); the reading is the I/O edge
(:func:`read_replicas`, bounded like worker scrapes). The same body, parsed
once, carries the replica's usage counters by tenant: the watch hands them
to the usage writer (``usage.ingest``), so billing costs no second scrape.
A look asks for those samples only (``SAMPLES``, as ``name[]``), so ext_proc
renders a few lines instead of its whole exposition.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import httpx
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from inferlb_runtime.hostport import authority

from ..usage.readings import FAMILIES as USAGE_FAMILIES
from ..usage.readings import START_TIME, ReplicaUsage, replica_usage
from .scraper import ScrapeError, Scraper, ScraperConfig, fetch_metrics

log = logging.getLogger("inferlb.control_plane.replicas")

DECISIONS = "inferlb_ext_proc_decision_seconds"  # a histogram: its _count is every decision made
# The samples a look asks for (ext_proc renders only these): the decision count and the usage counters.
SAMPLES = (f"{DECISIONS}_count", START_TIME, *(f"{family}_total" for family in USAGE_FAMILIES))


@dataclass(frozen=True)
class MetricsTarget:
    address: str
    port: int


@dataclass
class ReplicaActivity:
    """The replicas whose decision count grew between the last two looks."""

    _last: dict[str, float] = field(default_factory=dict)
    active: frozenset[str] = frozenset()

    def observe(self, counts: Mapping[str, float | None]) -> frozenset[str]:
        """Fold in one look (node id -> its count, None when it could not be read); the active set."""
        self.active = frozenset(node for node, count in counts.items()
                                if count is not None and node in self._last and count > self._last[node])
        self._last = {node: count for node, count in counts.items() if count is not None}
        return self.active


@dataclass(frozen=True)
class ReplicaReading:
    """What one look at a replica's /metrics gives: its decision count and its usage (None: not reported)."""

    decisions: float | None
    usage: ReplicaUsage | None


def decision_count(families: Iterable[Metric]) -> float | None:
    """The decisions a replica's exposition reports; None when it reports none (not an ext_proc)."""
    for family in families:
        if family.name == DECISIONS:
            counts = [s.value for s in family.samples if s.name == f"{DECISIONS}_count"]
            return sum(counts) if counts else None
    return None


def read_exposition(text: str) -> ReplicaReading:
    """Parse once (prometheus_client's parser; ValueError on a malformed body), read both."""
    families = list(text_string_to_metric_families(text))
    return ReplicaReading(decision_count(families), replica_usage(families))


async def read_replicas(client: httpx.AsyncClient, targets: Mapping[str, tuple[str, int]],
                        config: ScraperConfig) -> dict[str, ReplicaReading | None]:
    """Every target's reading (None: unreadable), concurrently, each within the scrape deadline and body cap."""
    async def one(target: tuple[str, int]) -> ReplicaReading | None:
        try:
            text = await fetch_metrics(client, MetricsTarget(*target), config, SAMPLES)
            return await asyncio.to_thread(read_exposition, text)
        except (ScrapeError, ValueError) as exc:
            log.debug("ext_proc replica metrics unreadable", extra={"target": target, "error": str(exc)})
            return None

    nodes = list(targets)
    readings = await asyncio.gather(*(one(targets[node]) for node in nodes))
    return dict(zip(nodes, readings))


class ReplicaSink(Protocol):
    """What the watch reads and drives (the controller)."""

    def ext_proc_targets(self) -> Mapping[str, tuple[str, int]]: ...

    def set_active_replicas(self, active: frozenset[str]) -> None: ...


async def watch_replicas(sink: ReplicaSink, config: ScraperConfig,
                         usage: Callable[[Mapping[str, ReplicaUsage]], None] | None = None) -> None:
    """Every ``interval_s``: read the replicas' decision counts and hand the active set over, and their usage
    to ``usage`` (node id -> usage, the replicas that reported one) (until cancelled)."""
    activity = ReplicaActivity()
    unreadable: frozenset[str] = frozenset()
    async with Scraper(config).make_client() as client:
        while True:
            targets = sink.ext_proc_targets()
            readings = await read_replicas(client, targets, config) if targets else {}
            counts = {node: None if r is None else r.decisions for node, r in readings.items()}
            if usage is not None:
                usage({node: r.usage for node, r in readings.items() if r is not None and r.usage is not None})
            now_unreadable = frozenset(node for node, count in counts.items() if count is None)
            if now_unreadable - unreadable:  # once per change: its /metrics must listen where its stream comes from
                log.warning("ext_proc replica decision counts unreadable: such a replica is listed only while "
                            "none carries traffic", extra={"replicas": {node: authority(*targets[node]) for node in
                                                                        sorted(now_unreadable - unreadable)}})
            unreadable = now_unreadable
            sink.set_active_replicas(activity.observe(counts))
            await asyncio.sleep(config.interval_s)  # the scrape interval itself, not a synchronisation
