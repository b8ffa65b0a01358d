"""What a discovery provider reports: the endpoints of one source and their readiness."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

DiscoverySource = Literal["dns", "kubernetes"]


class Readiness(enum.Enum):
    """What discovery says about an endpoint; scraping still decides health on top of it."""

    READY = "ready"
    NOT_READY = "not_ready"  # listed, but must get no traffic (Kubernetes: ready=false)
    DRAINING = "draining"  # terminating but still serving: finish in-flight work, take no new


@dataclass(frozen=True, order=True)
class DiscoveredEndpoint:
    address: str
    port: int
    readiness: Readiness = Readiness.READY

    @property
    def id(self) -> str:
        return f"{self.address}:{self.port}"


@dataclass(frozen=True)
class DiscoverySnapshot:
    """The full set a provider sees now (not a delta): ``endpoints`` has one entry per id."""

    source: DiscoverySource
    endpoints: tuple[DiscoveredEndpoint, ...]


@dataclass(frozen=True)
class DiscoveryFailure:
    """A round that failed (resolver error, API down): the last known set stays.

    ``partial``: what the round could still vouch for, the failed parts filled
    with their last known endpoints (DNS: the names that did resolve).
    """

    source: DiscoverySource
    error: str
    partial: DiscoverySnapshot | None = None


DiscoveryUpdate = DiscoverySnapshot | DiscoveryFailure
