"""The DNS provider: every A/AAAA record of ``host`` is an endpoint ``ip:port``.

For Docker Compose (``docker compose up --scale worker=4``: the service name
resolves to every replica) and any DNS-based service discovery. Polls every
``interval_s`` through the system resolver (``getaddrinfo`` in the loop's
thread pool, so it honours /etc/hosts and nsswitch like everything else on
the host). A name that fails to resolve keeps its last known addresses and
is retried with backoff; the other names still update. Only unicast IP
literals are published (as the admin API takes them); anything else a
resolver returns is skipped and logged.
"""

from __future__ import annotations

import asyncio
import socket
from typing import AsyncIterator, Awaitable, Callable, Sequence

from inferlb_runtime.backoff import Backoff

from .model import (
    DiscoveredEndpoint,
    DiscoveryFailure,
    DiscoverySnapshot,
    DiscoveryUpdate,
    refused_note,
)

Resolver = Callable[[str, int], Awaitable[tuple[str, ...]]]


async def resolve_addresses(host: str, port: int) -> tuple[str, ...]:
    """The distinct IPv4/IPv6 addresses of ``host``, sorted; ``OSError`` (``socket.gaierror``) when none."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = {str(info[4][0]).split("%", 1)[0] for info in infos
                 if info[0] in (socket.AF_INET, socket.AF_INET6)}
    if not addresses:
        raise OSError(f"{host} has no A or AAAA records")
    return tuple(sorted(addresses))


class DnsProvider:
    source = "dns"

    def __init__(self, targets: Sequence[tuple[str, int]], interval_s: float = 5.0,
                 resolver: Resolver = resolve_addresses, backoff: Backoff | None = None) -> None:
        if not targets:
            raise ValueError("DnsProvider needs at least one host:port")
        self.targets = tuple(targets)
        self.interval_s = interval_s
        self.resolver = resolver
        self.backoff = backoff or Backoff(initial_s=min(0.5, interval_s), max_s=interval_s)
        self._refused: frozenset[str] = frozenset()  # addresses skipped last round (logged on change)

    async def resolve_round(self, last: dict[tuple[str, int], tuple[str, ...]]) -> tuple[DiscoveryUpdate, bool]:
        """One round: the update to report and whether it failed; ``last`` is updated in place."""
        errors = []
        for host, port in self.targets:
            try:
                last[(host, port)] = await self.resolver(host, port)
            except OSError as exc:
                errors.append(f"{host}: {exc}")
        found: set[DiscoveredEndpoint] = set()
        refused: set[str] = set()
        for (_, port), addresses in last.items():
            for address in addresses:
                try:
                    found.add(DiscoveredEndpoint(address, port))
                except ValueError:  # 0.0.0.0 in /etc/hosts, multicast, a custom resolver's garbage
                    refused.add(address[:256])
        self._refused = refused_note("dns", frozenset(refused), self._refused)
        snapshot = DiscoverySnapshot("dns", tuple(sorted(found, key=lambda e: e.id)))
        if errors:
            return DiscoveryFailure("dns", "; ".join(errors), partial=snapshot), True
        return snapshot, False

    async def updates(self) -> AsyncIterator[DiscoveryUpdate]:
        last: dict[tuple[str, int], tuple[str, ...]] = {}
        failures = 0
        while True:
            update, failed = await self.resolve_round(last)
            yield update
            failures = failures + 1 if failed else 0
            await asyncio.sleep(self.backoff.delay(failures) if failed else self.interval_s)
