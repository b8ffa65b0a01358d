"""Usage for billing without the wire: a replica's exposition read within its bounds, which observations are
written, and the increases the stores compute from them (SQLite and a real PostgreSQL, tests/postgres.py):
counters reset, a new instance, the same usage ingested twice (two control-plane replicas), retention."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from control_plane.store import COUNTER_COLUMNS, OperatorStore, Store, UsageRow, open_store
from control_plane.usage.ingest import UsageIngest, UsageRecorder, instance_key
from control_plane.usage.readings import MAX_TENANTS, ReplicaUsage, replica_usage
from ext_proc.metrics import ExtProcMetrics

pytest_plugins = ("tests.postgres",)  # the postgres_url fixture

T0 = 1_764_000_000 // 3600 * 3600  # an hour's start


def counters(requests_served: int = 0, tokens_served: int = 0, **others: int) -> tuple[int, ...]:
    values = {"requests_served": requests_served, "tokens_served": tokens_served, **others}
    return tuple(values.get(c, 0) for c in COUNTER_COLUMNS)


def usage_of(text: str) -> ReplicaUsage | None:
    return replica_usage(text_string_to_metric_families(text))


# --- reading a replica's exposition -------------------------------------------------------------------


def test_reads_a_real_ext_proc_exposition() -> None:
    metrics = ExtProcMetrics()
    for tenant, outcome, tokens in [("acme", "served", 10), ("acme", "served", 5), ("acme", "failed", 7),
                                    ("anonymous", "unauthenticated", 0), ("beta", "shed", 3),
                                    ("beta", "rate_limited", 4)]:
        metrics.tenant_usage(tenant, outcome, tokens)
    usage = usage_of(metrics.render().decode())
    assert usage is not None and usage.refused == 0
    assert usage.started_at is not None and usage.started_at > 1e9  # prometheus_client's process collector
    assert usage.tenants == {
        "acme": counters(2, 15, requests_failed=1, tokens_failed=7),
        "anonymous": counters(requests_unauthenticated=1),
        "beta": counters(requests_shed=1, tokens_shed=3, requests_rate_limited=1, tokens_rate_limited=4),
    }


def test_an_exposition_without_usage_counters_gives_none() -> None:
    assert usage_of("# TYPE x counter\nx_total 3\n") is None


def series(tenant: str, outcome: str, value: str, family: str = "requests") -> str:
    return f'inferlb_ext_proc_tenant_{family}_total{{tenant="{tenant}",outcome="{outcome}"}} {value}\n'


def test_a_hostile_body_is_bounded() -> None:
    head = "# TYPE inferlb_ext_proc_tenant_requests_total counter\n"
    bad = [series("Acme", "served", "1"), series("acme\\n", "served", "1"), series("a" * 64, "served", "1"),
           series("ok", "stolen", "1"), series("ok", "served", "NaN"), series("ok", "failed", "-1"),
           series("ok", "shed", "1e300"), series("", "served", "1")]
    many = [series(f"t{i}", "served", "1") for i in range(MAX_TENANTS + 50)]
    usage = usage_of(head + "".join(bad + many + [series("ok", "served", "2")]))
    assert usage is not None
    assert len(usage.tenants) == MAX_TENANTS
    assert "ok" not in usage.tenants  # beyond the cap: the first ones in the body are kept
    assert usage.refused == len(bad) + 50 + 1
    assert all(t.startswith("t") for t in usage.tenants)


# --- what is written --------------------------------------------------------------------------------------


def look(tenants: dict[str, tuple[int, ...]], started_at: float | None = 100.0) -> ReplicaUsage:
    return ReplicaUsage(started_at, tenants)


def test_only_changed_counters_are_written_and_gone_instances_forgotten() -> None:
    recorder = UsageRecorder()
    first = {"r1": look({"a": counters(1), "b": counters(2)})}
    rows = recorder.rows(first, T0 + 5)
    assert [(r.instance, r.tenant, r.minute) for r in rows] == [("r1@100.00", "a", T0), ("r1@100.00", "b", T0)]
    assert recorder.rows(first, T0 + 6) == rows  # not written yet: offered again
    recorder.written(rows, first)
    assert recorder.rows(first, T0 + 70) == []  # unchanged: no row
    moved = {"r1": look({"a": counters(3), "b": counters(2)})}
    assert [(r.tenant, r.minute, r.counters) for r in recorder.rows(moved, T0 + 70)] == [("a", T0 + 60, counters(3))]
    restarted = {"r1": look({"a": counters(1)}, started_at=200.0)}
    rows = recorder.rows(restarted, T0 + 80)
    assert [(r.instance, r.tenant) for r in rows] == [("r1@200.00", "a")]
    recorder.written(rows, restarted)
    assert set(recorder._written) == {("r1@200.00", "a")}  # the old instance's memory is gone


def test_counters_that_went_down_are_written_again_in_the_next_minute(tmp_path: Path) -> None:
    """Without a new process start, a reset shows only as lower counters: the minute's row keeps the larger
    values (GREATEST), so the lower ones go into the next minute's row, where the store sees the reset."""
    async def scenario(store: Store) -> None:
        recorder = UsageRecorder()

        async def look_at(value: int, at: float) -> list[UsageRow]:
            reading = {"r1": look({"a": counters(value)})}
            rows = recorder.rows(reading, at)
            await store.record_usage(rows)
            recorder.written(rows, reading)
            return rows

        assert len(await look_at(4, T0)) == 1
        assert len(await look_at(2, T0 + 10)) == 1  # the reset: this minute's row keeps 4
        assert len(await look_at(3, T0 + 20)) == 1  # still its minute
        assert await look_at(3, T0 + 30) == []
        assert [r.minute for r in await look_at(3, T0 + 60)] == [T0 + 60]  # again, in a row of its own
        assert await look_at(3, T0 + 70) == []
        assert by_bucket(await store.usage_buckets(None, T0, T0 + 3600, 60)) == {("a", 0): 4, ("a", 1): 3}

    store = Store.open(tmp_path)
    try:
        asyncio.run(scenario(store))
    finally:
        store.close()


