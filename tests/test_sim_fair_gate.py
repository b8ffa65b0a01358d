"""The simulator's model of ext_proc's fair admission gate (``fair_queue_depth``): with room for one request
per worker on equal workers, inferlb_ext_proc becomes the central-queue oracle; requests it holds all
complete, counted; no depth, no gate; a negative depth is refused, by the model and by the CLI."""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from inferlb.bench.load.scenario import Fleet, Scenario, WorkerSpec
from inferlb.sim.engine import Clock
from inferlb.sim.ext_proc_model import ExtProcBalancer
from inferlb.sim.fleet import SimFleet
from inferlb.sim.oracles import ORACLE_CENTRAL_QUEUE
from inferlb.sim.runner import SimOptions, simulate


def equal_pair(**changes) -> Scenario:  # type: ignore[no-untyped-def]
    # no constant overheads: latencies are the queues' alone, comparable with the oracle's
    base = Scenario(name="pair", duration_s=20.0, warmup_s=2.0, slowdown=None, loads=(0.9,),
                    fleet=Fleet(workers=(WorkerSpec(1.0), WorkerSpec(1.0))), hop_overhead_s=0.0,
                    ext_proc_overhead_s=0.0)
    return replace(base, **changes)


def test_room_for_one_request_per_equal_worker_is_the_central_queue() -> None:
    scenario = equal_pair()
    gated, gated_raw = simulate(scenario, "inferlb_ext_proc", 0.9, options=SimOptions(fair_queue_depth=1))
    _, oracle_raw = simulate(scenario, ORACLE_CENTRAL_QUEUE, 0.9)
    _, open_raw = simulate(scenario, "inferlb_ext_proc", 0.9)
    assert gated.extra["ext_proc_held"] > 100 and gated.completed == gated.sent
    # Held at the gate until a worker frees, then routed to the free one: one FIFO queue feeding both.
    same = np.isclose(gated_raw["latency"], oracle_raw["latency"], rtol=0, atol=1e-9)
    assert same.mean() > 0.99
    # Without the gate ext_proc commits each request to a worker at once: the latencies are not the queue's.
    assert np.isclose(open_raw["latency"], oracle_raw["latency"], rtol=0, atol=1e-9).mean() < 0.9
    assert "ext_proc_held" not in simulate(scenario, "inferlb_ext_proc", 0.9)[0].extra


def test_every_held_request_completes_and_a_shallower_gate_holds_more() -> None:
    scenario = equal_pair(fleet=Fleet(workers=(WorkerSpec(1.0), WorkerSpec(0.5), WorkerSpec(0.25))))
    shallow, _ = simulate(scenario, "inferlb_ext_proc", 0.8, options=SimOptions(fair_queue_depth=1))
    deep, _ = simulate(scenario, "inferlb_ext_proc", 0.8, options=SimOptions(fair_queue_depth=8))
    assert shallow.completed == shallow.sent and deep.completed == deep.sent
    assert shallow.extra["ext_proc_held"] > deep.extra["ext_proc_held"]


@pytest.mark.subprocess
def test_a_negative_depth_is_refused() -> None:
    fleet = SimFleet(Fleet(workers=(WorkerSpec(1.0),)))
    with pytest.raises(ValueError, match="fair_queue_depth must be >= 0"):
        ExtProcBalancer(fleet, random.Random(1), ("127.0.0.1:8101",), 1, Clock(), fair_queue_depth=-1)
    out = subprocess.run([sys.executable, "-m", "inferlb.cli", "sim", "--fair-queue-depth", "-1", "--no-progress"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--fair-queue-depth" in out.stderr
