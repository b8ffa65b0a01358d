"""A component that never becomes ready says why in the error itself (its log's end; for Envoy, where its
start-up stands): CI keeps the output, not the log files.

Real processes through ``ProcessGroup``: a Python child that prints and exits, and the real Envoy on an
xDS port where nothing listens (it stays INITIALIZING for its 15 s initial fetch timeout, longer than
the readiness deadline here).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from inferlb.bench.processes import ProcessGroup, free_ports
from inferlb.bench.routing.runner import find_envoy
from inferlb.bootstrap import envoy_startup_stats_url, render_bootstrap
from inferlb.supervisor import Component

pytestmark = [pytest.mark.slow, pytest.mark.servers]


async def start(component: Component) -> None:
    async with ProcessGroup() as group:
        await group.start([component])


def test_a_component_that_exits_before_ready_shows_the_end_of_its_log(tmp_path: Path) -> None:
    child = Component(name="doomed", argv=[sys.executable, "-c", "print('bad config: no model'); raise SystemExit(3)"],
                      ready_url=f"http://127.0.0.1:{free_ports(1)[0]}/readyz", log_path=tmp_path / "doomed.log",
                      ready_timeout_s=60.0)
    with pytest.raises(RuntimeError) as caught:
        asyncio.run(start(child))
    assert "doomed exited with 3 before it was ready" in str(caught.value)
    assert "bad config: no model" in str(caught.value)


@pytest.mark.envoy
def test_an_envoy_that_is_not_ready_says_which_init_targets_it_waits_for(tmp_path: Path) -> None:
    xds_port, admin_port = free_ports(2)  # nothing will listen on xds_port
    bootstrap = tmp_path / "envoy.yaml"
    bootstrap.write_text(render_bootstrap(node_id="envoy-unready", xds_port=xds_port, admin_port=admin_port))
    admin = f"http://127.0.0.1:{admin_port}"
    envoy = Component(name="envoy", argv=[find_envoy(), "-c", str(bootstrap), "--disable-hot-restart",
                                          "--log-level", "warning"],
                      ready_url=f"{admin}/ready", log_path=tmp_path / "envoy.log", ready_timeout_s=10.0,
                      diagnose_url=envoy_startup_stats_url(admin))
    with pytest.raises(RuntimeError) as caught:
        asyncio.run(start(envoy))
    message = str(caught.value)
    assert "envoy was not ready after 10s" in message
    # never connected to the control plane, so no CDS update yet
    assert "control_plane.connected_state: 0" in message and "cluster_manager.cds.update_success: 0" in message, \
        message