def test_rows_per_replica_and_minute_are_capped() -> None:
    recorder = UsageRecorder(max_rows_per_replica_minute=3)
    reading = {"r1": look({f"t{i}": counters(1) for i in range(5)}), "r2": look({"x": counters(1)})}
    rows = recorder.rows(reading, T0)
    assert [(r.instance.split("@")[0], r.tenant) for r in rows] == [("r1", "t0"), ("r1", "t1"), ("r1", "t2"),
                                                                    ("r2", "x")]
    recorder.written(rows, reading)
    assert recorder.rows(reading, T0 + 30) == []  # the minute's rows are spent
    assert [r.tenant for r in recorder.rows(reading, T0 + 60)] == ["t3", "t4"]  # the rest, next minute


def test_a_long_node_id_is_kept_as_its_hash() -> None:
    key = instance_key("n" * 500, 1.0)
    assert key.startswith("sha256:") and len(key) < 100
    assert instance_key("node", None) == "node"


# --- the stores ---------------------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.servers, pytest.mark.slow])])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OperatorStore]:
    if request.param == "sqlite":
        opened: OperatorStore = Store.open(tmp_path)
    else:
        opened = open_store(request.getfixturevalue("postgres_url"), tmp_path)
    try:
        yield opened
    finally:
        opened.close()


def row(instance: str, minute: int, requests: int, tokens: int = 0, tenant: str = "acme", **others: int) -> UsageRow:
    return UsageRow(instance, tenant, T0 + minute * 60, counters(requests, tokens, **others))


