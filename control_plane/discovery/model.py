"""What a discovery provider reports: the endpoints of one source and their readiness."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Literal

from inferlb_runtime.hostport import endpoint_id

from ..model import normalise_address

log = logging.getLogger(__name__)

DiscoverySource = Literal["dns", "kubernetes"]


class Readiness(enum.Enum):
    """What discovery says about an endpoint; scraping still decides health on top of it."""

    READY = "ready"
    NOT_READY = "not_ready"  # listed, but must get no traffic (Kubernetes: ready=false)
    DRAINING = "draining"  # terminating but still serving: finish in-flight work, take no new


@dataclass(frozen=True, order=True)
class DiscoveredEndpoint:
    """One address a provider found. Only an IP literal (canonical form) and a port in 1..65535 make one:
    ``ValueError`` otherwise, so a provider skips what it cannot vouch for instead of publishing it."""

    address: str
    port: int
    readiness: Readiness = Readiness.READY

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ValueError(f"port {self.port!r} is not in 1..65535")
        object.__setattr__(self, "address", normalise_address(str(self.address)))

    @property
    def id(self) -> str:
        return endpoint_id(self.address, self.port)


def refused_note(source: str, refused: frozenset[str], before: frozenset[str]) -> frozenset[str]:
    """Log the addresses a provider skipped, once per change of that set (not on every poll or event)."""
    if refused and refused != before:
        log.warning("discovered addresses refused (IP literals only); the others are published",
                    extra={"source": source, "refused": sorted(refused)})
    return refused


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
