"""A worker's slot count travels the real wire: the simulated worker's ``/metrics`` (``--sim-slots``), the
control plane's scrape and its rich EDS, ext_proc's ``XdsClient`` view, and ext_proc's costing of it.

Real processes (``python -m workers --simulate``, ``python -m control_plane``) and ext_proc's real xDS
client; every wait polls a condition with a deadline.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ext_proc.pick.cost import CostModel
from ext_proc.pick.costing import Costing
from ext_proc.model import RequestView
from ext_proc.pick.outstanding import Outstanding
from ext_proc.xds.client import XdsClient, XdsClientSettings

from .stack import running_control_plane, running_sim_workers, sample
from .test_ext_proc_service import until

pytestmark = [pytest.mark.slow, pytest.mark.servers]


def test_slots_reach_ext_proc_and_spread_the_work_it_costs(tmp_path: Path) -> None:
    with running_sim_workers(tmp_path, 1, args=["--sim-slots", "3"]) as (multi,), \
            running_sim_workers(tmp_path, 1) as (single,):
        assert sample(multi.metrics(), "inferlb_worker_slots") == 3.0
        assert sample(single.metrics(), "inferlb_worker_slots") == 1.0
        with running_control_plane(tmp_path, endpoints=[multi.id, single.id]) as cp:

            async def scenario() -> None:
                settings = XdsClientSettings(target=f"127.0.0.1:{cp.xds_port}", node_id="ext-proc-slots",
                                             node_cluster="inferlb-ext-proc")
                async with XdsClient(settings) as xds:
                    await xds.wait_ready(30)

                    def scraped() -> bool:
                        view = xds.view
                        return view is not None and all(
                            "slots" in view.by_id[e].telemetry for e in (multi.id, single.id))

                    await until(scraped, 30, "both workers' telemetry in ext_proc's EDS view")
                    view = xds.view
                    assert view is not None
                    endpoints = view.by_id
                    assert endpoints[multi.id].telemetry["slots"] == 3.0
                    assert endpoints[single.id].telemetry["slots"] == 1.0

                    # ext_proc's costing of that very view: two requests of ours on each worker
                    outstanding = Outstanding()
                    costing = Costing(CostModel(), outstanding)
                    pool = [endpoints[multi.id], endpoints[single.id]]
                    for i, e in enumerate(pool * 2):
                        outstanding.begin(i, e.id, 32, 0.01)
                    costing.new_view(pool, pool)
                    request = RequestView(tokens=32, estimated=False, model=None, inputs=1)
                    waits = {c.id: c.outstanding_s for c in costing.candidates(request, pool, observe=False)}
                    assert waits[multi.id] == 0.0  # the third slot is free
                    assert waits[single.id] >= 0.02  # both ahead of it, one at a time

            asyncio.run(scenario())