def by_bucket(buckets: Sequence, column: str = "requests_served") -> dict[tuple[str, int], int]:
    i = COUNTER_COLUMNS.index(column)
    return {(b.tenant, (b.start - T0) // 60): b.counters[i] for b in buckets}


def test_increases_per_minute_with_a_reset_and_a_new_instance(store: OperatorStore) -> None:
    async def scenario() -> None:
        await store.record_usage([row("r1@1", 0, 5, 50), row("r1@1", 1, 8, 80), row("r1@1", 3, 10, 100)])
        await store.record_usage([row("r1@1", 4, 2, 20)])  # went down: a reset, 2 is the increase
        await store.record_usage([row("r1@2", 4, 3, 30), row("r1@2", 5, 4, 40)])  # a new instance: from zero
        buckets = await store.usage_buckets(None, T0, T0 + 3600, 60)
        assert by_bucket(buckets) == {("acme", 0): 5, ("acme", 1): 3, ("acme", 3): 2, ("acme", 4): 2 + 3,
                                      ("acme", 5): 1}
        assert by_bucket(buckets, "tokens_served")[("acme", 4)] == 20 + 30
        # a window that starts after an instance's first row measures from its last row before the window
        assert by_bucket(await store.usage_buckets(None, T0 + 60, T0 + 4 * 60, 60)) == {("acme", 1): 3,
                                                                                        ("acme", 3): 2}
        hourly = await store.usage_buckets(None, T0 + 120, T0 + 3600, 3600)
        assert [(b.start, b.counters[0]) for b in hourly] == [(T0, 2 + 5 + 1)]  # aligned to the hour

    asyncio.run(scenario())


def test_the_same_usage_written_twice_counts_once(store: OperatorStore) -> None:
    """Two control-plane replicas scrape the same ext_proc: each writes what it saw; GREATEST keeps the
    latest cumulative value, and the differences count every request once."""
    async def scenario() -> None:
        a = [row("r1@1", 0, 4), row("r1@1", 1, 9), row("r1@1", 2, 12)]
        b = [row("r1@1", 0, 6), row("r1@1", 1, 9), row("r1@1", 2, 11)]  # b saw minute 0 later, minute 2 earlier
        await store.record_usage(a)
        await store.record_usage(b)
        await store.record_usage(a)  # a retried write
        assert by_bucket(await store.usage_buckets(None, T0, T0 + 3600, 60)) == {("acme", 0): 6, ("acme", 1): 3,
                                                                                 ("acme", 2): 3}

    asyncio.run(scenario())


def test_tenant_filter_and_outcomes(store: OperatorStore) -> None:
    async def scenario() -> None:
        await store.record_usage([row("r1@1", 0, 1, 10, requests_failed=2, requests_shed=3),
                                  row("r1@1", 0, 7, tenant="beta"), row("r2@1", 0, 1, tenant="beta")])
        only = await store.usage_buckets("beta", T0, T0 + 60, 60)
        assert [(b.tenant, b.counters[0]) for b in only] == [("beta", 8)]
        both = await store.usage_buckets(None, T0, T0 + 60, 60)
        acme = next(b for b in both if b.tenant == "acme")
        assert dict(zip(COUNTER_COLUMNS, acme.counters)) == {**dict.fromkeys(COUNTER_COLUMNS, 0), "requests_served": 1,
                                                             "tokens_served": 10, "requests_failed": 2,
                                                             "requests_shed": 3}
        assert await store.usage_buckets("nobody", T0, T0 + 60, 60) == []

    asyncio.run(scenario())


def test_retention_keeps_the_baseline_of_a_live_instance(store: OperatorStore) -> None:
    async def scenario() -> None:
        await store.record_usage([row("live@1", 0, 5), row("live@1", 1, 7), row("live@1", 10, 9),
                                  row("gone@1", 0, 3), row("gone@1", 2, 4)])
        assert await store.prune_usage(T0 + 5 * 60) == 3  # live's minute 0, gone's two rows; live's minute 1 kept
        assert by_bucket(await store.usage_buckets(None, T0, T0 + 3600, 60)) == {("acme", 1): 0, ("acme", 10): 2}
        assert await store.prune_usage(T0 + 5 * 60) == 0  # again: nothing more

    asyncio.run(scenario())


def test_ingest_writes_each_look_and_a_store_failure_loses_nothing(tmp_path: Path) -> None:
    class Failing:
        def __init__(self, inner: Store) -> None:
            self.inner, self.fail = inner, True

        async def record_usage(self, rows: Sequence[UsageRow]) -> None:
            if self.fail:
                from control_plane.store import StoreError
                raise StoreError("down")
            await self.inner.record_usage(rows)

    async def scenario(store: Store) -> None:
        now = [T0 + 1.0]
        failing = Failing(store)
        ingest = UsageIngest(failing, 90, clock=lambda: now[0])  # type: ignore[arg-type]
        ingest.offer({"r1": look({"a": counters(4)})})
        assert await ingest.write_latest() == 0  # the store is down
        failing.fail = False
        now[0] = T0 + 61.0
        ingest.offer({"r1": look({"a": counters(6)})})
        assert await ingest.write_latest() == 1
        assert await ingest.write_latest() == 0  # nothing new offered
        assert by_bucket(await store.usage_buckets(None, T0, T0 + 3600, 60)) == {("a", 1): 6}

    store = Store.open(tmp_path)
    try:
        asyncio.run(scenario(store))
    finally:
        store.close()


def test_refused_series_are_logged_once_per_change(caplog: pytest.LogCaptureFixture) -> None:
    recorder = UsageRecorder()
    bad = {"r1": ReplicaUsage(1.0, {"a": counters(1)}, refused=3)}
    with caplog.at_level("WARNING", logger="inferlb.control_plane.usage"):
        for second in range(3):
            recorder.rows(bad, T0 + second)
        recorder.rows({"r1": ReplicaUsage(1.0, {"a": counters(1)}, refused=4)}, T0 + 4)
    assert [r.refused for r in caplog.records] == [3, 4]  # type: ignore[attr-defined]
