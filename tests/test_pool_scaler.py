"""The pool scaler's decisions (pure, on an injected clock) and its procedures against recording fakes:
bounds, cooldowns, registration only after readiness, drain -> ACK -> idle -> deregister -> gone -> SIGTERM."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Coroutine

import pytest

from control_plane.autoscale import Autoscaler, AutoscaleSettings
from control_plane.metrics import ControlPlaneMetrics
from control_plane.model import Endpoint, FleetState, Telemetry
from inferlb.pool_scaler import (
    AdminClient,
    PoolScaler,
    ScalerSettings,
    admin_token,
    busy,
    decide,
    desired_replicas,
    drain_seen,
    parse_bounds,
)

SETTINGS = ScalerSettings(min_workers=1, max_workers=4, scale_up_cooldown_s=5.0, scale_down_cooldown_s=30.0)


@pytest.mark.parametrize(("text", "bounds"), [("1..4", (1, 4)), (" 2 .. 2 ", (2, 2))])
def test_bounds_parse(text: str, bounds: tuple[int, int]) -> None:
    assert parse_bounds(text) == bounds


@pytest.mark.parametrize(("text", "message"), [("4", "MIN..MAX"), ("1-4", "MIN..MAX"), ("0..3", "1 <= MIN"),
                                                ("3..2", "1 <= MIN <= MAX")])
def test_bad_bounds_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_bounds(text)


def test_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="Kubernetes name"):
        ScalerSettings(pool="Bad_Pool")
    with pytest.raises(ValueError, match="scale_down_cooldown_s"):
        ScalerSettings(scale_down_cooldown_s=-1)


def test_the_signal_is_clamped_to_the_bounds() -> None:
    assert decide(9, 2, 100.0, None, None, SETTINGS).count == 2  # up to MAX 4, not 9
    below = decide(0, 3, 100.0, None, None, SETTINGS)
    assert (below.action, below.count, below.target) == ("down", 2, 1)  # never below MIN
    assert decide(None, 2, 100.0, None, None, SETTINGS).action == "hold"  # no signal: nothing changes
    assert decide(None, 0, 100.0, None, None, SETTINGS).count == 1  # ...but MIN always runs


def test_cooldowns_space_out_changes() -> None:
    # a scale-up at t=100: the next scale-up waits 5 s, a scale-down 30 s
    assert decide(3, 2, 104.0, 100.0, 100.0, SETTINGS).reason == "scale-up cooldown"
    assert decide(3, 2, 105.0, 100.0, 100.0, SETTINGS).action == "up"
    assert decide(1, 2, 129.0, 100.0, 100.0, SETTINGS).reason == "scale-down cooldown"
    assert decide(1, 2, 130.0, 100.0, 100.0, SETTINGS).action == "down"
    # a scale-down at t=100 holds the next scale-down, not a scale-up
    assert decide(1, 3, 110.0, 50.0, 100.0, SETTINGS).reason == "scale-down cooldown"
    assert decide(4, 3, 110.0, 50.0, 100.0, SETTINGS).action == "up"
    assert decide(2, 2, 110.0, 50.0, 100.0, SETTINGS).reason == "at target"


def test_signal_and_busy_are_read_with_the_prometheus_parser() -> None:
    endpoints = (Endpoint("10.0.0.1", 1, telemetry=Telemetry(observed_at=10.0, inflight=5)),
                 Endpoint("10.0.0.1", 2, pool="batch", telemetry=Telemetry(observed_at=10.0, inflight=1)))
    autoscaler = Autoscaler(AutoscaleSettings(target_ongoing_requests=1.0))
    metrics = ControlPlaneMetrics(lambda: FleetState(endpoints=endpoints))
    metrics.register_autoscale(lambda: autoscaler.signals)
    assert desired_replicas(metrics.exposition().decode(), "default") is None  # nothing computed yet
    autoscaler.observe(endpoints, now=10.0, stale_after_s=2.0)
    text = metrics.exposition().decode()
    assert desired_replicas(text, "default") == 5
    assert desired_replicas(text, "batch") == 1
    assert desired_replicas(text, "other") is None
    worker = ("# TYPE inferlb_worker_inflight_requests gauge\ninferlb_worker_inflight_requests 2.0\n"
              "# TYPE inferlb_worker_queue_depth gauge\ninferlb_worker_queue_depth 3.0\n"
              "# TYPE inferlb_worker_ready gauge\ninferlb_worker_ready 1.0\n")
    assert busy(worker) == 5.0


def test_drain_is_seen_once_every_stream_acked_a_newer_version() -> None:
    before = {1: ("v1", "v1"), 2: ("e1", "e1")}
    assert not drain_seen(before, {1: ("v1", "v2"), 2: ("e1", "e2")})  # pushed, not ACKed
    assert not drain_seen(before, {1: ("v1", "v1"), 2: ("e2", "e2")})  # stream 1 has no newer version yet
    assert drain_seen(before, {1: ("v2", "v2"), 2: ("e2", "e2")})
    assert drain_seen(before, {1: ("v2", "v2"), 3: ("v2", "v2")})  # a stream connected since: whole state


def test_the_admin_token_comes_from_the_environment_or_the_data_dir(tmp_path: Path) -> None:
    assert admin_token(tmp_path, {"INFERLB_ADMIN_TOKEN": "t1"}) == "t1"
    (tmp_path / "admin-token").write_text("from-file\n")
    assert admin_token(tmp_path, {}) == "from-file"
    with pytest.raises(RuntimeError, match="INFERLB_ADMIN_TOKEN"):
        admin_token(tmp_path / "missing", {})


# --- the procedures, against fakes that record the order of events ------------------------------


@dataclass
class World:
    """The control plane and the processes as the fakes see them; ``events`` in the order they happened."""

    desired: int | None = 1
    events: list[str] = field(default_factory=list)
    endpoints: set[str] = field(default_factory=set)
    draining: set[str] = field(default_factory=set)
    eds: str = "v0"  # one xDS stream; a drain publishes a new version, ACKed a few polls later
    acked: str = "v0"
    polls_until_ack: int = 0
    busy: dict[int, float] = field(default_factory=dict)  # port -> in flight + queued
    ready: dict[int, asyncio.Event] = field(default_factory=dict)
    alive: dict[int, bool] = field(default_factory=dict)


class FakeAdmin(AdminClient):
    def __init__(self, world: World) -> None:
        self.world = world

    async def desired_replicas(self, pool: str) -> int | None:
        return self.world.desired

    async def register(self, address: str, port: int) -> None:
        self.world.events.append(f"register {port}")
        self.world.endpoints.add(f"{address}:{port}")

    async def drain(self, endpoint_id: str) -> None:
        w = self.world
        w.events.append(f"drain {endpoint_id}")
        w.draining.add(endpoint_id)
        w.eds, w.polls_until_ack = "v1", 3

    async def deregister(self, endpoint_id: str) -> None:
        w = self.world
        if endpoint_id in w.draining:
            assert w.acked == w.eds, "deregistered before the drain was ACKed"
        w.events.append(f"deregister {endpoint_id}")
        w.endpoints.discard(endpoint_id)

    async def exists(self, endpoint_id: str) -> bool:
        return endpoint_id in self.world.endpoints

    async def eds_versions(self) -> dict[int, tuple[str, str]]:
        w = self.world
        if w.polls_until_ack:
            w.polls_until_ack -= 1
            if not w.polls_until_ack:
                w.acked = w.eds
                w.events.append("acked")
        return {1: (w.acked, w.eds)}


class FakeWorkers:
    def __init__(self, world: World, auto_ready: bool = True) -> None:
        self.world = world
        self.auto_ready = auto_ready

    async def start(self, port: int) -> object:
        await asyncio.sleep(0)  # spawning suspends, as a real one does: concurrent adds interleave here
        self.world.events.append(f"start {port}")
        self.world.ready[port] = asyncio.Event()
        if self.auto_ready:
            self.world.ready[port].set()
        self.world.alive[port] = True
        return port

    async def wait_ready(self, handle: object, timeout_s: float) -> None:
        assert isinstance(handle, int)
        await self.world.ready[handle].wait()
        self.world.events.append(f"ready {handle}")

    async def busy(self, handle: object) -> float:
        assert isinstance(handle, int)
        value = self.world.busy.get(handle, 0.0)
        if value:  # the in-flight work finishes over a few polls
            self.world.busy[handle] = value - 1
        return value

    def alive(self, handle: object) -> bool:
        assert isinstance(handle, int)
        return self.world.alive[handle]

    async def stop(self, handle: object) -> None:
        assert isinstance(handle, int)
        self.world.events.append(f"sigterm {handle}")
        self.world.alive[handle] = False


def run(coroutine: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coroutine, timeout=60))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _scaler(world: World, clock: Clock, settings: ScalerSettings = SETTINGS, auto_ready: bool = True) -> PoolScaler:
    return PoolScaler(settings, FakeAdmin(world), FakeWorkers(world, auto_ready), fixed=1, first_port=40101,
                      clock=clock)


def test_scale_up_registers_a_worker_only_after_it_is_ready() -> None:
    run(_scale_up_registers_a_worker_only_after_it_is_ready())


async def _scale_up_registers_a_worker_only_after_it_is_ready() -> None:
    world, clock = World(desired=2), Clock()
    scaler = _scaler(world, clock, auto_ready=False)
    task = asyncio.create_task(scaler.round())
    while not world.ready:
        await asyncio.sleep(0)
    port = next(iter(world.ready))
    for _ in range(20):  # the round is parked on the readiness wait: nothing registered meanwhile
        await asyncio.sleep(0)
    assert world.events == [f"start {port}"] and not task.done()
    world.ready[port].set()
    decision = await task
    assert (decision.action, decision.count) == ("up", 1)
    assert world.events == [f"start {port}", f"ready {port}", f"register {port}"]
    assert scaler.size == 2 and scaler.last_up_at == clock.now


def test_scale_down_drains_waits_for_ack_and_idle_then_deregisters_then_stops() -> None:
    run(_scale_down_drains_waits_for_ack_and_idle_then_deregisters_then_stops())


async def _scale_down_drains_waits_for_ack_and_idle_then_deregisters_then_stops() -> None:
    world, clock = World(desired=3), Clock()
    scaler = _scaler(world, clock)
    await scaler.round()
    assert scaler.size == 3
    first, newest = (m.port for m in scaler.members)
    world.events.clear()
    world.desired, world.busy[newest] = 2, 2.0  # two requests still in flight on the newest worker
    clock.now += 29.0
    assert (await scaler.round()).reason == "scale-down cooldown"
    clock.now += 1.0
    decision = await scaler.round()
    assert (decision.action, decision.count) == ("down", 1)
    newest_id = f"127.0.0.1:{newest}"
    assert world.events == [f"drain {newest_id}", "acked", f"deregister {newest_id}", f"sigterm {newest}"]
    assert world.busy[newest] == 0  # it was idle before it was deregistered
    assert [m.port for m in scaler.members] == [first] and scaler.size == 2


def test_never_below_min_the_fixed_workers_stay_and_a_dead_member_is_replaced() -> None:
    run(_never_below_min_the_fixed_workers_stay_and_a_dead_member_is_replaced())


async def _never_below_min_the_fixed_workers_stay_and_a_dead_member_is_replaced() -> None:
    world, clock = World(desired=2), Clock()
    scaler = _scaler(world, clock, ScalerSettings(min_workers=1, max_workers=2, scale_up_cooldown_s=0))
    await scaler.round()
    [member] = scaler.members
    world.alive[member.port] = False  # crashed
    world.events.clear()
    decision = await scaler.round()
    assert decision.action == "up" and scaler.size == 2
    # reaped first (deregistered, its process collected), then a new one started in its place
    assert world.events[:3] == [f"deregister {member.id}", f"sigterm {member.port}", f"start {member.port}"]
    world.desired = 0
    clock.now += 1000
    await scaler.round()
    assert scaler.size == 1 and scaler.members == []  # down to MIN: the fixed worker
    clock.now += 1000
    assert (await scaler.round()).reason == "at target"


def test_workers_added_together_get_ports_of_their_own() -> None:
    run(_workers_added_together_get_ports_of_their_own())


async def _workers_added_together_get_ports_of_their_own() -> None:
    world, clock = World(desired=4), Clock()
    scaler = _scaler(world, clock)
    decision = await scaler.round()
    assert (decision.action, decision.count, scaler.size) == ("up", 3, 4)
    ports = [m.port for m in scaler.members]
    assert len(set(ports)) == 3
    assert sorted(e for e in world.events if e.startswith("register")) == sorted(f"register {p}" for p in ports)
