"""DNS discovery: reconciliation (pure), the provider against the real resolver, and the real control
plane finding a simulated worker by name and scraping it."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from control_plane.discovery.dns import DnsProvider, resolve_addresses
from control_plane.discovery.model import (
    DiscoveredEndpoint,
    DiscoveryFailure,
    DiscoverySnapshot,
    Readiness,
)
from control_plane.discovery.reconcile import Override, SourceMemory, reconcile
from control_plane.discovery.runner import run_provider
from control_plane.model import Endpoint, Health

from .conftest import free_port
from .stack import http, running_control_plane, running_sim_workers, sample, wait_for

READY, NOT_READY, DRAINING = Readiness.READY, Readiness.NOT_READY, Readiness.DRAINING


def _d(port: int, readiness: Readiness = READY, address: str = "10.0.0.1") -> DiscoveredEndpoint:
    return DiscoveredEndpoint(address, port, readiness)


def _by_id(endpoints: tuple[Endpoint, ...]) -> dict[str, Endpoint]:
    return {e.id: e for e in endpoints}


# --- reconcile (pure) ---------------------------------------------------------------------------------


def test_reconcile_adds_removes_and_leaves_other_sources_alone() -> None:
    static = Endpoint("10.0.0.1", 1, source="static")
    api = Endpoint("10.0.0.1", 2, source="api")
    result = reconcile((static, api), "dns", (_d(2), _d(3), _d(4)), SourceMemory())
    got = _by_id(result.endpoints)
    assert got["10.0.0.1:1"] is static and got["10.0.0.1:2"] is api  # the API's own listing wins
    assert got["10.0.0.1:3"].source == got["10.0.0.1:4"].source == "dns"
    assert got["10.0.0.1:3"].health is Health.UNKNOWN
    assert result.added == ("10.0.0.1:3", "10.0.0.1:4") and result.conflicts == ("10.0.0.1:2",)

    again = reconcile(result.endpoints, "dns", (_d(4),), result.memory)
    assert set(_by_id(again.endpoints)) == {"10.0.0.1:1", "10.0.0.1:2", "10.0.0.1:4"}
    assert again.removed == ("10.0.0.1:3",)
    # the same snapshot again changes nothing (no new xDS version)
    assert reconcile(again.endpoints, "dns", (_d(4),), again.memory).endpoints == again.endpoints
    # an empty snapshot (the source really lists nothing) removes only its own endpoints
    assert set(_by_id(reconcile(again.endpoints, "dns", (), again.memory).endpoints)) == {"10.0.0.1:1",
                                                                                         "10.0.0.1:2"}


def test_reconcile_keeps_scraped_state_of_endpoints_that_stay() -> None:
    scraped = Endpoint("10.0.0.1", 3, source="dns", health=Health.HEALTHY, computed_weight=420)
    result = reconcile((scraped,), "dns", (_d(3),), SourceMemory())
    assert result.endpoints == (scraped,) and not result.changed


def test_not_ready_is_unhealthy_until_ready_again() -> None:
    e = Endpoint("10.0.0.1", 3, source="kubernetes", health=Health.HEALTHY)
    down = reconcile((e,), "kubernetes", (_d(3, NOT_READY),), SourceMemory())
    assert down.endpoints[0].health is Health.UNHEALTHY and not down.endpoints[0].routable
    assert down.memory.not_ready == {"10.0.0.1:3"} and down.changed == ("10.0.0.1:3",)
    up = reconcile(down.endpoints, "kubernetes", (_d(3, READY),), down.memory)
    assert up.endpoints[0].health is Health.UNKNOWN and up.endpoints[0].routable  # the next scrape decides
    assert up.memory.not_ready == frozenset()
    # a new endpoint that is not ready yet is listed, unhealthy
    fresh = reconcile((), "kubernetes", (_d(5, NOT_READY),), SourceMemory())
    assert fresh.endpoints[0].health is Health.UNHEALTHY


def test_terminating_drains_and_the_operators_own_drain_survives() -> None:
    e = Endpoint("10.0.0.1", 3, source="kubernetes")
    draining = reconcile((e,), "kubernetes", (_d(3, DRAINING),), SourceMemory())
    assert draining.endpoints[0].draining and draining.endpoints[0].health is Health.UNKNOWN
    back = reconcile(draining.endpoints, "kubernetes", (_d(3, READY),), draining.memory)
    assert not back.endpoints[0].draining  # discovery's drain, not the operator's
    operator = Endpoint("10.0.0.1", 3, source="kubernetes", draining=True)
    cycle = reconcile((operator,), "kubernetes", (_d(3, DRAINING),), SourceMemory())
    assert reconcile(cycle.endpoints, "kubernetes", (_d(3),), cycle.memory).endpoints[0].draining


def test_operator_overrides_come_back_with_the_endpoint() -> None:
    pinned = Endpoint("10.0.0.1", 3, source="dns", pinned_weight=7, draining=True)
    gone = reconcile((pinned,), "dns", (), SourceMemory())
    assert gone.endpoints == () and gone.memory.overrides == {"10.0.0.1:3": Override(7, True)}
    back = reconcile(gone.endpoints, "dns", (_d(3),), gone.memory)
    assert back.endpoints[0].pinned_weight == 7 and back.endpoints[0].draining
    # overrides from the store (seeded at startup) apply when the endpoint is first discovered
    seeded = SourceMemory().seed({"10.0.0.1:9": Override(pinned_weight=3)})
    assert reconcile((), "dns", (_d(9),), seeded).endpoints[0].pinned_weight == 3


# --- the provider and the real resolver ------------------------------------------------------------------


def test_resolver_finds_localhost_and_refuses_an_invalid_name() -> None:
    expected = {info[4][0] for info in socket.getaddrinfo("localhost", 80, type=socket.SOCK_STREAM)}
    assert set(asyncio.run(resolve_addresses("localhost", 80))) == expected
    assert "127.0.0.1" in expected or "::1" in expected
    with pytest.raises(OSError):
        asyncio.run(resolve_addresses("no-such-worker.invalid", 80))  # RFC 6761: never resolves


class FakeRenamingResolver:
    """A fake resolver: the real one, on a name a test can repoint (``names``) at run time.

    It exists because a real name cannot be made to stop resolving from a test.
    """

    def __init__(self, names: dict[str, str]) -> None:
        self.names = names

    async def __call__(self, host: str, port: int) -> tuple[str, ...]:
        return await resolve_addresses(self.names[host], port)


def test_a_failing_name_keeps_its_last_addresses_and_reports_the_error() -> None:
    resolver = FakeRenamingResolver({"worker": "localhost", "other": "localhost"})
    provider = DnsProvider([("worker", 8101), ("other", 8102)], interval_s=1, resolver=resolver)

    async def rounds() -> list:
        last: dict = {}
        first, failed_first = await provider.resolve_round(last)
        resolver.names["worker"] = "no-such-worker.invalid"
        second, failed_second = await provider.resolve_round(last)
        return [(first, failed_first), (second, failed_second)]

    (first, failed_first), (second, failed_second) = asyncio.run(rounds())
    assert not failed_first and isinstance(first, DiscoverySnapshot)
    ids = {e.id for e in first.endpoints}
    assert any(i.endswith(":8101") for i in ids) and any(i.endswith(":8102") for i in ids)
    assert failed_second and isinstance(second, DiscoveryFailure)
    assert "worker" in second.error and "other" not in second.error
    assert second.partial is not None and {e.id for e in second.partial.endpoints} == ids


def test_runner_applies_snapshots_and_only_partials_on_failure() -> None:
    class ScriptedProvider:
        """A fake provider replaying a fixed list of updates (the runner's logic, without a resolver)."""

        source = "dns"

        def __init__(self, updates: list) -> None:
            self._updates = updates

        async def updates(self):  # type: ignore[no-untyped-def]
            for update in self._updates:
                yield update

    class Observer:
        def __init__(self) -> None:
            self.synced: list[int] = []
            self.failed = 0

        def discovery_synced(self, source: str, endpoints: int, at: float) -> None:
            self.synced.append(endpoints)

        def discovery_failed(self, source: str) -> None:
            self.failed += 1

    one = DiscoverySnapshot("dns", (_d(1),))
    applied: list[DiscoverySnapshot] = []
    observer = Observer()
    asyncio.run(run_provider(ScriptedProvider([one, DiscoveryFailure("dns", "boom"),
                                               DiscoveryFailure("dns", "boom", partial=one)]),
                             applied.append, observer))
    assert applied == [one, one] and observer.synced == [1] and observer.failed == 2


# --- the real control plane ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.servers
def test_control_plane_discovers_a_worker_by_name(tmp_path: Path) -> None:
    with running_sim_workers(tmp_path, 1) as [worker]:
        unresolvable = f"no-such-worker.invalid:{free_port()}"
        env = {"INFERLB_CP_DISCOVERY_DNS": f"localhost:{worker.port},{unresolvable}",
               "INFERLB_CP_DISCOVERY_INTERVAL_S": "0.2"}
        with running_control_plane(tmp_path, endpoints=[], env=env) as cp, http() as client:
            def discovered() -> dict | None:
                listed = client.get(f"{cp.admin_url}/v1/endpoints").json()["endpoints"]
                found = {e["id"]: e for e in listed}
                e = found.get(worker.id)
                return found if e is not None and e["health"] == "healthy" else None

            found = wait_for(discovered, 30, "the worker, discovered by name and scraped healthy", [cp.proc])
            assert found[worker.id]["source"] == "dns" and found[worker.id]["routable"]
            metrics = cp.metrics()
            # the unresolvable name fails every round: counted, while the good name keeps syncing
            assert (sample(metrics, "inferlb_cp_discovery_errors_total", source="dns") or 0) >= 1
            assert sample(metrics, "inferlb_cp_discovery_last_success_timestamp_seconds", source="dns") is None
            # the operator cannot deregister what DNS owns, only drain it
            token = cp.admin_token()
            refused = client.delete(f"{cp.admin_url}/v1/endpoints/{worker.id}",
                                    headers={"Authorization": f"Bearer {token}"})
            assert refused.status_code == 409
            assert refused.json()["error"]["detail"]["source"] == "dns"


# --- only IP literals are published ------------------------------------------------------------------


def test_a_resolver_answer_that_is_not_a_unicast_ip_is_skipped(caplog: pytest.LogCaptureFixture) -> None:
    """Whatever a resolver returns (0.0.0.0 from /etc/hosts, multicast, a plug-in's garbage), only unicast IP
    literals reach EDS; the name's other addresses and the other names still do."""
    answers = {"workers": ("10.0.0.7", "0.0.0.0", "not-an-ip", "0:0:0:0:0:0:0:1"), "other": ("239.1.2.3",)}

    async def resolver(host: str, port: int) -> tuple[str, ...]:
        return answers[host]

    provider = DnsProvider([("workers", 8101), ("other", 8101)], resolver=resolver)
    last: dict[tuple[str, int], tuple[str, ...]] = {}
    with caplog.at_level("WARNING", logger="control_plane.discovery.model"):
        update, failed = asyncio.run(provider.resolve_round(last))
        again, _ = asyncio.run(provider.resolve_round(last))
    assert not failed and isinstance(update, DiscoverySnapshot) and update == again
    assert [e.id for e in update.endpoints] == ["10.0.0.7:8101", "::1:8101"]  # canonical, as the admin API stores
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1  # logged when the refused set changes, not every round
    assert refusals[0].refused == ["0.0.0.0", "239.1.2.3", "not-an-ip"]  # type: ignore[attr-defined]


def test_a_discovered_endpoint_is_an_ip_literal_with_a_port() -> None:
    assert DiscoveredEndpoint("[fd00:0::1]", 80).id == "fd00::1:80"
    for address, port in (("worker-0", 80), ("", 80), ("10.0.0.1", 0), ("10.0.0.1", 70000)):
        with pytest.raises(ValueError):
            DiscoveredEndpoint(address, port)
